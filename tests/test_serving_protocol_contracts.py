"""Contracts of the server's HTTP face (serving/protocol.py, replies.py, stop_strings.py,
app.py): what a request body may hold and the 400 (or 404) each wrong field gets; the SSE
events and whole replies a client reads (usage, logprobs, object names, content type); the
text a stop string cuts when a decoder rewrites what it already gave; and the routes
(/health, /v1/models, /info, /metrics, the admission of a draining server, where and when a
body is parsed).

The routes are exercised over real HTTP: the app (`create_app`) of a real server (a tiny
DFlash pair on the CPU, its engine on a thread) served by uvicorn on a loopback port in this
process, so a test can also look at and set the server's own state (draining, its parse)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import uvicorn

from reference_engine.serving.app import INLINE_PARSE_BYTES, TITLE, create_app
from reference_engine.serving.args import ServeArgs
from reference_engine.serving.protocol import ProtocolError
from reference_engine.serving.service import Server
from reference_engine.serving.stop_strings import StopStringText

from .server_process import free_port
from .test_protocol_fields import parsed
from .test_serve_metrics import samples, value

SERVED = "toy-served"
BLOCK = 4
MAX_NUM_SEQS = 3
TIMEOUT = 60
PROMPT = [5, 17, 99]
GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


# ------------------------------------------------------------------ a server on loopback
class LoopbackServer:
    """`create_app(server)` served by uvicorn on 127.0.0.1 from a thread of this process, the
    app's lifespan (its engine loop) included unless `lifespan` is "off"."""

    def __init__(self, server: Server, lifespan: str = "auto") -> None:
        self.server = server
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(
            create_app(server), host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan
        )
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + TIMEOUT
        while not self.uvicorn.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(TIMEOUT)


@pytest.fixture(scope="module")
def loopback(tiny_pair):
    target, draft = tiny_pair("qwen3", block_size=BLOCK)
    args = ServeArgs.parse(
        [
            "--model",
            str(target),
            "--dflash-draft-model-path",
            str(draft),
            "--dtype",
            "float32",
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--served-model-name",
            SERVED,
            "--engine-loop",
            "thread",
        ]
    )
    running = LoopbackServer(Server(args))
    yield running
    running.stop()


