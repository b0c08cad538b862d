"""guidellm (`guidellm run`, its OpenAI HTTP backend on /v1/completions, streamed) against our
DFlash server: it completes every request and its output token total equals the tokens our
server counted.

guidellm sends no temperature unless told, and our default is OpenAI's 1.0: its requests would
sample. The scenario sends temperature 0 as an extra body field, as a user comparing with
greedy runs must (the server warns once on stderr about a request without one). HTTP/2 is off:
guidellm's httpx would need h2 for it, and our server speaks HTTP/1.1. guidellm 0.8.1 installs
with --no-deps into .peers/ with the modules its run imports (requirements/peers.txt,
tests/peer_clients.py); without it the test skips, saying so.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from tests.peer_clients import PeerRun, client_env, peer_job
from tests.test_serve_metrics import samples, value
from tests.together import Made

pytestmark = pytest.mark.peers

NUM_PROMPTS = 8
OUTPUT_LEN = 8


def scenario(url: str, target, report) -> dict:
    return {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": url,
                "model": target.name,
                "request_format": "/v1/completions",
                "http2": False,
                "extras": {"body": {"temperature": 0}},
            },
            "tokenizer": {"kind": "huggingface_auto", "model": str(target)},
            "profile": {"kind": "concurrent", "streams": [4]},
            "data": [{"kind": "synthetic_text", "prompt_tokens": 8, "output_tokens": OUTPUT_LEN}],
            "constraints": [{"kind": "max_requests", "count": NUM_PROMPTS}],
            "outputs": [{"kind": "json", "path": str(report)}],
        }
    }


def run_client(url: str, target: Path, folder: Path) -> subprocess.CompletedProcess:
    config, report = folder / "scenario.json", folder / "report.json"
    config.write_text(json.dumps(scenario(url, target, report)))
    return subprocess.run(
        [sys.executable, "-m", "guidellm", "run", "-c", str(config), "--disable-console-interactive"],
        cwd=folder,
        env=client_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def background_jobs(made: Made) -> dict[str, Callable[[], PeerRun]]:
    """The client's run against our DFlash server, in the background (tests/together.py)."""
    pair = made.tiny_pair("qwen3", block_size=4)
    folder = made.tmp_path_factory.mktemp("guidellm")
    client = partial(run_client, target=pair[0], folder=folder)
    job = peer_job(pair, "guidellm.benchmark", "guidellm", (), client)
    return {"test_guidellm_run_completes_and_counts_our_tokens": lambda: (folder, job())}


def test_guidellm_run_completes_and_counts_our_tokens(background) -> None:
    folder, run = background()
    if run.skipped:
        pytest.skip(run.skipped)
    done, report = run.done, folder / "report.json"
    assert done.returncode == 0 and report.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    benchmark = json.loads(report.read_text())["benchmarks"][0]
    before, after = samples(run.before), samples(run.after)
    tokens = value(after, "dflash:generation_tokens_total") - value(before, "dflash:generation_tokens_total")
    requests = benchmark["requests"]
    assert len(requests["successful"]) == NUM_PROMPTS
    assert not requests["errored"] and not requests["incomplete"]
    assert all(json.loads(r["request_args"])["body"]["temperature"] == 0 for r in requests["successful"])
    output = benchmark["metrics"]["output_token_count"]["successful"]["total_sum"]
    assert output == NUM_PROMPTS * OUTPUT_LEN == tokens
