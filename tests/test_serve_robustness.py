"""The reference server against hostile and unlucky requests (a real subprocess on
127.0.0.1): one bad request never harms another, untrusted input is refused with 400/413
before it costs anything, a checkpoint's chat template cannot reach Python, and /health
tells the truth about the engine loop."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import httpx
import pytest
import torch

from reference_engine.checkpoint import load_target
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.request import SamplingParams
from reference_engine.serving.chat_template import compile_chat_template, render_chat_template
from reference_engine.serving.protocol import ProtocolError

from .poison import KILL, POISON
from .server_process import ServerProcess
from .test_serve import scrape

MAX_TOKENS = 10
PROMPTS = [[5, 17, 99], [200, 3, 8, 77, 150, 42], [11, 12]]
TIMEOUT = 20  # a hung request fails the test instead of hanging it


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3_5")


@pytest.fixture(scope="module")
def target(model_dir):
    return load_target(model_dir, dtype=torch.float64)


@pytest.fixture(scope="module")
def server(model_dir):
    """Our server with a planted poison (tests/poison.py): prompts starting with POISON turn
    NaN after a few tokens, prompts starting with KILL take the engine thread down."""
    server = ServerProcess(
        "--model", str(model_dir), "--dtype", "float64", "--max-num-seqs", "4", module="tests.poison"
    )
    yield server
    server.stop()


def expected(target, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return generate_plain(target, prompt, params).output_ids


async def stream(client: httpx.AsyncClient, url: str, body: dict) -> list:
    """Every SSE event of one streamed completion ("[DONE]" as the string)."""
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **body, "stream": True}
    events = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def tokens(events: list) -> list[int]:
    return [
        t for e in events if isinstance(e, dict) and e.get("choices") for t in e["choices"][0]["token_ids"]
    ]


# ------------------------------------------------------------------ engine isolation
def test_a_request_whose_arithmetic_fails_ends_alone_with_an_error_event(model_dir, target) -> None:
    server = ServerProcess(
        "--model", str(model_dir), "--dtype", "float64", "--max-num-seqs", "4", module="tests.poison"
    )
    try:
        check_isolation(server, target)
    finally:
        server.stop()


def check_isolation(server: ServerProcess, target) -> None:
    before = scrape(server.url)

    async def run():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            return await asyncio.gather(
                stream(client, server.url, {"prompt": [POISON, 40, 41]}),
                *(stream(client, server.url, {"prompt": p}) for p in PROMPTS),
            )

    bad, *good = asyncio.run(run())
    assert bad[-1] == "[DONE]" and "error" in bad[-2]
    assert "not finite" in bad[-2]["error"]["message"]
    assert [tokens(events) for events in good] == [expected(target, p) for p in PROMPTS]
    assert all(events[-1] == "[DONE]" and "error" not in events[-2] for events in good)
    plain = httpx.post(
        server.url + "/v1/completions",
        timeout=TIMEOUT,
        json={"prompt": [POISON, 40, 41], "max_tokens": MAX_TOKENS, "ignore_eos": True},
    )
    assert plain.status_code == 500 and plain.json()["error"]["type"] == "server_error"
    time.sleep(0.2)
    after = scrape(server.url)
    assert after["dflash:request_failure_total"] - before.get("dflash:request_failure_total", 0) == 2
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    request_id = bad[0]["id"]
    server.stop()
    log = server.proc.stdout.read()
    assert f"request {request_id} failed: numerical failure" in log


def test_a_tiny_temperature_is_greedy_and_harms_no_neighbour(model_dir) -> None:
    # float32 logits / 1e-40 overflow to inf and the softmax to NaN
    body = {"prompt": PROMPTS[0], "temperature": 1e-40, "seed": 3}
    server = ServerProcess("--model", str(model_dir), "--dtype", "float32")
    try:

        async def run():
            async with httpx.AsyncClient(timeout=TIMEOUT) as client:
                return await asyncio.gather(
                    stream(client, server.url, body), stream(client, server.url, {"prompt": PROMPTS[1]})
                )

        tiny, neighbour = asyncio.run(run())

        async def greedy(prompt):
            async with httpx.AsyncClient(timeout=TIMEOUT) as client:
                return tokens(await stream(client, server.url, {"prompt": prompt}))

        assert tokens(tiny) == asyncio.run(greedy(PROMPTS[0]))
        assert tokens(neighbour) == asyncio.run(greedy(PROMPTS[1]))
    finally:
        server.stop()


def test_health_is_unhealthy_when_the_engine_loop_is_gone(model_dir) -> None:
    server = ServerProcess("--model", str(model_dir), "--dtype", "float64", module="tests.poison")
    try:
        r = httpx.post(
            server.url + "/v1/completions", timeout=TIMEOUT, json={"prompt": [KILL, 1], "max_tokens": 2}
        )
        assert r.status_code == 500
        health = httpx.get(server.url + "/health", timeout=TIMEOUT)
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        later = httpx.post(
            server.url + "/v1/completions", timeout=TIMEOUT, json={"prompt": PROMPTS[0], "max_tokens": 2}
        )
        assert later.status_code == 500  # refused at once, not left hanging
    finally:
        server.stop()


# ------------------------------------------------------------------ hostile bodies
HOSTILE = [
    ("seed past int64", {"prompt": "hi", "temperature": 1, "seed": 2**70}),
    ("5000-digit integer", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}"),
    ("deeply nested JSON", b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("nesting past the limit", b'{"prompt": "hi", "x": ' + b"[" * 40 + b"]" * 40 + b"}"),
    ("lone surrogate", b'{"prompt": "hi \\ud800 there"}'),
    ("lone surrogate in chat", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
    ("lone surrogate in a key", b'{"prompt": "hi", "x": {"\\ud800": 1}}'),
    ("not UTF-8", b'{"prompt": "\xff\xfe"}'),
    ("NaN literal", b'{"prompt": "hi", "temperature": NaN}'),
    ("tiny repetition penalty", {"prompt": "hi", "repetition_penalty": 1e-300}),
    ("string for a boolean", {"prompt": "hi", "ignore_eos": "false"}),
    ("number for stream", {"prompt": "hi", "stream": 1}),
    (
        "string in stream_options",
        {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
    ),
    (
        "image content part",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}
            ]
        },
    ),
]


@pytest.mark.parametrize("what,body", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies_get_400_and_the_server_keeps_serving(server, target, what, body) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    path = "/v1/chat/completions" if b'"messages"' in content else "/v1/completions"
    r = httpx.post(
        server.url + path, content=content, timeout=TIMEOUT, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, (what, r.status_code, r.text[:300])
    assert r.json()["error"]["type"] == "invalid_request_error"
    ok = httpx.post(
        server.url + "/v1/completions",
        timeout=TIMEOUT,
        json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    )
    assert ok.json()["choices"][0]["token_ids"] == expected(target, PROMPTS[0])


def test_a_body_over_the_limit_gets_413_at_once_and_others_are_not_stalled(server) -> None:
    huge = json.dumps({"prompt": "word " * 2_000_000}).encode()  # 10 MB

    async def run():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:

            async def health_gaps() -> float:
                worst, end = 0.0, time.monotonic() + 1.5
                while time.monotonic() < end:
                    t = time.monotonic()
                    await client.get(server.url + "/health")
                    worst = max(worst, time.monotonic() - t)
                return worst

            big = client.post(
                server.url + "/v1/completions", content=huge, headers={"content-type": "application/json"}
            )
            return await asyncio.gather(big, health_gaps())

    start = time.monotonic()
    response, worst_health = asyncio.run(run())
    assert response.status_code == 413
    assert "at most 4194304" in response.json()["error"]["message"]
    assert time.monotonic() - start < 10
    assert worst_health < 1.0


def test_a_chunked_body_without_a_length_is_held_to_the_limit_too(server) -> None:
    """No Content-Length to refuse early: the body is counted as it arrives, and refused with
    413 once past the limit, not read whole."""

    def parts():
        yield b'{"prompt": "'
        for _ in range(600):  # 600 x 16 KiB = 9.4 MiB, past the 4 MiB limit
            yield b"w" * 16384
        yield b'"}'

    headers = {"content-type": "application/json"}
    r = httpx.post(server.url + "/v1/completions", content=parts(), timeout=TIMEOUT, headers=headers)
    assert r.status_code == 413, (r.status_code, r.text[:300])
    assert "at most 4194304" in r.json()["error"]["message"]


def _read(body: bytes, limits, chunk: int, declare_length: bool) -> bytes:
    """read_body on a real Starlette request carrying `body` in parts of `chunk` bytes."""
    from starlette.requests import Request

    from reference_engine.serving.limits import read_body

    headers = [(b"content-type", b"application/json")]
    if declare_length:
        headers.append((b"content-length", str(len(body)).encode()))
    parts = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [
        {"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)
    ]

    async def receive():
        return messages.pop(0)

    request = Request({"type": "http", "method": "POST", "headers": headers}, receive)
    return asyncio.run(read_body(request, limits))


@pytest.mark.parametrize("declare_length", [True, False], ids=["content-length", "chunked"])
def test_a_body_of_exactly_the_limit_is_read_and_one_byte_more_gets_413(declare_length: bool) -> None:
    """The limit is the most bytes accepted: a body of max_bytes is read whole, whether its
    length is declared or counted as it streams in; one byte more is refused with 413."""
    from reference_engine.serving.limits import BodyLimits

    limits = BodyLimits(max_bytes=100)
    body = b"[" + b"1," * 48 + b"10]"
    assert len(body) == 100 and _read(body, limits, 30, declare_length) == body
    with pytest.raises(ProtocolError, match="at most 100") as info:
        _read(body + b" ", limits, 30, declare_length)
    assert info.value.status == 413


def test_a_body_limit_of_zero_bytes_is_refused() -> None:
    from reference_engine.errors import ConfigError
    from reference_engine.serving.limits import BodyLimits

    with pytest.raises(ConfigError, match="body size limit must be positive, got 0 bytes"):
        BodyLimits(max_bytes=0)


def test_json_limits_accept_their_bound_and_refuse_one_past_it() -> None:
    """decode_json: nesting of exactly max_depth levels (the default, 32) is accepted and one
    more refused; an integer of max_int_digits digits is accepted, with or without its minus
    sign, and one digit more refused; a lone surrogate is refused even as the whole body."""
    from reference_engine.serving.limits import BodyLimits, decode_json

    limits = BodyLimits()
    assert limits.max_depth == 32
    deep = b"[" * 32 + b"]" * 32
    assert decode_json(deep, limits) is not None
    with pytest.raises(ProtocolError, match="more than 32 levels deep"):
        decode_json(b"[" + deep + b"]", limits)
    digits = b"9" * limits.max_int_digits
    assert decode_json(b"[" + digits + b", -" + digits + b"]", limits) == [int(digits), -int(digits)]
    with pytest.raises(ProtocolError, match="has 33 digits; at most 32"):
        decode_json(b"[" + digits + b"9]", limits)
    with pytest.raises(ProtocolError, match="invalid character"):
        decode_json(b'"\\ud800"', limits)


def test_a_large_prompt_under_the_limit_does_not_stall_the_event_loop(server) -> None:
    text = "word " * 600_000  # 3 MB: accepted size, too long for the context

    async def run():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:

            async def health_gaps() -> float:
                worst, end = 0.0, time.monotonic() + 2.0
                while time.monotonic() < end:
                    t = time.monotonic()
                    await client.get(server.url + "/health")
                    worst = max(worst, time.monotonic() - t)
                return worst

            big = client.post(server.url + "/v1/completions", json={"prompt": text})
            return await asyncio.gather(big, health_gaps())

    response, worst_health = asyncio.run(run())
    assert response.status_code == 400  # past the context
    assert worst_health < 1.0


# ------------------------------------------------------------------ chat content
def test_chat_content_as_a_list_of_text_parts_equals_the_string(server) -> None:
    def ids(content) -> list[int]:
        r = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=TIMEOUT,
            json={"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    assert ids(parts) == ids("Hello there")


# ------------------------------------------------------------------ untrusted checkpoint
ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{% for m in messages %}{{ m.update({'role': 'x'}) }}{% endfor %}",
    "{{ raise_exception('only user and assistant roles are supported') }}",
]


@pytest.mark.parametrize("template", ESCAPES, ids=["mro", "globals-os", "mutation", "raise"])
def test_a_template_reaching_for_python_is_refused_by_the_sandbox(template, tmp_path) -> None:
    marker = tmp_path / "pwned"
    compiled = compile_chat_template(template.replace("MARKER", str(marker)))
    with pytest.raises(ProtocolError, match="chat template failed"):
        render_chat_template(compiled, [{"role": "user", "content": "hi"}])
    assert not marker.exists()


def test_a_checkpoint_whose_template_runs_code_fails_the_request_not_the_server(model_dir, tmp_path) -> None:
    checkpoint = tmp_path / "evil"
    shutil.copytree(model_dir, checkpoint)
    marker = tmp_path / "pwned"
    config_path = checkpoint / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config["chat_template"] = ESCAPES[1].replace("MARKER", str(marker))
    config_path.write_text(json.dumps(config))
    server = ServerProcess("--model", str(checkpoint))
    try:
        r = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=TIMEOUT,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert r.status_code == 400, r.text
        assert "chat template failed" in r.json()["error"]["message"]
        assert (
            httpx.post(
                server.url + "/v1/completions", timeout=TIMEOUT, json={"prompt": "hi", "max_tokens": 2}
            ).status_code
            == 200
        )
    finally:
        server.stop()
    assert not marker.exists()


def test_info_names_torch_device_and_dtype_for_the_run_table(server) -> None:
    info = httpx.get(server.url + "/info", timeout=TIMEOUT).json()
    assert info["torch"] == torch.__version__
    assert (info["device"], info["dtype"], info["mode"]) == ("cpu", "float64", "plain")
