"""A scripted OpenAI-style SSE server on loopback (a real HTTP server in a thread)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Script:
    """What the stub answers: chunks of (delay before it in seconds, token ids), plus
    faults: `malformed_at` (chunk index sent as broken JSON), `hang_s` (sleep before the
    first byte), `die_at` (close the connection before that chunk), `fail_every` (every
    k-th request gets HTTP 500 instead of a stream), `usage_over` (the usage chunk reports that
    many tokens more than the stream's ids)."""

    def __init__(
        self,
        chunks,
        malformed_at=None,
        hang_s=0.0,
        die_at=None,
        metrics_text: str = "",
        fail_every: int | None = None,
        usage_over: int = 0,
    ) -> None:
        self.chunks = chunks
        self.malformed_at, self.hang_s, self.die_at = malformed_at, hang_s, die_at
        self.metrics_text = metrics_text
        self.fail_every = fail_every
        self.usage_over = usage_over
        self.posts = 0
        self.open = self.most_open = 0  # streams being answered now, and at most at once
        self.lock = threading.Lock()


def events(script: Script) -> list[tuple[float, str]]:
    """What the stub writes after the headers: (delay before it in seconds, SSE event text),
    one per scripted chunk, then the usage chunk and [DONE] at once."""
    out = []
    for i, (delay, ids) in enumerate(script.chunks):
        event = {"choices": [{"index": 0, "text": "x" * len(ids), "token_ids": ids, "finish_reason": None}]}
        line = "{broken" if script.malformed_at == i else json.dumps(event)
        out.append((delay, f"data: {line}\n\n"))
    usage = {
        "choices": [],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": sum(len(ids) for _, ids in script.chunks) + script.usage_over,
        },
    }
    out.append((0.0, f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n"))
    return out


def serve(script: Script) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            body = script.metrics_text if self.path == "/metrics" else '{"status":"ok"}'
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            with script.lock:
                script.open += 1
                script.most_open = max(script.most_open, script.open)
            self.counted = True  # in script.open until its stream's last event (`closed`)
            try:
                self.answer()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client hung up first (a fault test)
            finally:
                self.closed()

        def closed(self) -> None:
            """The stream no longer counts as open. Called before its last event is written:
            a client that reads that event may post its next request at once, before this
            thread runs on, and the two must not count as open together."""
            with script.lock:
                script.open -= self.counted
                self.counted = False

        def answer(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            self.rfile.read(length)
            with script.lock:
                script.posts += 1
                fail = script.fail_every is not None and script.posts % script.fail_every == 0
            if fail:
                data = b'{"error": {"message": "planted failure"}}'
                self.send_response(500)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.closed()
                self.wfile.write(data)
                return
            time.sleep(script.hang_s)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            sent = events(script)
            for i, (delay, text) in enumerate(sent):
                time.sleep(delay)
                if script.die_at == i:
                    self.connection.shutdown(2)
                    return
                if i == len(sent) - 1:
                    self.closed()
                self.wfile.write(text.encode())
                self.wfile.flush()
            self.close_connection = True

    class Server(ThreadingHTTPServer):
        request_queue_size = 256  # the listen backlog: many clients connect at once

    server = Server(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