def post(loopback: LoopbackServer, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(loopback.url + path, json=body, timeout=TIMEOUT)


def refused_over_http(response: httpx.Response, param: str | None, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] in (status, "model_not_found"), error
    return error


def sse(loopback: LoopbackServer, body: dict, path: str = "/v1/completions") -> tuple[httpx.Headers, list]:
    """The response headers and the SSE events of a streamed request, each `data:` line's
    JSON (or "[DONE]"), read line by line as an SSE client reads them."""
    events = []
    with httpx.stream("POST", loopback.url + path, json={**body, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        headers = r.headers
        for line in r.iter_lines():
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
            else:
                assert line == "", line
    assert events[-1] == "[DONE]"
    return headers, events[:-1]


# ------------------------------------------------------------------ parse_request


def refused(param: str | None, chat: bool = False, status: int = 400, **body) -> ProtocolError:
    with pytest.raises(ProtocolError) as raised:
        parsed(chat=chat, **body)
    assert (raised.value.param, raised.value.status) == (param, status), (body, raised.value)
    return raised.value


def test_logit_bias_pairs_come_in_token_order_whatever_the_order_of_the_keys() -> None:
    """logit_bias is read into (token id, bias) pairs sorted by token id, so two requests that
    list the same biases in different orders are the same request."""
    one = parsed(logit_bias={"9": 1.5, "3": -2, "120": 0.25}).params
    other = parsed(logit_bias={"120": 0.25, "3": -2, "9": 1.5}).params
    assert one.logit_bias == ((3, -2.0), (9, 1.5), (120, 0.25))
    assert one == other


def test_a_token_named_twice_in_logit_bias_is_refused() -> None:
    """Two logit_bias keys that name the same token id ("42" and "042") give that token two
    biases: refused on logit_bias, as a JSON key given twice is."""
    refused("logit_bias", logit_bias={"42": 1, "042": 5})


def test_a_stream_asks_for_no_usage_unless_its_stream_options_do() -> None:
    """stream_options left out, or without include_usage or continuous_usage_stats, asks for
    neither; each is read on its own."""
    for options in (None, {}, {"include_usage": False}):
        body = {"stream": True} if options is None else {"stream": True, "stream_options": options}
        request = parsed(**body)
        assert (request.include_usage, request.continuous_usage) == (False, False), options
    request = parsed(stream=True, stream_options={"include_usage": True})
    assert (request.include_usage, request.continuous_usage) == (True, False)
    request = parsed(stream=True, stream_options={"continuous_usage_stats": True})
    assert (request.include_usage, request.continuous_usage) == (False, True)


def test_ignore_eos_is_off_unless_asked_for() -> None:
    """A request that leaves out ignore_eos (or sends null) stops at the end-of-text token;
    ignore_eos true turns that off."""
    assert parsed().params.ignore_eos is False
    assert parsed(chat=True, ignore_eos=None).params.ignore_eos is False
    assert parsed(ignore_eos=True).params.ignore_eos is True


def test_chat_max_completion_tokens_null_leaves_max_tokens_in_charge() -> None:
    """Chat max_completion_tokens sent as null is left out: max_tokens is the budget (5 is
    taken, 0 refused on max_tokens), as in a body without max_completion_tokens."""
    assert parsed(chat=True, max_completion_tokens=None, max_tokens=5).params.max_tokens == 5
    refused("max_tokens", chat=True, max_completion_tokens=None, max_tokens=0)


@pytest.mark.parametrize("kind", ["image_url", "input_text", "refusal"])
def test_a_content_part_that_is_not_of_type_text_is_refused_even_with_a_text_field(kind: str) -> None:
    """Only parts of type "text" make a chat message's content: a part of another type is a
    400 on messages, whatever fields it carries."""
    part = {"type": kind, "text": "caption", "image_url": {"url": "http://x"}}
    refused("messages", chat=True, messages=[{"role": "user", "content": [part]}])
    refused("messages", chat=True, messages=[{"role": "user", "content": [{"text": "no type"}]}])


def test_an_empty_message_list_is_refused() -> None:
    """A chat request needs at least one message: an empty list (which a chat template would
    render as a bare assistant turn) is a 400 on messages."""
    error = refused("messages", chat=True, messages=[])
    assert "non-empty" in str(error)


@pytest.mark.parametrize("role", ["function", "System", "user ", ""])
def test_a_role_outside_the_five_listed_is_refused(role: str) -> None:
    """The roles taken are system, developer, user, assistant and tool, spelled exactly:
    another (OpenAI's deprecated "function" among them) is a 400 on messages naming them."""
    error = refused("messages", chat=True, messages=[{"role": role, "content": "x"}])
    assert "system, developer, user, assistant, tool" in str(error)


def test_an_empty_model_name_is_an_unknown_model() -> None:
    """`model` names the served model when it is given at all: "" is not left out but an
    unknown model (404, model_not_found); null is left out."""
    error = refused("model", status=404, model="")
    assert error.code == "model_not_found"
    assert parsed(model=None).prompt_ids == parsed(model="m").prompt_ids


@pytest.mark.parametrize("top", [0, 3])
def test_chat_top_logprobs_without_logprobs_true_is_refused_even_when_zero(top: int) -> None:
    """Chat top_logprobs, 0 included, needs logprobs: true; without it (left out or false)
    it is a 400 on top_logprobs."""
    refused("top_logprobs", chat=True, top_logprobs=top)
    refused("top_logprobs", chat=True, logprobs=False, top_logprobs=top)
    assert parsed(chat=True, logprobs=True, top_logprobs=top).logprobs == top


def test_a_list_of_prompts_is_refused_as_a_batch() -> None:
    """A list of strings or of token lists is a batch of prompts: a 400 on prompt that says
    batches are not supported (not that the prompt has the wrong type)."""
    for prompt in (["a", "b"], ["only one"], [[1, 2], [3]]):
        assert "batched prompts are not supported" in str(refused("prompt", prompt=prompt)), prompt


@pytest.mark.parametrize("chat", [False, True])
def test_an_empty_prompt_is_refused_naming_the_prompt(chat: bool) -> None:
    """A prompt of no tokens (an empty string or list; a chat template that renders
    nothing) is a 400 on prompt from the parser itself."""
    if chat:
        error = refused("prompt", chat=True, messages=[{"role": "user", "content": ""}])
    else:
        refused("prompt", prompt="")
        error = refused("prompt", prompt=[])
    assert "the prompt is empty" in str(error)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("repetition_penalty", 0, "'repetition_penalty' must be in [0.01, 100.0], got 0"),
        ("repetition_penalty", 100.5, "'repetition_penalty' must be in [0.01, 100.0], got 100.5"),
        ("temperature", 2.5, "'temperature' must be in [0.0, 2.0], got 2.5"),
        ("presence_penalty", -3, "'presence_penalty' must be in [-2.0, 2.0], got -3"),
    ],
)
def test_a_sampling_number_out_of_range_is_refused_with_its_quoted_name_range_and_value(
    field: str, value: float, message: str
) -> None:
    """A number field out of its range is a 400 on that field whose message quotes the
    field's name and gives the range and the value sent; the ends of the repetition penalty's
    range are taken."""
    assert str(refused(field, **{field: value})) == message
    assert parsed(repetition_penalty=0.01).params.repetition_penalty == 0.01
    assert parsed(repetition_penalty=100).params.repetition_penalty == 100


@pytest.mark.parametrize("bias", [True, False])
def test_a_logit_bias_value_that_is_a_json_boolean_is_refused(bias: bool) -> None:
    """A logit_bias value is a number: true or false (which Python counts as 1 and 0) is a
    400 on logit_bias naming the token."""
    error = refused("logit_bias", logit_bias={"5": bias})
    assert "for token 5" in str(error)


@pytest.mark.parametrize("field", ["stream", "ignore_eos"])
@pytest.mark.parametrize("number", [0, 1])
def test_a_boolean_field_refuses_the_numbers_0_and_1(field: str, number: int) -> None:
    """A boolean field takes true or false only: 0 or 1 is a 400 on that field, as the
    booleans of stream_options are."""
    assert "must be true or false" in str(refused(field, **{field: number}))
    refused("include_usage", stream=True, stream_options={"include_usage": number})


# ------------------------------------------------------------------ replies over HTTP
def test_a_stream_without_stream_options_ends_without_a_usage_chunk(loopback) -> None:
    """Streamed without stream_options, every event before [DONE] is a chunk with its choice
    and no usage; with include_usage the last one is the usage chunk."""
    _, events = sse(loopback, {**GREEDY, "prompt": PROMPT})
    assert events and all(e["choices"] and "usage" not in e for e in events)
    assert sum(len(e["choices"][0]["token_ids"]) for e in events) == GREEDY["max_tokens"]
    _, events = sse(loopback, {**GREEDY, "prompt": PROMPT, "stream_options": {"include_usage": True}})
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == GREEDY["max_tokens"]


def test_continuous_usage_alone_puts_the_running_usage_in_each_chunk_and_adds_no_usage_chunk(
    loopback,
) -> None:
    """stream_options {continuous_usage_stats: true} without include_usage: each chunk carries
    the usage so far (completion tokens counting up to the total), and no usage-only chunk
    comes at the end."""
    body = {**GREEDY, "prompt": PROMPT, "stream_options": {"continuous_usage_stats": True}}
    _, events = sse(loopback, body)
    assert all(e["choices"] for e in events)
    counts, total = [], 0
    for e in events:
        total += len(e["choices"][0]["token_ids"])
        counts.append(e["usage"]["completion_tokens"])
        assert e["usage"]["prompt_tokens"] == len(PROMPT)
        assert e["usage"]["total_tokens"] == len(PROMPT) + total
    assert counts == sorted(counts) and counts[-1] == GREEDY["max_tokens"] == total


def test_a_stream_is_served_as_text_event_stream(loopback) -> None:
    """A streamed reply's Content-Type is text/event-stream, for completions and chat."""
    headers, _ = sse(loopback, {**GREEDY, "prompt": PROMPT})
    assert headers["content-type"].split(";")[0] == "text/event-stream"
    headers, _ = sse(
        loopback, {**GREEDY, "messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions"
    )
    assert headers["content-type"].split(";")[0] == "text/event-stream"


def test_a_chat_streams_usage_chunk_is_a_chat_completion_chunk(loopback) -> None:
    """Every event of a chat stream, the usage chunk at its end included, is a
    chat.completion.chunk of the served model under the stream's one id."""
    body = {
        **GREEDY,
        "messages": [{"role": "user", "content": "hi"}],
        "stream_options": {"include_usage": True},
    }
    _, events = sse(loopback, body, "/v1/chat/completions")
    assert events[-1]["choices"] == [] and "usage" in events[-1]
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert {e["model"] for e in events} == {SERVED}
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("chatcmpl-")


def test_streamed_completions_logprobs_0_give_each_tokens_own_logprob(loopback) -> None:
    """Completions logprobs 0 (the chosen token's logprob, no alternatives asked for): every
    chunk of the stream carries logprobs for its tokens, as the whole reply does."""
    body = {**GREEDY, "prompt": PROMPT, "logprobs": 0}
    whole = post(loopback, body).json()["choices"][0]["logprobs"]
    _, events = sse(loopback, body)
    streamed = [e["choices"][0]["logprobs"] for e in events]
    assert all(lp is not None for lp in streamed)
    assert [t for lp in streamed for t in lp["token_ids"]] == whole["token_ids"]
    assert [x for lp in streamed for x in lp["token_logprobs"]] == pytest.approx(whole["token_logprobs"])
    assert all(x <= 0 for x in whole["token_logprobs"]) and len(whole["token_ids"]) == GREEDY["max_tokens"]


# ------------------------------------------------------------------ stop strings
def test_a_stop_string_that_a_rewrite_makes_inside_text_already_sent_emits_nothing_more() -> None:
    """A decoder that rewrites text it already gave ("c" becomes "s" once "XYZ" follows) and
    so makes a stop string ("bs") that begins inside text already sent: the push that makes
    it emits no text (nothing after the stop string), takes its token and stops."""
    vocab = {0: "ab", 1: "c", 2: "XYZ"}

    def rewriting(ids: list[int]) -> str:
        text = "".join(vocab[i] for i in ids)
        return text.replace("c", "s") if 2 in ids else text

    stream = StopStringText(rewriting, ("bs",))
    assert stream.push([0], final=False) == ("a", [0])  # "b" may begin "bs"
    assert stream.push([1], final=False) == ("bc", [1])
    assert stream.push([2], final=False) == ("", [2])
    assert stream.stopped and stream.push([1], final=True) == ("", [])


# ------------------------------------------------------------------ the routes
def test_models_lists_the_served_model_by_its_served_name(loopback) -> None:
    """/v1/models is OpenAI's list of one model: the name the server serves under, and when
    the server took it (`created`, Unix seconds)."""
    r = httpx.get(loopback.url + "/v1/models", timeout=TIMEOUT)
    assert r.status_code == 200
    [entry] = r.json()["data"]
    created = entry.pop("created")
    assert isinstance(created, int) and created <= time.time()
    assert r.json()["object"] == "list"
    assert entry == {"id": SERVED, "object": "model", "owned_by": "reference_engine"}
    assert SERVED != TITLE
    ok = post(loopback, {**GREEDY, "prompt": PROMPT, "model": r.json()["data"][0]["id"]})
    assert ok.status_code == 200 and ok.json()["model"] == SERVED


def test_info_describes_a_dflash_server(loopback) -> None:
    """/info of a DFlash server: mode dflash, its draft's block size, its max_num_seqs, the
    engine loop on a thread and the served name."""
    info = httpx.get(loopback.url + "/info", timeout=TIMEOUT).json()
    assert info["mode"] == "dflash"
    assert (info["block_size"], info["max_num_seqs"]) == (BLOCK, MAX_NUM_SEQS)
    assert (info["engine_loop"], info["model"], info["dtype"]) == ("thread", SERVED, "float32")


@pytest.mark.parametrize(
    "accept",
    [
        "text/plain;version=0.0.4;q=0.5,application/openmetrics-text;version=1.0.0;q=0.9",
        "*/*, application/openmetrics-text",
    ],
)
def test_metrics_are_openmetrics_whenever_the_accept_header_names_them(loopback, accept: str) -> None:
    """/metrics is OpenMetrics (ending "# EOF") when the Accept header names
    application/openmetrics-text anywhere in its list, not only first; Prometheus text
    without it."""
    r = httpx.get(loopback.url + "/metrics", headers={"accept": accept}, timeout=TIMEOUT)
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.endswith("# EOF\n")
    plain = httpx.get(loopback.url + "/metrics", headers={"accept": "text/plain"}, timeout=TIMEOUT)
    assert plain.headers["content-type"].startswith("text/plain") and "# EOF" not in plain.text


def test_a_draining_server_refuses_new_requests_with_503_and_says_so_on_health(loopback) -> None:
    """While the server drains, /health is 503 {"status": "draining"} and a new completion or
    chat request is 503 service_unavailable; /v1/models still answers. Before and after,
    /health is 200 {"status": "ok"}."""
    health = httpx.get(loopback.url + "/health", timeout=TIMEOUT)
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    loopback.server.lifecycle.draining = True
    try:
        health = httpx.get(loopback.url + "/health", timeout=TIMEOUT)
        assert (health.status_code, health.json()) == (503, {"status": "draining"})
        for path, body in (
            ("/v1/completions", {**GREEDY, "prompt": PROMPT}),
            ("/v1/chat/completions", {**GREEDY, "messages": [{"role": "user", "content": "hi"}]}),
        ):
            r = post(loopback, body, path)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(loopback.url + "/v1/models", timeout=TIMEOUT).status_code == 200
    finally:
        loopback.server.lifecycle.draining = False
    assert httpx.get(loopback.url + "/health", timeout=TIMEOUT).status_code == 200


def test_health_is_503_when_the_engine_loop_is_not_alive(loopback, monkeypatch) -> None:
    """/health is 503 "unhealthy", with its reason, while the engine loop is not alive."""
    runner = loopback.server.lifecycle.runner
    monkeypatch.setattr(type(runner), "alive", property(lambda self: False))
    r = httpx.get(loopback.url + "/health", timeout=TIMEOUT)
    assert r.status_code == 503
    assert r.json() == {"status": "unhealthy", "reason": "the engine loop is not running"}


def test_a_completions_body_of_exactly_the_inline_size_is_parsed_on_the_event_loop(
    loopback, monkeypatch
) -> None:
    """A completions body of INLINE_PARSE_BYTES bytes is parsed on the event loop, one byte
    more on a worker thread."""
    on_loop: list[bool] = []
    parse = loopback.server.parse

    def recording(raw: bytes, chat: bool):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return parse(raw, chat)

    monkeypatch.setattr(loopback.server, "parse", recording)
    base = json.dumps({**GREEDY, "prompt": "hi", "pad": ""}).encode()
    for size in (INLINE_PARSE_BYTES, INLINE_PARSE_BYTES + 1):
        raw = base.replace(b'"pad": ""', b'"pad": "' + b"x" * (size - len(base)) + b'"')
        assert len(raw) == size
        r = httpx.post(
            loopback.url + "/v1/completions",
            content=raw,
            headers={"content-type": "application/json"},
            timeout=TIMEOUT,
        )
        assert r.status_code == 200, r.text
    assert on_loop == [True, False]


def test_a_requests_latency_is_counted_from_its_arrival_before_its_body_is_parsed(
    loopback, monkeypatch
) -> None:
    """The end-to-end latency and time to first token of a request count the time its body
    takes to parse: they run from when the route took the request."""
    delay = 0.3
    parse = loopback.server.parse

    def slow(raw: bytes, chat: bool):
        time.sleep(delay)
        return parse(raw, chat)

    def page() -> dict:
        return samples(httpx.get(loopback.url + "/metrics", timeout=TIMEOUT).text)

    names = ["dflash:e2e_request_latency_seconds", "dflash:time_to_first_token_seconds"]
    before = page()
    monkeypatch.setattr(loopback.server, "parse", slow)
    assert post(loopback, {**GREEDY, "prompt": PROMPT, "max_tokens": 1}).status_code == 200
    after = page()
    for name in names:
        assert value(after, f"{name}_count") - value(before, f"{name}_count") == 1, name
        assert value(after, f"{name}_sum") - value(before, f"{name}_sum") >= delay, name


def test_a_refusal_over_http_names_the_field_and_a_clean_request_still_works(loopback) -> None:
    """Over HTTP the parser's refusals are 400s naming their field (an empty message list,
    chat top_logprobs 0 without logprobs, a batch of string prompts, an empty prompt) or 404
    for an empty model name; a good request is served after them."""
    chat = "/v1/chat/completions"
    refused_over_http(post(loopback, {**GREEDY, "messages": []}, chat), "messages")
    hi = [{"role": "user", "content": "hi"}]
    refused_over_http(post(loopback, {**GREEDY, "messages": hi, "top_logprobs": 0}, chat), "top_logprobs")
    error = refused_over_http(post(loopback, {**GREEDY, "prompt": ["a", "b"]}), "prompt")
    assert "batched" in error["message"]
    refused_over_http(post(loopback, {**GREEDY, "prompt": ""}), "prompt")
    error = refused_over_http(post(loopback, {**GREEDY, "prompt": PROMPT, "model": ""}), "model", 404)
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
    ok = post(loopback, {**GREEDY, "prompt": PROMPT})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == GREEDY["max_tokens"]


def test_the_api_key_is_compared_byte_for_byte(loopback, monkeypatch) -> None:
    """With --api-key, the Authorization header must be "Bearer <key>" exactly: a value that
    ends in a byte Python counts as whitespace (0xA0, 0x85; HTTP keeps them, unlike spaces
    and tabs) or differs in case is 401, the exact one is served."""
    key = "sekret"
    monkeypatch.setattr(loopback.server, "api_key", key)
    keyed = LoopbackServer(loopback.server, lifespan="off")  # /v1/models needs no engine loop
    try:

        def status(authorization: bytes) -> int:
            r = httpx.get(keyed.url + "/v1/models", headers={"authorization": authorization}, timeout=TIMEOUT)
            return r.status_code

        assert status(b"Bearer sekret") == 200
        for wrong in (b"Bearer sekret\xa0", b"Bearer sekret\x85", b"\xa0Bearer sekret", b"bearer sekret"):
            assert status(wrong) == 401, wrong
    finally:
        keyed.stop()
