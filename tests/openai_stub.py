"""A strict plain-OpenAI server on loopback, shaped after Hugging Face `transformers serve`:
it refuses fields it does not know (HTTP 422), takes only text prompts, reports no token
ids, sends usage only at the end and ends a stream without `data: [DONE]`. Each request's
output is `text_for(prompt, max_tokens)`, streamed one piece per chunk."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KNOWN_FIELDS = {
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "stream",
    "stream_options",
    "logprobs",
    "stop",
    "seed",
    "n",
    "echo",
    "best_of",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "suffix",
}


def serve(
    pieces_for: Callable[[str, int], list[str]],
    bodies: list[dict] | None = None,
    owned_by: str = "local",
    also_accepts: frozenset[str] = frozenset(),
) -> tuple[ThreadingHTTPServer, str]:
    """`pieces_for(prompt, max_tokens)`: the output, one string per token; `bodies`
    collects the requests; `owned_by`: what /v1/models says; `also_accepts`: fields it takes
    (and ignores) beyond plain OpenAI's."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self.reply(
                    200,
                    {
                        "object": "list",
                        "data": [{"id": "stub-model", "object": "model", "owned_by": owned_by}],
                    },
                )
            else:
                self.reply(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if bodies is not None:
                bodies.append(body)
            if self.path != "/v1/completions":
                return self.reply(404, {"detail": "Not Found"})
            unknown = set(body) - KNOWN_FIELDS - also_accepts
            if unknown:
                return self.reply(422, {"detail": f"Unexpected fields in the request: {unknown}"})
            if not isinstance(body.get("prompt"), str):
                return self.reply(422, {"detail": "prompt must be a string."})
            pieces = pieces_for(body["prompt"], body.get("max_tokens", 16))
            usage = {"prompt_tokens": 3, "completion_tokens": len(pieces), "total_tokens": 3 + len(pieces)}
            if not body.get("stream"):
                return self.reply(
                    200,
                    {
                        "id": "x",
                        "object": "text_completion",
                        "choices": [{"index": 0, "text": "".join(pieces), "finish_reason": "length"}],
                        "usage": usage,
                    },
                )
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for piece in pieces:
                event = {"object": "text_completion", "choices": [{"index": 0, "text": piece}]}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
            last = {
                "object": "text_completion",
                "usage": usage,
                "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
            }
            self.wfile.write(f"data: {json.dumps(last)}\n\n".encode())  # and no [DONE]
            self.wfile.flush()
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
