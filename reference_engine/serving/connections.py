"""What one connection may hold before its request reaches a route: uvicorn's h11 protocol
with deadlines, a cap on open connections and an answer to a body cut short.

A client that is slow or broken, on purpose or not, must not hold the server's sockets:
- Header timeout: a connection must deliver a request's headers within `header_timeout_s`
  of opening (or of its previous response), else it is closed. Idle keep-alive connections
  close after uvicorn's `timeout_keep_alive`.
- Body timeout: a request's whole body must arrive within `body_timeout_s` of its headers,
  else it gets 408 and the connection closes. A deadline on the whole body, not on the gap
  between bytes: a chunked body trickled at one byte per two seconds never goes idle.
- A body cut short: a client that closes its side before the body that Content-Length
  announced (or before the last chunk) gets 400 at once instead of waiting for the body
  timeout. A client that closes its side after a whole request still gets its response;
  the connection closes once it is written.
- Connection cap: past `max_connections` open connections, a new connection's request gets
  503 with a JSON error naming the limit, and the connection closes.

These answers are written here, below the routes, in the OpenAI error shape the routes use:
no route is waiting for them (a route reading the body sees the connection closed).
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import error_body

log = logging.getLogger(__name__)
LINGER_S = 1.0  # after an answer from here, how long the rest of the body is read and dropped


def connection_policy_protocol(
    header_timeout_s: float, body_timeout_s: float, max_connections: int
) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the policy above."""

    async def refuse_over_cap(scope, receive, send) -> None:
        """The app of a connection over the cap: 503 for its request, then close."""
        body = error_body(
            f"the server has {max_connections} connections open, its limit (--max-connections); retry later",
            "service_unavailable",
            None,
            503,
        )
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [*_ERROR_HEADERS, (b"retry-after", b"1")],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})

    class ConnectionPolicyProtocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._due, self._timer = None, None
            self._closing = False  # answered by _answer: only lingering until closed
            self._half_closed = False  # the client sent its request whole, then closed its side
            if len(self.connections) > max_connections:  # this one included
                self.app = refuse_over_cap
            self._wait_for("headers")

        def _wait_for(self, part: str | None) -> None:
            """Start the deadline of what the client owes now: "headers", "body" or None."""
            if part == self._due:
                return
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._due = part
            if part is not None:
                seconds = header_timeout_s if part == "headers" else body_timeout_s
                self._timer = self.loop.call_later(seconds, self._timeout)

        def _timeout(self) -> None:
            if self.transport.is_closing():
                return
            if self._due == "headers" and self.conn.their_state is h11.IDLE:
                log.info("closing a connection that sent no request headers in %s s", header_timeout_s)
                self.transport.close()
            elif self._due == "body" and self.conn.their_state is h11.SEND_BODY:
                self._answer(
                    408,
                    f"the request body did not arrive within {body_timeout_s:g} s of its headers "
                    "(--body-timeout); the connection is closed",
                )

        def _answer(self, status: int, message: str) -> None:
            """Answer the request whose body is still due (unless its route already has) and
            close the connection, lingering: closing with the client's bytes unread resets the
            connection, and a reset can destroy the answer before the client reads it."""
            if self.cycle is not None and not self.cycle.response_started:
                body = json.dumps(error_body(message, "invalid_request_error", None, status)).encode()
                for event in (
                    h11.Response(
                        status_code=status,
                        headers=[*_ERROR_HEADERS, (b"content-length", str(len(body)).encode())],
                        reason=HTTPStatus(status).phrase,
                    ),
                    h11.Data(data=body),
                    h11.EndOfMessage(),
                ):
                    self.transport.write(self.conn.send(event))
            self._wait_for(None)
            self._closing = True
            if self.transport.can_write_eof():
                try:
                    self.transport.write_eof()
                except OSError:  # the client reset the connection first: nothing to linger for
                    self.transport.close()
                    return
            self.loop.call_later(LINGER_S, self.transport.close)

        def data_received(self, data: bytes) -> None:
            if not self._closing:  # else the rest of a refused body: dropped
                super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            state = self.conn.their_state
            self._wait_for("body" if state is h11.SEND_BODY else "headers" if state is h11.IDLE else None)

        def eof_received(self) -> bool | None:
            if self._closing:
                self.transport.close()
            elif self.conn.their_state is h11.SEND_BODY:
                self._answer(
                    400,
                    "the client closed its side of the connection before the request body was "
                    "complete (shorter than its Content-Length, or no last chunk)",
                )
            elif self.conn.their_state is h11.DONE and self.conn.our_state is not h11.DONE:
                # a whole request, then a half-close: the response is still owed, so the
                # transport stays open for writing (True) and closes once it is written
                self._half_closed = True
                return True
            return None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._half_closed:
                self.transport.close()
            elif not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._wait_for("headers")

        def connection_lost(self, exc) -> None:
            self._wait_for(None)
            super().connection_lost(exc)

        def timeout_keep_alive_handler(self) -> None:
            """uvicorn's keep-alive timeout, but not while a response is under way: there
            uvicorn's sends h11 a ConnectionClosed that h11 refuses (LocalProtocolError, logged
            with a traceback from the event loop); the timer is armed again when the response
            completes."""
            if self.conn.our_state in (h11.SEND_RESPONSE, h11.SEND_BODY):
                return
            super().timeout_keep_alive_handler()

    return ConnectionPolicyProtocol


_ERROR_HEADERS = [(b"content-type", b"application/json"), (b"connection", b"close")]
