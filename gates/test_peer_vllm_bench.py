"""vLLM's benchmark client (`vllm bench serve`, vllm.benchmarks.serve) against our DFlash
server: it completes every request, counts the tokens our server counted, and reads our
acceptance from /metrics once the server exports vLLM's counter names (--metrics-names
dflash,vllm; vLLM's client reads only `vllm:spec_decode*` lines, positions from 0).

vLLM's wheel (336 MB, vllm 0.33.0) runs its client on the CPU without its dependencies: `make
setup` installs it with --no-deps into .peers/ beside the modules the client imports
(requirements/peers.txt, tests/peer_clients.py). Without it the test skips, saying so.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.peer_clients import client_env, peer_server
from tests.server_process import REPO
from tests.test_serve_metrics import samples, value

pytestmark = pytest.mark.peers

NUM_PROMPTS = 8
OUTPUT_LEN = 8
# vLLM's own entry point with its own argument parser; prints the result dict as JSON
CLIENT = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(sys.argv[1:]))
print("RESULT " + json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, default=str))
"""


@pytest.fixture(scope="module")
def server(tiny_pair):
    # a random draft accepts nothing: --oracle-acceptance forces some for the client to read
    options = ("--metrics-names", "dflash,vllm", "--oracle-acceptance", "3")
    yield from peer_server(tiny_pair, "vllm.benchmarks.serve", "vLLM's benchmark client", *options)


def test_vllm_bench_serve_completes_counts_our_tokens_and_reads_our_acceptance(server) -> None:
    server, target = server
    before = samples(httpx.get(server.url + "/metrics", timeout=10).text)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            CLIENT,
            "--backend",
            "vllm",
            "--base-url",
            server.url,
            "--model",
            target.name,
            "--tokenizer",
            str(target),
            "--dataset-name",
            "random",
            "--random-input-len",
            "8",
            "--random-output-len",
            str(OUTPUT_LEN),
            "--num-prompts",
            str(NUM_PROMPTS),
            "--temperature",
            "0",
            "--ignore-eos",
            "--disable-tqdm",
        ],
        cwd=REPO,
        env=client_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    after = samples(httpx.get(server.url + "/metrics", timeout=10).text)

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
    tokens = delta("dflash:generation_tokens_total")
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN == tokens
    assert result["spec_decode_num_drafts"] == delta("dflash:spec_decode_num_drafts_total") > 0
    assert result["spec_decode_accepted_tokens"] == delta("dflash:spec_decode_num_accepted_tokens_total")
    drafts, accepted = result["spec_decode_num_drafts"], result["spec_decode_accepted_tokens"]
    assert result["spec_decode_acceptance_length"] == pytest.approx(1 + accepted / drafts)
