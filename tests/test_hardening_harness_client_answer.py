"""Contracts of the harness's HTTP client, answer reading, divergences, resumed folders and
workloads, on real inputs (a server on loopback, files on disk):

- the benchmark client (harness/client.py): the API key goes out as a bearer token, and no
  Authorization header without one; a reply of any status but 200, 201 included, fails
  named by its status and counts no token, though its body be a whole stream; a request
  that gets no byte within the timeout fails saying so, in seconds; TTFT is the first and
  E2E the last token-bearing chunk, a usage-only chunk moves neither; SGLang's body asks
  `max_new_tokens`, and the extra fields given go into every kind's body and win; a
  token-id prompt goes to a server that takes text only as the tokenizer's decoded text;
  with a tokenizer each chunk counts the tokens its text adds to the text so far; a plain
  chat stream's content deltas are its tokens, its role-only delta none; `send` records a
  stream event that is JSON but not a chunk's shape as a failure, never raising; a chat
  stream's reasoning deltas carry tokens.
- answers read by `harness compare` (harness/answer.py): no compared request asks for
  `ignore_eos`, and each is greedy; a streamed one asks for the usage chunk (the running
  count where the server keeps one), a whole one for no stream; no reply within the
  timeout is `timeout`; a whole reply that is JSON but not an object, or whose choice has
  index `false`, is malformed, `choices: []` is empty, an `error` object beside a choice
  is an error object; a stream event that is not an object is malformed, over HTTP and for
  the stream reader alone; a reply of a shape not foreseen is a malformed body, never
  another exception.
- workloads (harness/workloads.py): the `mixed` built-in set is the sets in name order,
  whatever order the folder lists them in; a JSONL dataset's rows end at line feeds only, so a
  prompt holding a raw U+2028 or U+0085 reads whole; a chat row's messages are objects.
- divergences (harness/divergence.py): as many tool calls, one with other arguments, are a
  `tool_calls` mismatch showing that call on each side.
- resumed folders (harness/resume.py): an empty summary.csv is removed, not set aside.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from harness.answer import (
    Answer,
    AnswerError,
    Ask,
    ask_server,
    read_stream,
    read_whole,
    request_body,
)
from harness.client import Endpoint, RequestRecord, StreamReader, payload, send
from harness.divergence import ids_round
from harness.resume import repair_summary
from harness.server_kind import KNOWN, ServerKind
from harness.tokens import TextTokenizer
from harness.workloads import Prompt, WorkloadError, builtin, load_jsonl
from reference_engine.demo import DEMO_TARGET


# ----------------------------------------------------------------------------- a loopback server
class Replies:
    """A server on loopback that answers every POST with (status, content type, body), after
    `delay_s`, and keeps each request's headers and JSON body; with `every_s` the body's
    events go out one at a time, that far apart."""

    def __init__(
        self,
        status: int,
        body: bytes,
        content_type: str = "text/event-stream",
        delay_s: float = 0.0,
        every_s: float = 0.0,
    ):
        self.headers: list[dict] = []
        self.bodies: list[dict] = []
        replies = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                replies.headers.append(dict(self.headers))
                replies.bodies.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0)))))
                time.sleep(delay_s)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    pieces = [e + b"\n\n" for e in body.split(b"\n\n") if e] if every_s else [body]
                    for piece in pieces:
                        self.wfile.write(piece)
                        self.wfile.flush()
                        time.sleep(every_s)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Replies:
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def sse(*events: dict | str) -> bytes:
    """Each event as one `data:` line, then [DONE]."""
    lines = [e if isinstance(e, str) else json.dumps(e) for e in events]
    return ("".join(f"data: {line}\n\n" for line in lines) + "data: [DONE]\n\n").encode()


def chunk(text: str, ids: list[int] | None, finish: str | None = None) -> dict:
    choice: dict = {"index": 0, "text": text, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {"choices": [choice]}


HONEST = sse(chunk("a", [1]), chunk("b", [2], "length"), {"choices": [], "usage": {"completion_tokens": 2}})


def bench(endpoint: Endpoint, body: dict, timeout: float = 10.0) -> RequestRecord:
    async def go() -> RequestRecord:
        async with httpx.AsyncClient() as client:
            return await send(client, endpoint, body, 0, time.perf_counter(), timeout)

    return asyncio.run(go())


def ask(endpoint: Endpoint, request: Ask, stream: bool, timeout: float = 10.0):
    """The answer, or the AnswerError, of one request as `harness compare` reads it."""

    async def go():
        async with httpx.AsyncClient(timeout=timeout) as client:
            try:
                return await ask_server(client, endpoint, request, logprobs=False, stream=stream)
            except AnswerError as exc:
                return exc

    return asyncio.run(go())


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(DEMO_TARGET)


# ----------------------------------------------------------------------------- the benchmark client
def test_the_api_key_goes_out_as_a_bearer_token_from_both_clients() -> None:
    """`--api-key` reaches the server as `Authorization: Bearer KEY`, from the benchmark client
    and from `harness compare` alike; without a key no Authorization header is sent."""
    with Replies(200, HONEST) as server:
        assert bench(Endpoint(server.url, api_key="sekret"), {"prompt": "x", "max_tokens": 2}).success
        assert not isinstance(
            ask(Endpoint(server.url, api_key="sekret"), Ask(2, prompt="x"), stream=True), AnswerError
        )
        assert bench(Endpoint(server.url), {"prompt": "x", "max_tokens": 2}).success
    assert [h.get("Authorization") for h in server.headers] == ["Bearer sekret", "Bearer sekret", None]


@pytest.mark.parametrize("status", [201, 400, 404, 422])
def test_a_reply_of_any_status_but_200_fails_even_when_its_body_is_a_whole_stream(status: int) -> None:
    """A status other than 200 is no answer, whatever the body: the record fails, its error
    names the status, and no token is counted."""
    with Replies(status, HONEST) as server:
        record = bench(Endpoint(server.url), {"prompt": "x", "max_tokens": 2})
    assert not record.success and record.error.startswith(f"HTTP {status}: ")
    assert record.output_tokens == 0 and record.chunk_tokens == []


def test_a_request_without_a_byte_within_the_timeout_says_it_timed_out() -> None:
    """A server that answers nothing within the timeout: the request fails as timed out, the
    error naming the timeout."""
    with Replies(200, HONEST, delay_s=1.5) as server:
        record = bench(Endpoint(server.url), {"prompt": "x"}, timeout=0.3)
    assert not record.success and record.error == "timed out after 0.3 s"


def test_a_stream_that_outlasts_the_timeout_times_out_though_its_tokens_keep_coming() -> None:
    """The timeout is the request's, not each wait's: a stream that sends a token every 0.2 s
    for 1.4 s fails at a timeout of 0.6 s (no single wait is that long), both as the load
    generator sends it and as `harness compare` asks; with a timeout past its end it passes."""
    events = [chunk(c, [i]) for i, c in enumerate("abcdef")] + [chunk("g", [9], "length")]
    body = sse(*events)
    with Replies(200, body, every_s=0.2) as server:
        t0 = time.perf_counter()
        record = bench(Endpoint(server.url), {"prompt": "x", "max_tokens": 7}, timeout=0.6)
        assert not record.success and record.error == "timed out after 0.6 s"
        assert time.perf_counter() - t0 < 1.2
        assert bench(Endpoint(server.url), {"prompt": "x", "max_tokens": 7}, timeout=5.0).success
        answer = ask(Endpoint(server.url), Ask(7, prompt="x"), stream=True, timeout=0.6)
        assert isinstance(answer, AnswerError) and answer.name == "timeout"


def test_the_e2e_time_is_the_last_token_bearing_chunks_and_usage_chunks_do_not_move_it() -> None:
    """Over three token chunks at 0.1, 0.2, 0.4 s and a usage-only chunk at 0.9 s: TTFT is the
    first, E2E the last token-bearing one, never the usage chunk."""
    reader = StreamReader(Endpoint("http://127.0.0.1:9"), RequestRecord(0, 0.0), max_tokens=4)
    for now, event in [
        (0.1, chunk("a", [1])),
        (0.2, chunk("b", [2])),
        (0.4, chunk("cd", [3, 4], "length")),
        (0.9, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}),
    ]:
        assert reader.event(json.dumps(event), now) is False
    assert reader.event("[DONE]", 1.0) is True
    record = reader.finish()
    assert record.success, record.error
    assert (record.ttft_s, record.e2e_s, record.chunk_times_s) == (0.1, 0.4, [0.1, 0.2, 0.4])
    assert (record.output_tokens, record.usage_completion_tokens, record.prompt_tokens) == (4, 4, 3)


def test_each_endpoint_kinds_body_asks_for_the_tokens_and_carries_the_extra_fields() -> None:
    """SGLang's native body asks `max_new_tokens` for the output length; the extra fields given
    are added to every kind's body and win over the harness's own."""
    prompt = Prompt(token_ids=(5, 6, 7))
    body = payload(Endpoint("http://h", kind="sglang"), prompt, 16, extra={"rid": "r1"})
    assert body["sampling_params"]["max_new_tokens"] == 16 and body["input_ids"] == [5, 6, 7]
    assert body["rid"] == "r1"
    body = payload(Endpoint("http://h"), prompt, 16, extra={"temperature": 0.7, "seed": 3})
    assert (body["max_tokens"], body["temperature"], body["seed"], body["prompt"]) == (16, 0.7, 3, [5, 6, 7])


def test_a_token_id_prompt_goes_to_a_text_only_server_as_its_decoded_text(tokenizer) -> None:
    """A server that takes no token-id prompts gets the ids' text, decoded by the tokenizer."""
    ids = tuple(tokenizer.encode("hello world"))
    endpoint = Endpoint("http://h", server=ServerKind("openai"), tokenizer=tokenizer)
    assert payload(endpoint, Prompt(token_ids=ids), 4)["prompt"] == "hello world"
    chat = Endpoint("http://h", kind="chat", tokenizer=tokenizer)
    assert payload(chat, Prompt(token_ids=ids), 4)["messages"] == [{"role": "user", "content": "hello world"}]


