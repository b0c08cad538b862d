"""The server's routes (reference_engine/serving/app.py), in process: every route that the
API key protects refuses a missing or wrong key, the routes read from the app itself so that
a new one cannot be left out; and a streamed and a non-streamed reply to the same greedy
request carry the same tokens, text, finish_reason and usage (replies.py, generation.py).
With a scripted engine loop in place of the engine, each reply is made from exactly the step
outputs given: a stop string cut inside a chunk, an error, a shutdown, a reply cut short."""

from __future__ import annotations

import asyncio
import itertools
import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from starlette.routing import Route

from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.sequence import Sequence
from reference_engine.serving.app import INLINE_PARSE_BYTES, create_app
from reference_engine.serving.args import ServeArgs
from reference_engine.serving.async_engine import EngineTotals, RequestFailed, ShuttingDown
from reference_engine.serving.generation import Generation
from reference_engine.serving.metrics import ServerMetrics
from reference_engine.serving.protocol import ParsedRequest, ProtocolError
from reference_engine.serving.replies import full_reply, respond, sse_reply
from reference_engine.serving.service import Server

from .test_serve_engine_loop import ScriptedEngine, out
from .test_serve_metrics import samples, value

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


# ------------------------------------------------------------------ a scripted engine loop
# The asyncio side of the engine (async_engine.py `AsyncEngine`) with the loop's turns
# delivered by the test: a request's events (generation.py) and both replies (replies.py)
# made from exactly the step outputs given, in process and at once.
VOCAB = {0: "Hel", 1: "lo", 2: " wo", 3: "rld", 4: "!", 5: " E", 6: "ND", 7: "\n"}


def toy_decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def scripted_server(
    engine: ScriptedEngine, detokenize=toy_decode, skipped_ids=frozenset(), token_bytes=None
) -> SimpleNamespace:
    numbers = itertools.count(1)
    return SimpleNamespace(
        detokenize=detokenize,
        token_bytes=token_bytes or (lambda t: detokenize([t]).encode()),
        skipped_ids=skipped_ids,
        metrics=ServerMetrics(),
        lifecycle=SimpleNamespace(runner=engine),
        name="toy",
        new_request_id=lambda chat: f"cmpl-{next(numbers)}",
    )


def parsed_request(**fields) -> ParsedRequest:
    defaults = dict(
        prompt_ids=[0, 1],
        params=SamplingParams(max_tokens=16),
        stop=(),
        stream=False,
        include_usage=False,
        continuous_usage=False,
        logprobs=None,
        chat=False,
    )
    return ParsedRequest(**{**defaults, **fields})


async def started(
    server, engine: ScriptedEngine, parsed: ParsedRequest, arrival_s: float = 0.0
) -> Generation:
    """A generation the scripted engine took."""
    starting = asyncio.create_task(Generation.start(server, parsed, arrival_s))
    await asyncio.sleep(0)
    request_id = engine.sent[-1][1]
    engine.receive([("added", request_id, None)], EngineTotals())
    return await starting


def sse_events(stream: list[str]) -> list:
    assert all(s.startswith("data: ") and s.endswith("\n\n") for s in stream)
    return [s[6:-2] if s[6:-2] == "[DONE]" else json.loads(s[6:-2]) for s in stream]


def metrics_page(server) -> dict:
    """Every sample of the server's /metrics page."""
    return samples(server.metrics.render(EngineTotals())[0])


async def answered(
    parsed: ParsedRequest,
    turns: list[list[tuple]],
    error: Exception | None = None,
    sequence: Sequence | None = None,
    **server,
):
    """The reply to one request (whole, or its error; or its SSE events when `parsed.stream`)
    whose engine turns are `turns` (each a list of `out` arguments: ids, finish_reason,
    time_s, logprobs), all delivered before the reply reads, then its end (with `sequence`
    and `error`); with the scripted engine and the server (`server`: scripted_server's
    fields)."""
    engine = ScriptedEngine()
    server = scripted_server(engine, **server)
    generation = await started(server, engine, parsed)
    rid = generation.request_id
    for outputs in turns:
        engine.receive([out(rid, *o) for o in outputs], EngineTotals())
    engine.receive([("end", rid, sequence, error)], EngineTotals())
    try:
        if parsed.stream:
            reply = sse_events([s async for s in sse_reply(server, generation)])
        else:
            reply = await full_reply(server, generation)
    except ProtocolError as exc:  # the whole reply's error
        reply = exc
    finally:
        generation.close()
    return reply, engine, server


