"""What one connection may hold before its request reaches a route (serving/connections.py),
driven through the server's h11 protocol on an in-memory transport: headers trickled in
pieces are still due at the header timeout, a kept-alive connection serves request after
request and owes each next request's headers within the header timeout of the response
before it, a request with Connection: close ends its connection, the cap counts the
connections open at once (the one opening included) and frees a place when one closes, and
the 408 and 400 answers are whole responses that name their cause; on a real socket on
127.0.0.1, a request complete before its client half-closes is answered."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator

import h11
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from reference_engine.serving.connections import LINGER_S, connection_policy_protocol

from .server_process import free_port, uvicorn_in_thread
from .test_cli_lifecycle_contracts import POST_HEAD, Transport, opened, run_for
from .test_server_metrics_limits_contracts import answer_of

GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


async def answers(scope, receive, send) -> None:
    """A route that reads its whole body, then answers 200 "ok", keeping the connection."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def statuses_of(written: bytes) -> list[int]:
    """The status codes of the whole responses in `written`, in order; a response cut short
    fails the test."""
    client = h11.Connection(h11.CLIENT)
    client.receive_data(written)
    statuses = []
    while True:
        client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
        client.send(h11.EndOfMessage())
        event = client.next_event()
        if event is h11.NEED_DATA:
            return statuses
        assert isinstance(event, h11.Response), event
        statuses.append(event.status_code)
        while not isinstance(event, h11.EndOfMessage):
            event = client.next_event()
            assert event is not h11.NEED_DATA, f"response {len(statuses)} was cut short"
        if h11.MUST_CLOSE in (client.our_state, client.their_state):
            return statuses
        client.start_next_cycle()


# ------------------------------------------------------------------ the header deadline
def test_headers_trickled_in_pieces_are_still_due_at_the_header_timeout(loop) -> None:
    """Bytes of a request's head arriving neither restart nor end the header deadline: a
    head sent five bytes at a time and never finished is closed at the header timeout from
    the opening, without an answer."""
    protocol, transport = opened(loop, header_s=0.5, body_s=5.0)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    for i in range(0, 40, 5):
        protocol.data_received(head[i : i + 5])
        run_for(loop, 0.05)
    assert not transport.closed  # 0.4 s in
    run_for(loop, 0.3)
    assert transport.closed and transport.written == b""


# ------------------------------------------------------------------ keep-alive
def test_a_kept_alive_connection_serves_request_after_request(loop) -> None:
    """Each response leaves the connection open for the next request: three requests, one
    after another, each answered on the one connection, each well within the header timeout
    of the response before it though the three together take longer than it."""
    protocol, transport = opened(loop, header_s=0.3, body_s=5.0, app=answers)
    for _ in range(3):
        protocol.data_received(GET_HEALTH)
        run_for(loop, 0.15)
        assert not transport.closed
    assert statuses_of(transport.written) == [200, 200, 200]
    run_for(loop, 0.3)
    assert transport.closed  # the fourth request's headers never came


def test_a_body_sent_in_parts_on_a_kept_alive_connection_is_served(loop) -> None:
    """A request whose body arrives in parts within the body timeout is served like one sent
    whole, and the connection stays for the next request."""
    protocol, transport = opened(loop, header_s=5.0, body_s=0.5, app=answers)
    protocol.data_received(POST_HEAD)
    for part in (b'{"prompt": "hi", ', b'"max_tokens": 2', b"}" + b" " * 7):
        run_for(loop, 0.1)
        protocol.data_received(part)
    run_for(loop, 0.05)
    protocol.data_received(GET_HEALTH)
    run_for(loop, 0.6)  # past the first request's body deadline
    assert statuses_of(transport.written) == [200, 200] and not transport.closed


def test_a_request_with_connection_close_ends_its_connection_after_the_response(loop) -> None:
    errors: list[dict] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    protocol, transport = opened(loop, header_s=0.2, body_s=5.0, app=answers)
    protocol.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    run_for(loop, 0.05)
    assert statuses_of(transport.written) == [200] and transport.closed
    answered = transport.written
    run_for(loop, 0.3)  # past the header deadline: nothing more written, nothing raised
    assert transport.written == answered and errors == []


