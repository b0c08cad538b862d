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

import httpx
import pytest

from tests.peer_clients import client_env, peer_server
from tests.test_serve_metrics import samples, value

pytestmark = pytest.mark.peers

NUM_PROMPTS = 8
OUTPUT_LEN = 8


@pytest.fixture(scope="module")
def server(tiny_pair):
    yield from peer_server(tiny_pair, "guidellm.benchmark", "guidellm")


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


def test_guidellm_run_completes_and_counts_our_tokens(server, tmp_path) -> None:
    server, target = server
    config, report = tmp_path / "scenario.json", tmp_path / "report.json"
    config.write_text(json.dumps(scenario(server.url, target, report)))
    before = samples(httpx.get(server.url + "/metrics", timeout=10).text)
    done = subprocess.run(
        [sys.executable, "-m", "guidellm", "run", "-c", str(config), "--disable-console-interactive"],
        cwd=tmp_path,
        env=client_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and report.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    benchmark = json.loads(report.read_text())["benchmarks"][0]
    after = samples(httpx.get(server.url + "/metrics", timeout=10).text)
    tokens = value(after, "dflash:generation_tokens_total") - value(before, "dflash:generation_tokens_total")
    requests = benchmark["requests"]
    assert len(requests["successful"]) == NUM_PROMPTS
    assert not requests["errored"] and not requests["incomplete"]
    assert all(json.loads(r["request_args"])["body"]["temperature"] == 0 for r in requests["successful"])
    output = benchmark["metrics"]["output_token_count"]["successful"]["total_sum"]
    assert output == NUM_PROMPTS * OUTPUT_LEN == tokens
