"""A scripted OpenAI-compatible server on loopback, for the comparison's tests: each POST
(/v1/completions or /v1/chat/completions) is answered by `answer(path, body)`, a whole
completion, sent whole or as a stream as the request asks; a reply of another kind (bytes,
an HTTP status) goes out as it is. It keeps every request body and the most requests it
held at once (a request is held from its arrival until its answer starts)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gates.lying_server import Reply, send_answer, send_reply


def completion(
    ids: list[int] | None,
    text: str | None = None,
    finish: str = "length",
    prompt_tokens: int | None = None,
    chat: bool = False,
    **usage,
) -> dict:
    text = "".join(f"<{t}>" for t in ids or []) if text is None else text
    choice: dict = {"index": 0, "finish_reason": finish}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    if ids is not None:
        choice["token_ids"] = ids
    counts = {
        "completion_tokens": len(ids) if ids is not None else None,
        "prompt_tokens": prompt_tokens,
        **usage,
    }
    return {"choices": [choice], "usage": {k: v for k, v in counts.items() if v is not None}}


class Stub:
    def __init__(self, answer: Callable[[str, dict], dict | Reply], delay: float = 0.0) -> None:
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.in_flight, self.most = 0, 0
        self.arrivals: list[int] = []  # requests held at each arrival, this one included
        self.release = threading.Event()  # set to free requests an answer holds back
        lock, stub = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                send_reply(self, Reply(404, b'{"detail": "Not Found"}'))

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    stub.bodies.append(body)
                    stub.paths.append(self.path)
                    stub.in_flight += 1
                    stub.most = max(stub.most, stub.in_flight)
                    stub.arrivals.append(stub.in_flight)
                try:
                    time.sleep(delay)
                    data = answer(self.path, body)
                finally:
                    # held until its answer starts: a closed-loop client sends its next
                    # request only after reading this one's, so it never sees both counted
                    with lock:
                        stub.in_flight -= 1
                if isinstance(data, Reply):
                    send_reply(self, data)
                else:
                    send_answer(self, body, data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Stub:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
