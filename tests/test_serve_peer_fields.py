"""What other tools read from our server (serving/metrics.py, app.py, protocol.py), over HTTP:
the acceptance counters under vLLM's names with vLLM's position numbering (--metrics-names),
OpenMetrics for a scraper that asks for it, completions' `text_offset`, and the default
temperature named in /info and in one warning."""

from __future__ import annotations

import json

import httpx
import pytest

from .server_process import ServerProcess
from .test_serve_metrics import samples, value

BODY = {"prompt": [5, 17, 99], "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_pair):
    target, draft = tiny_pair("qwen3", block_size=4)
    server = ServerProcess(
        "--model",
        str(target),
        "--dflash-draft-model-path",
        str(draft),
        "--dtype",
        "float64",
        "--metrics-names",
        "dflash,vllm",
        "--oracle-acceptance",  # a random draft accepts nothing: force some, so positions count
        "3",
    )
    yield server
    server.stop()


def per_position(page, prefix: str) -> dict[int, float]:
    return {
        int(dict(labels)["position"]): v
        for (name, labels), v in page.items()
        if name == f"{prefix}:spec_decode_num_accepted_tokens_per_pos_total"
    }


def test_vllm_names_count_what_ours_count_with_positions_from_0(server) -> None:
    assert httpx.post(server.url + "/v1/completions", json=BODY, timeout=60).status_code == 200
    page = samples(httpx.get(server.url + "/metrics", timeout=10).text)
    drafts = value(page, "dflash:spec_decode_num_drafts_total")
    assert drafts > 0
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        name = f"spec_decode_{name}_total"
        assert value(page, f"vllm:{name}") == value(page, f"dflash:{name}")
    ours, theirs = per_position(page, "dflash"), per_position(page, "vllm")
    assert ours and theirs == {k - 1: v for k, v in ours.items()}


def test_openmetrics_when_the_scraper_asks_for_it(server) -> None:
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    r = httpx.get(server.url + "/metrics", headers={"accept": accept}, timeout=10)
    assert r.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert r.text.endswith("# EOF\n")
    plain = httpx.get(server.url + "/metrics", timeout=10)
    assert plain.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"


def test_completion_logprobs_carry_text_offset_whole_and_streamed(server) -> None:
    whole = httpx.post(server.url + "/v1/completions", json={**BODY, "logprobs": 1}, timeout=60).json()
    logprobs = whole["choices"][0]["logprobs"]
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert len(offsets) == len(tokens) == BODY["max_tokens"]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    streamed = []
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**BODY, "logprobs": 1, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[len("data: ") :])["choices"]
                if choices and choices[0]["logprobs"]:
                    streamed += choices[0]["logprobs"]["text_offset"]
    assert streamed == offsets


def test_the_default_temperature_is_named_in_info_and_warned_about_once(server) -> None:
    assert httpx.get(server.url + "/info", timeout=10).json()["default_temperature"] == 1.0
    sampled = {k: v for k, v in BODY.items() if k != "temperature"}
    for _ in range(2):
        assert httpx.post(server.url + "/v1/completions", json=sampled, timeout=60).status_code == 200
    server.stop()
    log = server.proc.stdout.read()
    assert log.count("a request without 'temperature' samples at 1.0") == 1