def test_with_a_tokenizer_each_chunk_counts_the_tokens_its_text_adds(tokenizer) -> None:
    """A server that reports no ids or running usage, read with the model's tokenizer: each
    chunk counts the growth of the token count of the text streamed so far, and the request's
    tokens are the count of the whole text."""
    pieces = ["hello", " world", ", hello", " again"]
    reader = StreamReader(
        Endpoint("http://127.0.0.1:9", server=KNOWN["openai"], tokenizer=tokenizer), RequestRecord(0, 0.0)
    )
    for n, piece in enumerate(pieces):
        finish = "length" if n == len(pieces) - 1 else None
        reader.event(json.dumps(chunk(piece, None, finish)), 0.1 * (n + 1))
    record = reader.finish()
    assert record.success and record.count_source == "tokenizer" and not record.estimated_counts
    totals = [len(tokenizer.encode("".join(pieces[: n + 1]))) for n in range(len(pieces))]
    assert sum(record.chunk_tokens) == record.output_tokens == totals[-1]
    assert record.chunk_tokens == [b - a for a, b in zip([0, *totals], totals) if b > a]


@pytest.mark.parametrize(
    "event",
    [
        "[1, 2]",
        '"a"',
        '{"choices": ["a"]}',
        '{"choices": [{"index": 0, "text": "a", "token_ids": 7, "finish_reason": null}]}',
        '{"choices": [{"index": 0, "text": "a", "finish_reason": null}], "usage": 7}',
    ],
    ids=["list", "string", "choice-string", "ids-int", "usage-int"],
)
def test_an_event_that_is_not_an_answers_shape_is_a_failed_request_never_an_exception(event: str) -> None:
    """`send` never raises: a stream event that is JSON but not a chunk's shape fails the
    request with an error, as broken JSON does."""
    with Replies(200, sse(event, chunk("b", [2], "length"))) as server:
        record = bench(Endpoint(server.url), {"prompt": "x", "max_tokens": 2})
    assert not record.success and record.error


