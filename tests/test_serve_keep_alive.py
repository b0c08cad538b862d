"""Two races of the server's connection protocol. The keep-alive timeout (serving/connections.py) while a
response is under way: uvicorn's handler would send h11 a ConnectionClosed there, which h11
refuses, and the event loop logs the traceback (a known uvicorn race; the connection tests
once found a traceback from an event-loop callback in the log on a loaded machine, its text
cut short). Ours leaves the connection alone until the response completes."""

from __future__ import annotations

import asyncio

import h11
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from reference_engine.serving.connections import connection_policy_protocol


async def app(scope, receive, send) -> None:  # never called: the test drives h11 itself
    raise AssertionError("no request reaches the app here")


def mid_response(protocol_class: type[H11Protocol]) -> H11Protocol:
    """A protocol whose connection has sent its response head and not its body."""
    loop = asyncio.new_event_loop()
    config = uvicorn.Config(app, log_level="critical")
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={}, _loop=loop)
    protocol.transport = type(
        "Transport", (), {"is_closing": lambda self: False, "close": lambda self: None}
    )()
    protocol.conn.receive_data(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert isinstance(protocol.conn.next_event(), h11.Request)
    protocol.conn.send(h11.Response(status_code=200, headers=[("content-length", "2")]))
    assert protocol.conn.our_state is h11.SEND_BODY
    return protocol


def test_the_keep_alive_timeout_waits_for_a_response_under_way() -> None:
    ours = mid_response(connection_policy_protocol(10.0, 1.0, 8))
    ours.timeout_keep_alive_handler()  # nothing sent, nothing raised
    assert ours.conn.our_state is h11.SEND_BODY
    with pytest.raises(h11.LocalProtocolError):  # what the override is for
        mid_response(H11Protocol).timeout_keep_alive_handler()


def test_an_answer_to_a_client_that_reset_the_connection_closes_it_without_raising() -> None:
    """A 408 or 400 from the connection policy half-closes the connection (write_eof) and
    lingers; a client that has reset it makes the half-close raise (OSError from the socket's
    shutdown), inside a timer callback, which the event loop would log with a traceback."""
    protocol = mid_response(connection_policy_protocol(10.0, 1.0, 8))
    closed = []

    class ResetTransport:
        def is_closing(self):
            return False

        def write(self, data):
            pass

        def can_write_eof(self):
            return True

        def write_eof(self):
            raise ConnectionResetError(104, "Connection reset by peer")

        def close(self):
            closed.append(True)

    protocol.transport = ResetTransport()
    protocol._due, protocol._timer, protocol._closing = "body", None, False  # as connection_made
    protocol._answer(408, "the request body did not arrive")
    assert closed == [True]
