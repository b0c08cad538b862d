"""The server's routes (reference_engine/serving/app.py), in process: every route that the
API key protects refuses a missing or wrong key, the routes read from the app itself so that
a new one cannot be left out; and a streamed and a non-streamed reply to the same greedy
request carry the same tokens, text, finish_reason and usage (replies.py, generation.py)."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient
from starlette.routing import Route

from reference_engine.serving.app import INLINE_PARSE_BYTES, create_app
from reference_engine.serving.args import ServeArgs
from reference_engine.serving.protocol import ProtocolError
from reference_engine.serving.service import Server

KEY = "sekret"


@pytest.fixture(scope="module")
def pair_dirs(tiny_pair):
    return tiny_pair("qwen3_5", block_size=8)


def app_for(*argv: str):
    return create_app(Server(ServeArgs.parse(list(argv))))


# ------------------------------------------------------------------ the API key
def protected(path: str, scope: str) -> bool:
    return path.startswith("/v1/") if scope == "api" else path != "/health"


@pytest.mark.parametrize("scope", ["api", "all"])
def test_every_protected_route_refuses_a_missing_or_wrong_key(pair_dirs, scope: str) -> None:
    app = app_for("--model", str(pair_dirs[0]), "--api-key", KEY, "--api-key-scope", scope)
    routes = [
        (route.path, method)
        for route in app.routes
        if isinstance(route, Route)
        for method in sorted(route.methods)
    ]
    paths = {path for path, _ in routes}
    assert {
        "/health",
        "/info",
        "/metrics",
        "/docs",
        "/openapi.json",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
    } <= paths
    client = TestClient(app)  # no lifespan: no engine thread, and none is needed here
    for path, method in routes:
        headers = {
            "no key": {},
            "wrong key": {"Authorization": f"Bearer {KEY}x"},
            "right key": {"Authorization": f"Bearer {KEY}"},
        }
        replies = {
            what: client.request(method, path, headers=h, content=b"{}") for what, h in headers.items()
        }
        if not protected(path, scope):
            assert replies["no key"].status_code != 401, (path, method)
            continue
        for what in ("no key", "wrong key"):
            assert replies[what].status_code == 401, (path, method, what)
            if method != "HEAD":
                error = replies[what].json()["error"]
                assert error == {
                    "message": "missing or wrong API key",
                    "type": "authentication_error",
                    "param": None,
                    "code": 401,
                }
        assert replies["right key"].status_code != 401, (path, method)


# ------------------------------------------------------------------ one reply, two forms
@pytest.fixture(scope="module", params=["plain", "dflash"])
def client(request, pair_dirs):
    argv = ["--model", str(pair_dirs[0]), "--dtype", "float64"]
    if request.param == "dflash":
        argv += ["--dflash-draft-model-path", str(pair_dirs[1])]
    with TestClient(app_for(*argv)) as client:
        yield client


def full(client: TestClient, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    choice = data["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return {
        "ids": choice["token_ids"],
        "text": text,
        "finish_reason": choice["finish_reason"],
        "usage": data["usage"],
    }


def streamed(client: TestClient, path: str, body: dict) -> dict:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    got = {"ids": [], "text": "", "finish_reason": None, "usage": None}
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in map(json.loads, events[:-1]):
        assert "error" not in event, event
        if not event["choices"]:
            got["usage"] = event["usage"]
            continue
        choice = event["choices"][0]
        got["ids"] += choice["token_ids"]
        got["text"] += choice["delta"]["content"] if "delta" in choice else choice["text"]
        got["finish_reason"] = choice["finish_reason"] or got["finish_reason"]
    return got


def clean_stop(text: str) -> str | None:
    """Two characters from the middle of `text` that first occur there."""
    return next(
        (
            text[i : i + 2]
            for i in range(3, len(text) - 2)
            if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2] and text.find(text[i : i + 2]) == i
        ),
        None,
    )


def test_streamed_and_whole_replies_to_a_greedy_request_are_the_same(client) -> None:
    greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    requests = [
        ("/v1/completions", {**greedy, "prompt": [200, 3, 8, 77, 150, 42]}),
        ("/v1/completions", {**greedy, "prompt": "Hello world", "max_tokens": 1}),
        ("/v1/chat/completions", {**greedy, "messages": [{"role": "user", "content": "What is a cache?"}]}),
    ]
    stop = clean_stop(full(client, *requests[0])["text"])
    if stop is not None:
        requests.append(("/v1/completions", {**requests[0][1], "stop": [stop]}))
    for path, body in requests:
        whole = full(client, path, body)
        assert streamed(client, path, body) == whole, (path, body)
        assert whole["usage"]["completion_tokens"] == len(whole["ids"])
    if stop is not None:
        assert whole["finish_reason"] == "stop" and stop not in whole["text"]


# ------------------------------------------------------------------ where a body is parsed
def test_a_small_completions_body_is_parsed_on_the_event_loop_a_large_or_chat_one_on_a_worker_thread(
    pair_dirs, monkeypatch
) -> None:
    """A worker thread waits for the interpreter lock under load (milliseconds of time to
    first token); a large body's tokenising would stall every stream on the loop."""
    on_loop = []

    def parse(self, raw: bytes, chat: bool):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        raise ProtocolError("parsed", None)

    monkeypatch.setattr(Server, "parse", parse)
    client = TestClient(app_for("--model", str(pair_dirs[0])))  # no lifespan: no engine needed
    for prompt in ("hi", "x" * INLINE_PARSE_BYTES):
        reply = client.post("/v1/completions", json={"model": "m", "prompt": prompt})
        assert reply.status_code == 400 and "parsed" in reply.text
    # a chat body renders the checkpoint's template: on a worker thread, however small
    reply = client.post(
        "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert reply.status_code == 400 and "parsed" in reply.text
    assert on_loop == [True, False, False]