def test_a_plain_chat_streams_content_deltas_are_its_tokens_over_http() -> None:
    """A chat stream from a server that reports no ids: the role-only delta carries no token,
    each content delta counts one (estimated), and TTFT is the first content delta's."""
    deltas = [
        ({"role": "assistant", "content": ""}, None),
        ({"content": "Hel"}, None),
        ({"content": "lo"}, "stop"),
    ]
    body = sse(*({"choices": [{"index": 0, "delta": d, "finish_reason": f}]} for d, f in deltas))
    with Replies(200, body) as server:
        endpoint = Endpoint(server.url, kind="chat", server=KNOWN["openai"])
        record = bench(endpoint, payload(endpoint, Prompt(text="hi"), 4))
    assert server.bodies[0]["messages"] == [{"role": "user", "content": "hi"}]
    assert record.success and (record.output_tokens, record.chunk_tokens) == (2, [1, 1])
    assert record.count_source == "estimated" and record.estimated_counts and record.done_marker


def test_a_chat_streams_reasoning_deltas_carry_tokens() -> None:
    """A reasoning model's chat stream from a plain OpenAI server (no ids, no running usage):
    its first chunk, a reasoning delta, is the first token; every chunk carries one."""
    endpoint = Endpoint("http://127.0.0.1:9", kind="chat", server=KNOWN["openai"])
    reader = StreamReader(endpoint, RequestRecord(0, 0.0))
    for now, delta, finish in [
        (0.1, {"role": "assistant", "reasoning_content": "Let"}, None),
        (0.2, {"reasoning_content": " me"}, None),
        (0.5, {"content": "Hi"}, "stop"),
    ]:
        reader.event(json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}), now)
    reader.event("[DONE]", 0.6)
    record = reader.finish()
    assert record.success and record.ttft_s == 0.1 and record.output_tokens == 3