async def paced(parsed, turns: list[list[tuple]], sequence: Sequence | None = None):
    """The reply to one request (the SSE events when `parsed.stream`, else the whole reply)
    read by the real reply generator while the engine runs: each turn (a list of `out`
    arguments: ids, finish_reason, time_s, logprobs) reaches the request only once the reply
    has read the one before, so every turn is a chunk of its own; then the request's end
    with `sequence`."""
    engine = ScriptedEngine()
    server = scripted_server(engine)
    generation = await started(server, engine, parsed)
    rid = generation.request_id
    if parsed.stream:
        reading = asyncio.ensure_future(_collect(sse_reply(server, generation)))
    else:
        reading = asyncio.ensure_future(full_reply(server, generation))
    try:
        for outputs in turns:
            await asyncio.sleep(0)
            engine.receive([out(rid, *o) for o in outputs], EngineTotals())
            for _ in range(5):
                await asyncio.sleep(0)
        engine.receive([("end", rid, sequence, None)], EngineTotals())
        reply = await asyncio.wait_for(reading, 5)
    finally:
        generation.close()
    return (sse_events(reply) if parsed.stream else reply), engine, server


async def _collect(stream) -> list[str]:
    return [s async for s in stream]


def entries(ids: list[int]) -> list[dict[int, float]]:
    """Top-2 logprobs for each of `ids`: the token's own and another's."""
    return [{t: -0.5, (t + 1) % len(VOCAB): -1.5} for t in ids]


def test_the_server_skips_its_tokenizers_special_tokens_when_it_detokenises(pair_dirs) -> None:
    """The ids the server's detokenisation never decodes are its tokenizer's special tokens,
    which its decode drops wherever they stand."""
    server = Server(ServeArgs.parse(["--model", str(pair_dirs[0])]))
    tok = server.tokenizer
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    assert special and server.skipped_ids == special
    words = tok.encode("Hello world").ids
    assert not special & set(words)
    ids = [*special, *words, *special, *words]
    assert server.detokenize(ids) == server.detokenize([i for i in ids if i not in special])


