"""The reference server as users run it: a real subprocess on 127.0.0.1, a real HTTP client."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from reference_engine.checkpoint import load_target
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.request import SamplingParams

from .server_process import REPO, ServerProcess

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def pair_dirs(tiny_pair):
    return tiny_pair("qwen3_5", block_size=8)


@pytest.fixture(scope="module")
def plain_server(pair_dirs):
    server = ServerProcess("--model", str(pair_dirs[0]), "--dtype", "float64")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def dflash_server(pair_dirs):
    server = ServerProcess(
        "--model",
        str(pair_dirs[0]),
        "--dflash-draft-model-path",
        str(pair_dirs[1]),
        "--dtype",
        "float64",
        "--max-num-seqs",
        "8",
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def target(pair_dirs):
    return load_target(pair_dirs[0], dtype=torch.float64)


def plain_ids(target, prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return generate_plain(target, prompt_ids, SamplingParams(max_tokens=max_tokens)).output_ids


def complete(url: str, **body) -> httpx.Response:
    body.setdefault("max_tokens", MAX_TOKENS)
    body.setdefault("temperature", 0)
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def stream_chunks(url: str, path: str = "/v1/completions", **body) -> list[dict]:
    body.setdefault("max_tokens", MAX_TOKENS)
    body.setdefault("temperature", 0)
    chunks = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                chunks.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
    return chunks


PROMPTS = [[5, 17, 99], [200, 3, 8, 77, 150, 42], [11]]


# ------------------------------------------------------------------ outputs
def test_health_and_models(plain_server) -> None:
    assert httpx.get(plain_server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(plain_server.url + "/v1/models").json()
    assert models["data"][0]["object"] == "model"


@pytest.mark.parametrize("which", ["plain", "dflash"])
def test_non_streaming_and_streaming_equal_plain_greedy(
    plain_server, dflash_server, target, which: str
) -> None:
    server = plain_server if which == "plain" else dflash_server
    for prompt in PROMPTS:
        expected = plain_ids(target, prompt)
        body = complete(server.url, prompt=prompt).json()
        assert body["choices"][0]["token_ids"] == expected
        assert body["usage"]["completion_tokens"] == len(expected)
        chunks = stream_chunks(server.url, prompt=prompt)
        assert chunks[-1] == "[DONE]"
        streamed = [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]]
        assert streamed == expected
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        if which == "dflash":
            spec = body["spec_decode"]
            assert sum(spec["acceptance_lengths"]) + 1 == len(expected)


def test_text_prompt_and_chat_template(dflash_server, target, pair_dirs) -> None:
    from reference_engine.tokenizer import CHAT_TEMPLATE, load_tokenizer

    tokenizer = load_tokenizer(pair_dirs[0])
    body = complete(dflash_server.url, prompt="Hello world").json()
    assert body["choices"][0]["token_ids"] == plain_ids(target, tokenizer.encode("Hello world").ids)
    import jinja2

    messages = [{"role": "user", "content": "What is a cache?"}]
    rendered = (
        jinja2.Environment().from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    )
    # ChatML as Qwen checkpoints write it: the assistant's turn opens on a line of its own
    assert rendered == "<|im_start|>user\nWhat is a cache?<|im_end|>\n<|im_start|>assistant\n"
    chat = httpx.post(
        dflash_server.url + "/v1/chat/completions",
        timeout=60,
        json={"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0},
    ).json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["token_ids"] == plain_ids(target, tokenizer.encode(rendered).ids)
    chunks = stream_chunks(
        dflash_server.url,
        "/v1/chat/completions",
        messages=messages,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] == MAX_TOKENS
    assert "spec_decode" in chunks[-2]
    assert all("usage" in c for c in chunks[:-2])


def test_stop_strings_and_logprobs(plain_server, target) -> None:
    prompt = PROMPTS[1]
    full = complete(plain_server.url, prompt=prompt).json()["choices"][0]
    stop = full["text"][3:6]
    if not stop.strip() or "\ufffd" in stop:
        pytest.skip("no clean stop string in this output")
    cut = complete(plain_server.url, prompt=prompt, stop=[stop]).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and stop not in cut["text"]
    assert full["text"].startswith(cut["text"])
    lp = complete(plain_server.url, prompt=prompt, logprobs=2).json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == MAX_TOKENS
    assert all(v <= 0 for v in lp["token_logprobs"])


# ------------------------------------------------------------------ metrics
def scrape(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_prometheus_counters_move_by_exactly_the_engine_statistics(dflash_server) -> None:
    before = scrape(dflash_server.url)
    specs = [complete(dflash_server.url, prompt=p, max_tokens=9).json()["spec_decode"] for p in PROMPTS]
    time.sleep(0.2)  # the engine thread updates counters right after the step
    after = scrape(dflash_server.url)

    def diff(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert diff("dflash:spec_decode_num_drafts_total") == sum(s["steps"] for s in specs)
    assert diff("dflash:spec_decode_num_draft_tokens_total") == sum(s["proposed"] for s in specs)
    assert diff("dflash:spec_decode_num_accepted_tokens_total") == sum(s["accepted"] for s in specs)
    per_pos = sum(
        diff(k) for k in after if k.startswith("dflash:spec_decode_num_accepted_tokens_per_pos_total")
    )
    assert per_pos == sum(s["accepted"] for s in specs)
    assert diff('dflash:request_success_total{finish_reason="length"}') == len(PROMPTS)
    assert diff("dflash:generation_tokens_total") == 9 * len(PROMPTS)
    assert 'dflash:time_to_first_token_seconds_bucket{le="0.0005"}' in after
    # one request at a time: each of its drafted steps is an engine step of its own (its
    # prefill shares the first)
    assert diff("dflash:engine_steps_total") >= sum(s["steps"] for s in specs) > 0
    used = diff('dflash:spec_decode_draft_ahead_total{outcome="used"}')
    assert used <= diff('dflash:spec_decode_draft_ahead_total{outcome="queued"}')


# ------------------------------------------------------------------ robustness
BAD_BODIES = [
    ("malformed JSON", b"{not json"),
    ("body not an object", b"[1, 2]"),
    ("max_tokens wrong type", {"prompt": "hi", "max_tokens": "ten"}),
    ("temperature wrong type", {"prompt": "hi", "temperature": "hot"}),
    ("prompt wrong type", {"prompt": 5}),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -3}),
    ("huge max_tokens", {"prompt": "hi", "max_tokens": 10**9}),
    ("prompt past the context", {"prompt": [5] * 5000, "max_tokens": 4}),
    ("token ids outside the vocabulary", {"prompt": [1, 2, 10**6]}),
    ("empty prompt", {"prompt": ""}),
    ("empty token list", {"prompt": []}),
    ("unsupported n", {"prompt": "hi", "n": 3}),
    ("temperature out of range", {"prompt": "hi", "temperature": 9}),
    ("top_p out of range", {"prompt": "hi", "top_p": 0}),
    ("batched prompts", {"prompt": ["a", "b"]}),
    ("bad stop", {"prompt": "hi", "stop": [1]}),
]


@pytest.mark.parametrize("what,body", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_requests_get_400_and_the_server_keeps_serving(dflash_server, target, what, body) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        dflash_server.url + "/v1/completions",
        content=content,
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400, (what, r.text)
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    ok = complete(dflash_server.url, prompt=PROMPTS[0])
    assert ok.json()["choices"][0]["token_ids"] == plain_ids(target, PROMPTS[0])


def test_api_key_is_required_when_set(pair_dirs) -> None:
    server = ServerProcess("--model", str(pair_dirs[0]), "--api-key", "sekret")
    try:
        assert complete(server.url, prompt="hi").status_code == 401
        wrong = httpx.post(
            server.url + "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"}
        )
        assert wrong.status_code == 401
        assert wrong.json()["error"]["type"] == "authentication_error"
        good = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 2},
            headers={"Authorization": "Bearer sekret"},
            timeout=30,
        )
        assert good.status_code == 200
    finally:
        server.stop()


def test_disconnect_frees_the_slot_and_overload_gets_429(pair_dirs) -> None:
    server = ServerProcess(
        "--model", str(pair_dirs[0]), "--max-num-seqs", "2", "--max-waiting", "1", "--max-model-len", "4096"
    )
    try:
        long = {"prompt": [7, 8, 9], "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
        # two clients read one chunk each, then hang up mid-stream
        for _ in range(2):
            with httpx.stream(
                "POST", server.url + "/v1/completions", json={**long, "stream": True}, timeout=30
            ) as r:
                next(r.iter_lines())
        deadline = time.monotonic() + 20
        while scrape(server.url).get("dflash:num_requests_running", 0) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert scrape(server.url)["dflash:num_requests_running"] == 0

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as client:
                tasks = [
                    client.post(server.url + "/v1/completions", json={**long, "max_tokens": 200})
                    for _ in range(6)
                ]
                return [r.status_code for r in await asyncio.gather(*tasks)]

        codes = asyncio.run(burst())
        assert codes.count(200) >= 3 and 429 in codes and set(codes) <= {200, 429}
        assert complete(server.url, prompt="hi", max_tokens=2).status_code == 200
    finally:
        server.stop()


def test_sigterm_shuts_down_cleanly_with_a_request_in_flight(pair_dirs) -> None:
    server = ServerProcess("--model", str(pair_dirs[0]), "--max-model-len", "4096")
    body = {"prompt": [7, 8, 9], "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        try:
            for _ in lines:  # the stream ends instead of hanging
                pass
        except httpx.RemoteProtocolError:
            pass  # cancelled mid-chunk: the connection closes, which is also an end
    # uvicorn re-raises SIGTERM after its graceful shutdown, so the exit reads as the signal
    assert server.proc.wait(20) in (0, -signal.SIGTERM)
    assert "Traceback" not in server.proc.stdout.read()
    assert time.monotonic() - start < 20


def test_startup_rejects_a_mismatched_pair(tiny_checkpoint, tiny_pair) -> None:
    other = tiny_checkpoint("qwen3_5", hidden=96)
    _, draft = tiny_pair("qwen3_5", block_size=4)  # a draft for the hidden-64 target
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "reference_engine.serve",
            "--model",
            str(other),
            "--dflash-draft-model-path",
            str(draft),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert re.search(r"hidden_size 64 does not match the target's 96", done.stderr)
    assert "Traceback" not in done.stderr


def test_a_server_that_measures_its_step_costs_prints_them_at_start(pair_dirs) -> None:
    """`--measure-step-costs`: the table the verify width chooses from, on the start-up log,
    one entry per measured (rows, width), in milliseconds (plain steps among the widths). One
    thread per operator: the start-up times 48 steps, and operators whose threads wait for a
    core the other test processes hold ran them past the start-up deadline."""
    draft = ("--dflash-draft-model-path", str(pair_dirs[1]))
    server = ServerProcess(
        "--model", str(pair_dirs[0]), *draft, "--max-num-seqs", "2", "--measure-step-costs", "--threads", "1"
    )
    assert server.stop() in (0, -signal.SIGTERM)
    lines = [line for line in server.proc.stdout.read().splitlines() if line.startswith("step ms by rows")]
    assert len(lines) == 1, lines
    pairs = [pair.split() for pair in lines[0].split(": ", 1)[1].split(", ")]
    assert [key for key, _ in pairs] == ["1x0", "1x1", "1x3", "1x7", "2x0", "2x1", "2x3", "2x7"]
    assert all(float(ms) > 0 for _, ms in pairs)


def test_an_engine_whose_costs_were_not_measured_has_none_to_print(pair_dirs) -> None:
    from reference_engine.checkpoint import load_draft
    from reference_engine.runtime.engine import Engine, EngineConfig
    from reference_engine.serving.engine_build import EngineInfo

    target = load_target(pair_dirs[0], dtype=torch.float32)
    draft = load_draft(pair_dirs[1], target)
    for measured in (False, True):
        engine = Engine(target, draft, EngineConfig(max_num_seqs=1, measure_step_costs=measured))
        costs = EngineInfo.of(engine).step_costs
        assert (costs is not None) == measured
    assert EngineInfo.of(Engine(target, None, EngineConfig(max_num_seqs=1))).step_costs is None


# ------------------------------------------------------------------ load
def test_64_concurrent_streams_lose_and_duplicate_nothing(dflash_server, target) -> None:
    prompts = [[(i * 7 + j) % 400 + 1 for j in range(1 + i % 9)] for i in range(64)]
    expected = [plain_ids(target, p, 8) for p in prompts]

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        tokens = []
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
        async with client.stream("POST", dflash_server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    tokens += json.loads(line[6:])["choices"][0]["token_ids"]
        return tokens

    async def run() -> list[list[int]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    start = time.monotonic()
    got = asyncio.run(run())
    elapsed = time.monotonic() - start
    assert got == expected
    print(f"\n64 concurrent streams, 8 tokens each: {elapsed:.1f} s, 0 errors")