def test_a_chat_delta_with_its_reasoning_under_both_names_counts_it_once(tokenizer) -> None:
    """A server moving between the field names sends a delta's reasoning as both
    `reasoning_content` and `reasoning`, the same text: the tokens are counted once."""
    endpoint = Endpoint("http://127.0.0.1:9", kind="chat", server=KNOWN["openai"], tokenizer=tokenizer)
    reader = StreamReader(endpoint, RequestRecord(0, 0.0))
    for now, delta, finish in [
        (0.1, {"role": "assistant", "reasoning_content": "Let me", "reasoning": "Let me"}, None),
        (0.2, {"content": " see"}, "stop"),
    ]:
        reader.event(json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}), now)
    reader.event("[DONE]", 0.3)
    record = reader.finish()
    assert record.success and record.output_tokens == len(tokenizer.encode("Let me see"))


# ----------------------------------------------------------------------------- answers compared
def test_a_compared_request_never_asks_the_server_to_ignore_its_end_of_sequence() -> None:
    """`harness compare` checks answers as the server ends them: its requests carry no
    `ignore_eos` even to a server that accepts it, and are greedy."""
    for kind in ("ours", "vllm", "sglang"):
        for request in (Ask(4, prompt="hi"), Ask(4, messages=({"role": "user", "content": "hi"},))):
            body = request_body(Endpoint("http://h", server=KNOWN[kind]), request, logprobs=True, stream=True)
            assert "ignore_eos" not in body and body["temperature"] == 0, (kind, body)


def test_a_streamed_compared_request_asks_for_usage_and_a_whole_one_does_not() -> None:
    """A streamed request asks for the usage chunk (with the running count where the server
    keeps one, so each chunk's count can be checked); a whole one carries no stream fields."""
    ours, plain = Endpoint("http://h"), Endpoint("http://h", server=KNOWN["openai"])
    streamed = request_body(ours, Ask(4, prompt="hi"), logprobs=False, stream=True)
    assert streamed["stream"] is True
    assert streamed["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    streamed = request_body(plain, Ask(4, prompt="hi"), logprobs=False, stream=True)
    assert streamed["stream_options"] == {"include_usage": True}
    whole = request_body(ours, Ask(4, prompt="hi"), logprobs=False, stream=False)
    assert "stream" not in whole and "stream_options" not in whole


def test_no_reply_within_the_timeout_is_named_timeout() -> None:
    """A server that answers nothing within the timeout: `timeout`, never a connection error."""
    with Replies(200, HONEST, delay_s=1.5) as server:
        for stream in (True, False):
            refused = ask(Endpoint(server.url), Ask(2, prompt="x"), stream=stream, timeout=0.3)
            assert isinstance(refused, AnswerError) and refused.name == "timeout", refused


@pytest.mark.parametrize(
    ("content", "name"),
    [
        (b"[1, 2]", "malformed_body"),
        (b'{"choices": []}', "empty_choices"),
        (
            json.dumps({"choices": [{**chunk("a", None, "stop")["choices"][0], "index": False}]}).encode(),
            "malformed_body",
        ),
        (
            json.dumps({"error": {"message": "busy"}, **chunk("a", None, "stop")}).encode(),
            "error_object",
        ),
    ],
    ids=["not-an-object", "no-choice", "index-false", "error-beside-choices"],
)
def test_a_whole_reply_is_named_by_what_it_lacks(content: bytes, name: str) -> None:
    """A whole reply that is JSON but not an object is malformed; `choices: []` is empty; a
    choice whose index is `false` is not choice 0; an `error` object with HTTP 200 is an
    error object even beside a choice."""
    with pytest.raises(AnswerError) as refused:
        read_whole(content, chat=False)
    assert refused.value.name == name, refused.value


def test_a_stream_event_that_is_not_an_object_is_a_malformed_body_over_http() -> None:
    """`harness compare` names a stream event that is JSON but not an object, never a crash."""
    with Replies(200, sse(chunk("a", [1]), "[1, 2]", chunk("b", [2], "length"))) as server:
        refused = ask(Endpoint(server.url), Ask(2, prompt="x"), stream=True)
    assert isinstance(refused, AnswerError) and refused.name == "malformed_body", refused


def test_a_stream_event_that_is_not_an_object_is_named_by_the_stream_reader_itself() -> None:
    """The stream reader names an event that is JSON but not an object, whoever calls it."""
    with pytest.raises(AnswerError) as refused:
        read_stream(sse(chunk("a", [1]), "[1, 2]", chunk("b", [2], "length")), chat=False)
    assert refused.value.name == "malformed_body" and "event 1 is not an object" in refused.value.message


def test_a_reply_of_a_shape_not_foreseen_is_a_malformed_body_never_an_exception() -> None:
    """Chat logprobs whose `content` is a number, not a list of entries: a malformed body."""
    body = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "a"},
                "logprobs": {"content": 5},
                "finish_reason": "stop",
            }
        ]
    }
    with Replies(200, json.dumps(body).encode(), content_type="application/json") as server:
        chat = Ask(2, messages=({"role": "user", "content": "hi"},))
        refused = ask(Endpoint(server.url), chat, stream=False)
    assert isinstance(refused, AnswerError) and refused.name == "malformed_body", refused