@pytest.mark.parametrize("stream", [False, True])
def test_a_run_of_special_tokens_costs_the_reply_no_decoding(stream: bool) -> None:
    """A model that repeats a special token (id 8 here, which the toy decode drops) for
    hundreds of tokens: a generation never decodes it (the server's skipped ids), so the
    decodes are those of the few text tokens, and the text is theirs."""
    calls: list[list[int]] = []

    def decode(ids: list[int]) -> str:
        calls.append(ids)
        return toy_decode([i for i in ids if i != 8])

    parsed = parsed_request(stream=stream, params=SamplingParams(max_tokens=1000))
    turns = [[([8] * 3, None, float(t), None)] for t in range(200)] + [[([0, 1, 8], "length", 201.0, None)]]
    reply, _, _ = asyncio.run(answered(parsed, turns, detokenize=decode, skipped_ids=frozenset({8})))
    if stream:
        text = "".join(e["choices"][0]["text"] for e in reply[:-1] if e["choices"])
    else:
        text = reply["choices"][0]["text"]
    assert text == "Hello"
    assert len(calls) <= 3, len(calls)  # the two text tokens' chunk, and the whole decode at the end
    assert not any(8 in ids for ids in calls[:-1])


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_cut_inside_a_chunk_ends_the_reply_there_once(stream: bool) -> None:
    """A stop string completed by the third token of a four-token chunk: the reply is the
    text before it and the ids through that token, with their logprobs only; finish_reason
    "stop" comes once, the request is aborted, and the tokens the engine committed before
    the abort landed are neither sent nor counted."""
    parsed = parsed_request(stop=("o w",), logprobs=1, stream=stream, include_usage=stream)
    turns = [
        [([0, 1, 2, 3], None, 1.0, entries([0, 1, 2, 3]))],
        [([4], None, 2.0, entries([4]))],  # before the abort landed
        [([5, 6], "length", 3.0, entries([5, 6]))],
    ]
    reply, engine, server = asyncio.run(answered(parsed, turns))
    if stream:
        assert reply[-1] == "[DONE]"
        chunks = [e for e in reply[:-1] if e["choices"]]
        choices = [e["choices"][0] for e in chunks]
        text = "".join(c["text"] for c in choices)
        ids = [t for c in choices for t in c["token_ids"]]
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["stop"]
        assert choices[-1]["finish_reason"] == "stop"
        top = [entry for c in choices if c["logprobs"] for entry in c["logprobs"]["top_logprobs"]]
        assert reply[-2]["usage"]["completion_tokens"] == 3
    else:
        choice = reply["choices"][0]
        text, ids = choice["text"], choice["token_ids"]
        assert choice["finish_reason"] == "stop"
        top = choice["logprobs"]["top_logprobs"]
        assert choice["logprobs"]["tokens"] == ["Hel", "lo", " wo"]
        assert reply["usage"]["completion_tokens"] == 3
    assert (text, ids) == ("Hell", [0, 1, 2])
    assert len(top) == 3
    assert engine.sent.count(("abort", "cmpl-1")) == 1
    page = metrics_page(server)
    assert value(page, "dflash:generation_tokens_total") == 3
    assert value(page, "dflash:request_success_total", finish_reason="stop") == 1
    assert value(page, "dflash:time_to_first_token_seconds_sum") == 1.0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "error, status, failed",
    [(ShuttingDown("the grace period ran out"), 503, False), (RequestFailed("numerical failure"), 500, True)],
    ids=["shut down", "engine failure"],
)
def test_a_request_the_server_shut_down_on_gets_503_and_is_counted_as_aborted(
    error: Exception, status: int, failed: bool, stream: bool
) -> None:
    """The shutdown's grace period ran out (ShuttingDown): the client gets 503 (an error event,
    then [DONE], when streamed), and the request is counted under "abort", not as one the
    engine failed; a request the engine failed gets 500 and is counted as a failure."""
    parsed = parsed_request(stream=stream)
    reply, _, server = asyncio.run(answered(parsed, [[([0, 1], None, 1.0)]], error=error))
    if stream:
        assert reply[-1] == "[DONE]" and reply[-2]["error"]["code"] == status
    else:
        assert isinstance(reply, ProtocolError) and reply.status == status
    page = metrics_page(server)
    assert value(page, "dflash:request_failure_total") == (1 if failed else 0)
    assert value(page, "dflash:request_success_total", finish_reason="abort") == (0 if failed else 1)


def test_a_request_the_engine_loop_cannot_take_is_a_500_counted_as_a_failure() -> None:
    """The engine loop is not running: the request gets 500 at once, and it is counted, as a
    failure, like every request that reached the engine's door."""
    engine = ScriptedEngine()
    engine.running = False
    server = scripted_server(engine)
    with pytest.raises(ProtocolError) as caught:
        asyncio.run(Generation.start(server, parsed_request(), 0.0))
    assert caught.value.status == 500
    page = metrics_page(server)
    assert value(page, "dflash:request_failure_total") == 1
    assert value(page, "dflash:e2e_request_latency_seconds_count") == 1


def test_a_streamed_chat_reply_names_the_role_once_and_carries_usage_only_as_asked() -> None:
    """A chat stream's first chunk carries the role, the others only content; each chunk
    carries the running usage with continuous_usage_stats, else `usage: null` (OpenAI's chunk
    object with include_usage), and the usage chunk at the end comes with include_usage."""
    turns = [[([0, 1], None, 1.0)], [([2], None, 2.0)], [([3], "length", 3.0)]]
    for continuous in (False, True):
        parsed = parsed_request(chat=True, stream=True, include_usage=True, continuous_usage=continuous)
        reply, _, _ = asyncio.run(paced(parsed, turns))
        chunks = [e for e in reply[:-1] if e["choices"]]
        assert ["role" in c["choices"][0]["delta"] for c in chunks] == [True, False, False]
        if continuous:
            assert [c["usage"]["completion_tokens"] for c in chunks] == [2, 3, 4]
        else:
            assert all("usage" in c and c["usage"] is None for c in chunks)
        assert reply[-2]["choices"] == [] and reply[-2]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stop", [(), ("o w",), ("ld!",), ("ND\n",)])