# ------------------------------------------------------------------ the cap
class Connections:
    """Connections of one server (one ServerState), each accepted on `loop`."""

    def __init__(self, loop, cap: int, header_s: float = 5.0) -> None:
        self.loop, self.state = loop, ServerState()
        self.config = uvicorn.Config(answers, log_level="critical", timeout_keep_alive=60)
        self.protocol_class = connection_policy_protocol(header_s, 5.0, cap)

    def open(self) -> tuple[H11Protocol, Transport]:
        protocol = self.protocol_class(
            config=self.config, server_state=self.state, app_state={}, _loop=self.loop
        )
        transport = Transport()
        protocol.connection_made(transport)
        return protocol, transport

    def status_of(self, protocol: H11Protocol, transport: Transport) -> int:
        protocol.data_received(GET_HEALTH)
        run_for(self.loop, 0.05)
        (status,) = statuses_of(transport.written)
        return status


def test_the_cap_counts_the_connections_open_at_once_the_new_one_included(loop) -> None:
    """--max-connections 2: two connections open at once are both served; a third while they
    stay open gets 503 naming 2 connections, and the connection closes after it."""
    server = Connections(loop, cap=2)
    first, second, third = server.open(), server.open(), server.open()
    assert server.status_of(*first) == 200 and server.status_of(*second) == 200
    assert server.status_of(*third) == 503
    head, body, _ = answer_of(third[1].written)
    assert dict(head.headers)[b"retry-after"] == b"1" and dict(head.headers)[b"connection"] == b"close"
    error = json.loads(body)["error"]
    assert error["type"] == "service_unavailable" and error["code"] == 503
    assert "the server has 2 connections open" in error["message"]
    assert third[1].closed and not first[1].closed and not second[1].closed


def test_a_place_under_the_cap_is_freed_when_a_connection_closes(loop) -> None:
    """A connection that closes no longer counts: the next one opened is served."""
    server = Connections(loop, cap=1)
    first = server.open()
    assert server.status_of(*first) == 200
    refused = server.open()
    assert server.status_of(*refused) == 503
    refused[0].connection_lost(None)
    first[0].connection_lost(None)
    assert server.status_of(*server.open()) == 200


def test_a_connection_over_the_cap_that_sends_nothing_closes_at_the_header_timeout(loop) -> None:
    server = Connections(loop, cap=1, header_s=0.2)
    server.open()
    _, transport = server.open()
    run_for(loop, 0.3)
    assert transport.closed and transport.written == b""


# ------------------------------------------------------------------ the answers from here
def test_the_408_answer_names_the_body_timeout_in_seconds(loop) -> None:
    protocol, transport = opened(loop, header_s=7.0, body_s=0.25)
    protocol.data_received(POST_HEAD + b'{"prompt"')
    run_for(loop, 0.35)
    head, body, _ = answer_of(transport.written)
    error = json.loads(body)["error"]
    assert head.status_code == 408 and error["code"] == 408 and error["type"] == "invalid_request_error"
    assert "did not arrive within 0.25 s of its headers (--body-timeout)" in error["message"]


def test_the_400_for_a_body_cut_short_is_one_whole_response_naming_its_cause(loop) -> None:
    """A client that half-closes one byte short of its Content-Length gets 400 at once: one
    response with its reason phrase, a Content-Length matching the JSON error body and
    Connection: close; the connection half-closes and lingers for the client's close."""
    protocol, transport = opened(loop, header_s=5.0, body_s=5.0)
    protocol.data_received(POST_HEAD + b"x" * 39)
    protocol.eof_received()
    head, body, trailing = answer_of(transport.written)
    assert head.status_code == 400 and head.reason == b"Bad Request" and not trailing
    assert dict(head.headers)[b"connection"] == b"close"
    error = json.loads(body)["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert "closed its side of the connection before the request body was complete" in error["message"]
    assert transport.eof and not transport.closed
    run_for(loop, LINGER_S + 0.1)
    assert transport.closed


# ------------------------------------------------------------------ on a real socket
async def generates(scope, receive, send) -> None:
    """A route that reads its body, takes 0.2 s (as a generation does), then answers."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await asyncio.sleep(0.2)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def loopback_port() -> Iterator[int]:
    """uvicorn on 127.0.0.1 with the server's connection policy."""
    with uvicorn_in_thread(generates, free_port(), connection_policy_protocol(5.0, 5.0, 8)) as port:
        yield port


def test_a_complete_request_whose_client_half_closes_is_still_answered(loopback_port) -> None:
    """A body cut short by the client's half-close gets 400 at once; a request complete to its
    Content-Length before the half-close is a whole request and gets its route's answer."""
    with socket.create_connection(("127.0.0.1", loopback_port), timeout=10) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200 ") and reply.endswith(b"ok")