# ----------------------------------------------------------------------------- workloads
def test_the_mixed_builtin_set_is_every_set_in_name_order_whatever_the_folder_lists() -> None:
    """`mixed` is the built-in sets one after another in the order of their names (chat, code,
    math), each prompt knowing its set and index: the same prompts in the same order on every
    machine, whatever order the file system lists the files in."""
    names = ("chat", "code", "math")
    mixed = builtin("mixed")
    assert mixed == [p for name in names for p in builtin(name)]
    assert [p.source for p in mixed] == [
        f"builtin:{name}#{i}" for name in names for i in range(len(builtin(name)))
    ]


@pytest.mark.parametrize("char", ["\u2028", "\x85"], ids=["U+2028", "U+0085"])
def test_a_dataset_prompt_with_a_raw_unicode_line_separator_reads_whole(tmp_path: Path, char: str) -> None:
    """A row's prompt text may hold any character JSON allows raw; the rows are its lines."""
    path = tmp_path / "data.jsonl"
    rows = [{"prompt": f"one{char}two"}, {"prompt": "three"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    prompts = load_jsonl(path)
    assert [p.text for p in prompts] == [f"one{char}two", "three"]
    assert [p.source for p in prompts] == [f"{path}:1", f"{path}:2"]


def test_a_chat_row_whose_messages_are_not_objects_is_refused_naming_its_line(tmp_path: Path) -> None:
    """A row's `messages` is a list of message objects; a list of strings is refused."""
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "fine"}\n{"messages": ["hello"]}\n')
    with pytest.raises(WorkloadError, match=re.escape(f"{path}:2")):
        load_jsonl(path)


# ----------------------------------------------------------------------------- divergences
def test_other_tool_calls_of_the_same_number_are_a_difference() -> None:
    """The same text and as many tool calls, one with other arguments: a tool_calls mismatch
    naming that call."""
    call = {"type": "function", "name": "f", "arguments": '{"x": 1}'}
    base = Answer("", [1, 2], "tool_calls", tool_calls=[call])
    cand = Answer("", [1, 2], "tool_calls", tool_calls=[{**call, "arguments": '{"x": 2}'}])
    divergence, agreed = ids_round(base, cand, 0, 0.1)
    assert (divergence.what, divergence.kind, agreed) == ("tool_calls", "mismatch", 2)
    assert (divergence.baseline_text, divergence.candidate_text) == (
        'call 0: f({"x": 1})',
        'call 0: f({"x": 2})',
    )


# ----------------------------------------------------------------------------- resumed folders
def test_an_empty_summary_is_removed_not_set_aside(tmp_path: Path) -> None:
    """A summary.csv a full disk left empty holds no runs: it is removed (the next row writes
    the header), never moved aside as a torn file."""
    path = tmp_path / "summary.csv"
    path.write_bytes(b"")
    assert repair_summary(path) == "summary.csv was empty: removed"
    assert not path.exists() and not (tmp_path / "summary.csv.torn").exists()
    assert repair_summary(path) is None
