"""What one connection may hold (serving/connections.py), on a real server on 127.0.0.1: a
body trickled or cut short cannot hold a connection past --body-timeout, a body the client
ends early gets 400 at once, and connections past --max-connections get a clear 503."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from .server_process import ServerProcess

BODY_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 6
BODY = b'{"prompt": "hi", "max_tokens": 2}'


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    server = ServerProcess(
        "--model",
        str(tiny_checkpoint("qwen3")),
        "--body-timeout",
        str(BODY_TIMEOUT_S),
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--header-timeout",
        "10",
    )
    yield server
    server.stop()


def post_head(port: int, headers: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + headers + b"\r\n"
    )
    return sock


def response(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of the one response on `sock`, read until the server closes."""
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_trickled_chunked_bodies_get_408_within_the_body_timeout(server) -> None:
    results = []

    def trickle() -> None:
        sock = post_head(server.port, b"Transfer-Encoding: chunked\r\n")
        start = time.monotonic()
        sock.setblocking(False)
        try:
            while time.monotonic() - start < 10:
                sock.sendall(b"1\r\n \r\n")  # one byte per 0.2 s: never idle, never done
                try:
                    results.append((sock.recv(12), time.monotonic() - start))
                    return
                except BlockingIOError:
                    time.sleep(0.2)
        finally:
            sock.close()

    threads = [threading.Thread(target=trickle) for _ in range(MAX_CONNECTIONS - 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(results) == len(threads)
    for head, seconds in results:
        assert head == b"HTTP/1.1 408" and seconds < BODY_TIMEOUT_S + 2
    assert httpx.post(server.url + "/v1/completions", json=json.loads(BODY), timeout=10).status_code == 200


def test_a_body_shorter_than_its_content_length_gets_408_when_the_client_waits(server) -> None:
    sock = post_head(server.port, b"Content-Length: %d\r\n" % (len(BODY) + 100))
    sock.sendall(BODY)
    start = time.monotonic()
    status, body = response(sock)
    assert status == 408 and time.monotonic() - start < BODY_TIMEOUT_S + 2
    assert "--body-timeout" in body["error"]["message"]


def test_a_body_the_client_ends_early_gets_400_at_once(server) -> None:
    sock = post_head(server.port, b"Content-Length: %d\r\n" % (len(BODY) + 100))
    sock.sendall(BODY)
    sock.shutdown(socket.SHUT_WR)
    start = time.monotonic()
    status, body = response(sock)
    assert status == 400 and time.monotonic() - start < 0.5 * BODY_TIMEOUT_S
    assert "before the request body was complete" in body["error"]["message"]


def post_while_holding(server, held: int) -> httpx.Response:
    """A completion request sent while `held` other connections stay open (and idle)."""
    sockets = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(held)]
    time.sleep(0.2)
    try:
        return httpx.post(server.url + "/v1/completions", json=json.loads(BODY), timeout=10)
    finally:
        for sock in sockets:
            sock.close()


def test_the_connection_at_the_cap_is_served(server) -> None:
    """--max-connections N serves N connections at once: with N - 1 held open, the N-th's
    request is answered."""
    time.sleep(0.2)  # the earlier tests' connections closed
    served = post_while_holding(server, MAX_CONNECTIONS - 1)
    assert served.status_code == 200, served.text


def test_a_connection_past_the_cap_gets_503_naming_the_limit(server) -> None:
    refused = post_while_holding(server, MAX_CONNECTIONS)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "--max-connections" in refused.json()["error"]["message"]
    time.sleep(0.2)
    assert httpx.post(server.url + "/v1/completions", json=json.loads(BODY), timeout=10).status_code == 200


def test_no_refusal_left_a_traceback_in_the_log(server) -> None:
    server.stop()
    assert "Traceback" not in server.proc.stdout.read()
