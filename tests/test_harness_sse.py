"""A stream is split into events as a real SSE client splits it (harness/sse.py, the WHATWG
EventSource rules the openai client follows), by both readers: `harness compare`'s
(answer.py) and the benchmark client's (client.py)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from harness.answer import Answer, AnswerError, Ask, ask_server
from harness.client import Endpoint, RequestRecord, send
from harness.sse import EventReader, event_data

# the line breaks str.splitlines knows and SSE does not that JSON writes raw inside a string
# (the others, \x0b, \x0c and \x1c-\x1e, are control characters: JSON escapes them)
RAW_IN_JSON = ["\u2028", "\u2029", "\x85"]


def chunk(text: str, ids: list[int], finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}]}


def test_lines_end_at_crlf_lf_or_cr_only() -> None:
    text = "d\u2028\u2029\x85\x0b\x0c\x1c\x1d\x1ee"
    body = f"data: a\r\n\r\ndata: b\n\ndata: c\r\rdata: {text}\n\n"
    assert event_data(body) == ["a", "b", "c", text]


def test_data_lines_of_one_event_are_joined_with_a_newline() -> None:
    assert event_data('data: {"a": 1}\ndata: {"b": 2}\n\n') == ['{"a": 1}\n{"b": 2}']


def test_comments_other_fields_and_the_space_after_the_colon() -> None:
    body = ": keep-alive\nevent: message\nid: 7\nretry: 10\nfoo: bar\ndata:x\ndata:  y\ndata\n\n"
    assert event_data(body) == ["x\n y\n"]
    assert event_data("event: ping\n\n: only a comment\n\n") == []  # no data: nothing dispatched


def test_an_event_the_stream_leaves_unended_is_discarded() -> None:
    assert event_data("data: a\n\ndata: b\n") == ["a"]
    assert event_data("data: a\n\ndata: b") == ["a"]


def test_pieces_split_anywhere_read_as_the_whole() -> None:
    # the last event's two data lines end in CRLF: a CR and an LF read as two line ends
    # would end that event after its first line
    body = "\ufeffdata: \u00e9\u2028\r\n\r\ndata: b\r\rdata: c\r\ndata: d\r\n\r\n".encode()
    whole = event_data(body)
    assert whole == ["\u00e9\u2028", "b", "c\nd"]
    for size in (1, 2, 3, 5):
        reader = EventReader()
        got = [d for k in range(0, len(body), size) for d in reader.feed(body[k : k + size])]
        assert got == whole, size


def serve_stream(body: bytes) -> tuple[ThreadingHTTPServer, str]:
    """A server on loopback that answers every POST with `body` as an event stream."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def both_readers(body: bytes) -> tuple[Answer | AnswerError, RequestRecord]:
    """The stream as `harness compare` reads it (its answer or its error) and as the
    benchmark client records it, over HTTP."""
    server, url = serve_stream(body)
    endpoint = Endpoint(url)

    async def read() -> tuple[Answer | AnswerError, RequestRecord]:
        async with httpx.AsyncClient(timeout=10) as client:
            try:
                answer = await ask_server(client, endpoint, Ask(2, prompt="hi"), logprobs=False, stream=True)
            except AnswerError as exc:
                answer = exc
            record = await send(client, endpoint, {"prompt": "hi"}, 0, time.perf_counter(), 10)
        return answer, record

    try:
        return asyncio.run(read())
    finally:
        server.shutdown()


def stream_body(*events, ensure_ascii: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e, ensure_ascii=ensure_ascii)}\n\n" for e in events]
    return ("".join(lines) + "data: [DONE]\n\n").encode()


USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


@pytest.mark.parametrize("char", RAW_IN_JSON, ids=[f"U+{ord(c):04X}" for c in RAW_IN_JSON])
def test_an_honest_answer_with_a_unicode_line_break_in_its_text_reads_whole(char: str) -> None:
    # written raw inside the JSON string (ensure_ascii=False), as servers write them
    body = stream_body(chunk("a", [1]), chunk(f"{char}b", [2], "length"), USAGE, ensure_ascii=False)
    answer, record = both_readers(body)
    assert not isinstance(answer, AnswerError), answer
    assert (answer.text, answer.ids, answer.finish_reason) == (f"a{char}b", [1, 2], "length")
    assert record.success and record.output_tokens == 2 and record.token_ids == [1, 2], record.error


def test_two_chunks_as_two_data_lines_of_one_event_are_not_an_answer() -> None:
    """A client joins the two `data:` lines into one text that is not JSON; so must the gate."""
    first, last = json.dumps(chunk("a", [1])), json.dumps(chunk("b", [2], "length"))
    body = f"data: {first}\ndata: {last}\n\ndata: {json.dumps(USAGE)}\n\ndata: [DONE]\n\n".encode()
    answer, record = both_readers(body)
    assert isinstance(answer, AnswerError) and answer.name == "malformed_body", answer
    assert not record.success and "malformed SSE" in (record.error or "")


def test_a_done_marker_padded_with_spaces_ends_the_stream() -> None:
    """`data: [DONE] ` (a trailing space) ends a stream for the OpenAI client; so for both readers."""
    body = stream_body(chunk("a", [1]), chunk("b", [2], "length"), USAGE).replace(b"[DONE]", b"[DONE] ")
    answer, record = both_readers(body)
    assert not isinstance(answer, AnswerError), answer
    assert (answer.text, answer.ids) == ("ab", [1, 2])
    assert record.success and record.done_marker, record.error


def test_a_byte_that_is_not_utf8_reads_as_a_replacement_character_never_vanishes() -> None:
    """A stray byte in a stream is text a client shows as U+FFFD: read as nothing, a candidate
    that sends its honest text with such a byte in it would read as that honest text."""
    body = b'data: {"text": "a\xffb"}\n\ndata: c\xe2\x82\n\n'
    assert event_data(body) == ['{"text": "a\ufffdb"}', "c\ufffd"]
    reader = EventReader()
    assert [d for k in range(len(body)) for d in reader.feed(body[k : k + 1])] == event_data(body)


def test_a_field_is_data_only_when_its_name_is_exactly_data() -> None:
    """The field name runs to the first colon, spaces included: `data :` and ` data:` are
    other fields, which a client ignores."""
    assert event_data("data : x\n\n data: y\n\nDATA: w\n\ndata: z\n\n") == ["z"]