@pytest.mark.parametrize("logprobs", [None, 1])
def test_the_steps_a_stream_fell_behind_by_reach_it_as_one_chunk_of_what_one_a_step_carries(
    chat: bool, stop: tuple[str, ...], logprobs: int | None
) -> None:
    """Turns that wait for a stream (its reply still writing the chunk before) come out as
    one chunk: the same text, ids, logprobs, finish and usage as one chunk a turn, and the
    server's metrics count each turn's tokens at the time the engine committed them."""
    times = [1.0, 1.5, 2.5, 2.75, 4.0]
    steps = [[0, 1], [2], [3, 4], [5], [6, 7]]
    turns = [
        [(ids, "length" if k == len(steps) - 1 else None, at, entries(ids) if logprobs else None)]
        for k, (ids, at) in enumerate(zip(steps, times))
    ]
    parsed = parsed_request(
        chat=chat,
        stop=stop,
        logprobs=logprobs,
        stream=True,
        include_usage=True,
        params=SamplingParams(max_tokens=8),
    )
    behind, behind_server = asyncio.run(answered(parsed, turns))[::2]
    paced_reply, _, paced_server = asyncio.run(paced(parsed, turns))

    def read(reply: list) -> tuple:
        choices = [e["choices"][0] for e in reply[:-1] if e["choices"]]
        texts = [c["delta"].get("content", "") if chat else c["text"] for c in choices]
        top = [
            entry
            for c in choices
            if c["logprobs"]
            for entry in c["logprobs"]["top_logprobs" if not chat else "content"]
        ]
        return (
            "".join(texts),
            [t for c in choices for t in c["token_ids"]],
            top,
            [c["finish_reason"] for c in choices if c["finish_reason"]],
            reply[-2]["usage"],
        )

    assert read(behind) == read(paced_reply)
    assert len([e for e in behind[:-1] if e["choices"]]) == 1
    assert len([e for e in paced_reply[:-1] if e["choices"]]) > 1
    counted = [
        "dflash:generation_tokens_total",
        "dflash:time_to_first_token_seconds_sum",
        "dflash:inter_token_latency_seconds_count",
        "dflash:inter_token_latency_seconds_sum",
    ]
    assert [value(metrics_page(behind_server), name) for name in counted] == [
        value(metrics_page(paced_server), name) for name in counted
    ]
    if not stop:
        assert value(metrics_page(behind_server), "dflash:inter_token_latency_seconds_sum") == pytest.approx(
            3.0
        )


def test_a_request_that_ends_without_a_finish_reason_is_reported_as_aborted() -> None:
    """The engine ended the request without finishing it (the server stopped its engine):
    the whole reply has what was committed and finish_reason "abort"."""
    reply, _, _ = asyncio.run(answered(parsed_request(), [[([0, 1], None, 1.0)]]))
    choice = reply["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("Hello", "abort")


def test_a_whole_reply_cut_short_aborts_its_request_and_counts_it_as_aborted() -> None:
    """A non-streamed reply whose handler is cancelled while it waits (the server going
    away under it): its request is aborted in the engine and counted once, as "abort"."""
    engine = ScriptedEngine()
    server = scripted_server(engine)

    async def scenario() -> None:
        replying = asyncio.create_task(respond(server, parsed_request(), 0.0))
        await asyncio.sleep(0)
        rid = engine.sent[-1][1]
        engine.receive([("added", rid, None), out(rid, [0], None, 1.0)], EngineTotals())
        for _ in range(3):
            await asyncio.sleep(0)
        replying.cancel()
        with pytest.raises(asyncio.CancelledError):
            await replying
        assert engine.sent[-1] == ("abort", rid)

    asyncio.run(scenario())
    page = metrics_page(server)
    assert value(page, "dflash:request_success_total", finish_reason="abort") == 1
