"""What the server takes from an untrusted client before a request reaches the engine
(serving/limits.py, serving/connections.py, and how server.py and service.py wire them in):
only a body declared as application/json itself is read, --max-body-mb is a fraction of a
mebibyte counted to the byte, decoded JSON is plain data at every depth (nesting in objects as
in arrays, strings in nested containers, keys given twice with any value, no byte order mark,
no number too large for a float),
--timeout-keep-alive closes an idle kept-alive connection, and a chunked body the client ends
without its last chunk gets 400 at once. Checked through the modules' own functions and on a
real server on 127.0.0.1 with short deadlines."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from starlette.requests import Request

from reference_engine.serving.limits import BodyLimits, decode_json, read_body
from reference_engine.serving.protocol import ProtocolError

from .server_process import ServerProcess
from .test_serve_connections import response

MAX_BODY_MB = 0.001  # 1048 bytes: int(0.001 * 2**20)
MAX_BODY_BYTES = 1048
KEEP_ALIVE_S = 0.5
BODY_TIMEOUT_S = 3.0
TIMEOUT = 20


# ------------------------------------------------------------------ what a body may be
def read(content_type: str, body: bytes, limits: BodyLimits | None = None) -> bytes:
    """read_body on a Starlette request with this Content-Type, its body in one part."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0)

    headers = [(b"content-type", content_type.encode())]
    request = Request({"type": "http", "method": "POST", "headers": headers}, receive)
    return asyncio.run(read_body(request, limits or BodyLimits()))


@pytest.mark.parametrize(
    "content_type",
    ["application/jsonp", "application/json-seq", "application/x-json", "text/json", "application/json5"],
)
def test_a_media_type_that_only_resembles_json_gets_415(content_type: str) -> None:
    """The media type must be application/json itself: a longer name that starts with it or
    another type naming JSON is refused before the body is read."""
    with pytest.raises(ProtocolError, match="must be sent as 'Content-Type: application/json'") as info:
        read(content_type, b"{}")
    assert info.value.status == 415 and repr(content_type) in str(info.value)


def test_a_body_read_whole_comes_back_byte_for_byte() -> None:
    body = b'{"prompt": "caf\xc3\xa9", "n": 1}'
    assert read("application/json", body) == body


def nested_objects(levels: int, inner: str = "1") -> bytes:
    return ('{"a": ' * levels + inner + "}" * levels).encode()


def test_nested_objects_are_held_to_the_depth_limit_as_arrays_are() -> None:
    """max_depth counts objects as it counts arrays, and both mixed: 32 levels are decoded,
    33 refused with 400."""
    limits = BodyLimits()
    assert decode_json(nested_objects(32), limits) is not None
    mixed = b'{"a": [' * 16 + b"1" + b"]}" * 16
    assert decode_json(mixed, limits) is not None
    for raw in (nested_objects(33), b"[" + mixed + b"]", nested_objects(16, "[" * 17 + "]" * 17)):
        with pytest.raises(ProtocolError, match="more than 32 levels deep") as info:
            decode_json(raw, limits)
        assert info.value.status == 400


def test_a_smaller_depth_limit_is_the_one_applied() -> None:
    limits = BodyLimits(max_depth=3)
    assert decode_json(b'{"a": [{"b": 1}]}', limits) == {"a": [{"b": 1}]}
    with pytest.raises(ProtocolError, match="more than 3 levels deep"):
        decode_json(b'{"a": [{"b": []}]}', limits)
    with pytest.raises(ProtocolError, match="more than 3 levels deep"):
        decode_json(b'{"a": {"b": {"c": {}}}}', limits)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": {"b": "\\ud800"}}',
        b'{"a": {"\\udfff": 1}}',
        b'[["\\ud800"]]',
        b'[1, "ok", "\\ud800"]',
        b'{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "\\udc80"}]}',
        b'{"a": [[{"b": ["x", {"c": "\\ud83d"}]}]]}',
    ],
    ids=["in-nested-object", "nested-key", "in-nested-array", "last-item", "second-message", "deep"],
)
def test_a_lone_surrogate_is_refused_wherever_it_is_nested(raw: bytes) -> None:
    """Every string is checked, at any depth, in objects and arrays, not just the first item."""
    with pytest.raises(ProtocolError, match="invalid character") as info:
        decode_json(raw, BodyLimits())
    assert info.value.status == 400


def test_valid_text_at_every_depth_is_kept() -> None:
    raw = '{"a": [{"b": ["é", {"\U0001f600": "ok"}]}], "z": [[["deep"]]]}'.encode()
    assert decode_json(raw, BodyLimits()) == {"a": [{"b": ["é", {"\U0001f600": "ok"}]}], "z": [[["deep"]]]}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": 1, "a": 1}',
        b'{"a": {"x": 1}, "a": {"y": 2}}',
        b'{"a": [1], "a": [1]}',
        b'{"prompt": "x", "max_tokens": 2, "prompt": "x"}',
    ],
    ids=["equal-scalars", "objects", "equal-arrays", "equal-prompt"],
)
def test_a_key_given_twice_is_refused_whatever_its_values(raw: bytes) -> None:
    with pytest.raises(ProtocolError, match="appears twice in one object") as info:
        decode_json(raw, BodyLimits())
    assert info.value.status == 400


def test_keys_that_differ_only_in_case_are_two_keys() -> None:
    assert decode_json(b'{"a": 1, "A": 2}', BodyLimits()) == {"a": 1, "A": 2}


@pytest.mark.parametrize("literal", ["1e999", "-1e400", "1.5e309"])
def test_a_number_too_large_for_a_float_is_refused_not_read_as_infinity(literal: str) -> None:
    """JSON has no infinity (Infinity and NaN are refused by name); a literal that overflows a
    float must not become one either, in a field or nested."""
    for raw in (f'{{"top_p": {literal}}}', f'{{"a": [{{"b": {literal}}}]}}'):
        with pytest.raises(ProtocolError, match=f"the number {literal} is out of range"):
            decode_json(raw.encode(), BodyLimits())
    assert decode_json(b'{"a": 1.7e308, "b": -4.9e-324}', BodyLimits()) == {"a": 1.7e308, "b": -4.9e-324}


def test_a_byte_order_mark_is_not_json() -> None:
    """RFC 8259: a JSON text sent over the network carries no byte order mark."""
    with pytest.raises(ProtocolError, match="not valid JSON") as info:
        decode_json(b"\xef\xbb\xbf{}", BodyLimits())
    assert info.value.status == 400


def test_bytes_that_are_not_utf8_are_named_by_their_position() -> None:
    with pytest.raises(ProtocolError, match=r"not valid UTF-8 \(invalid start byte at byte 7\)"):
        decode_json(b'{"a": "\xff"}', BodyLimits())
    with pytest.raises(ProtocolError, match="not valid UTF-8"):
        decode_json('{"a": "é"}'.encode("latin-1"), BodyLimits())


def test_a_smaller_integer_limit_counts_digits_without_the_sign() -> None:
    limits = BodyLimits(max_int_digits=3)
    assert decode_json(b"[999, -999, 0]", limits) == [999, -999, 0]
    for raw in (b"[1000]", b"[-1000]", b'{"a": {"b": [1234]}}'):
        with pytest.raises(ProtocolError, match="has 4 digits; at most 3") as info:
            decode_json(raw, limits)
        assert info.value.status == 400


# ------------------------------------------------------------------ a real server
@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    server = ServerProcess(
        "--model",
        str(tiny_checkpoint("qwen3")),
        "--max-body-mb",
        str(MAX_BODY_MB),
        "--timeout-keep-alive",
        str(KEEP_ALIVE_S),
        "--header-timeout",
        "30",
        "--body-timeout",
        str(BODY_TIMEOUT_S),
    )
    yield server
    server.stop()


def padded(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes."""
    head = b'{"prompt": [5, 17], "max_tokens": 1, "temperature": 0, "user": "'
    return head + b"x" * (size - len(head) - 2) + b'"}'


def post(server, content, content_type: str = "application/json") -> httpx.Response:
    return httpx.post(
        server.url + "/v1/completions",
        content=content,
        headers={"content-type": content_type},
        timeout=TIMEOUT,
    )


def test_a_fractional_body_limit_in_mebibytes_is_counted_to_the_byte(server) -> None:
    """--max-body-mb 0.001 accepts 1048 bytes (0.001 * 2**20, rounded down) and answers one
    byte more with 413 naming the limit and its flag, declared or chunked."""
    body = padded(MAX_BODY_BYTES)
    assert len(body) == MAX_BODY_BYTES and json.loads(body)
    served = post(server, body)
    assert served.status_code == 200, served.text
    over = padded(MAX_BODY_BYTES + 1)
    for content in (over, iter([over[:500], over[500:]])):
        refused = post(server, content)
        assert refused.status_code == 413, refused.text
        error = refused.json()["error"]
        assert f"accepts at most {MAX_BODY_BYTES} (--max-body-mb)" in error["message"]
        assert error["type"] == "invalid_request_error" and error["code"] == 413


def test_the_server_refuses_a_media_type_that_only_resembles_json(server) -> None:
    r = post(server, padded(200), "application/jsonp")
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert post(server, padded(200), "application/json; charset=utf-8").status_code == 200


def test_the_server_refuses_nested_bad_text_and_keys_twice(server) -> None:
    for raw in (
        b'{"prompt": [5], "max_tokens": 1, "metadata": {"k": "\\ud800"}}',
        b'{"prompt": [5], "max_tokens": 1, "max_tokens": 1}',
    ):
        r = post(server, raw)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_an_idle_kept_alive_connection_closes_at_the_keep_alive_timeout(server) -> None:
    """--timeout-keep-alive 0.5 with a header timeout of 30 s: after one response, a
    connection that sends nothing more is closed within about half a second."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            assert chunk, reply
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        sock.settimeout(10)
        try:
            while sock.recv(4096):
                pass
        except ConnectionResetError:
            pass
        assert time.monotonic() - start < KEEP_ALIVE_S + 2.5


def test_a_chunked_body_without_its_last_chunk_gets_400_at_once(server) -> None:
    """A client that closes its side after some chunks, before the last (empty) one, gets
    400 without waiting for the body timeout."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"pro\r\n'
        )
        sock.shutdown(socket.SHUT_WR)
        start = time.monotonic()
        status, body = response(sock)
    assert status == 400 and time.monotonic() - start < BODY_TIMEOUT_S / 2
    assert "before the request body was complete" in body["error"]["message"]


def test_a_chunked_body_in_small_chunks_is_served(server) -> None:
    body = padded(300)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + 7]), body[i : i + 7]) for i in range(0, 300, 7))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
        )
        status, answer = response(sock)
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"


def test_no_refusal_left_a_traceback_in_the_log(server) -> None:
    server.stop()
    assert "Traceback" not in server.proc.stdout.read()
