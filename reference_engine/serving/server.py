"""The OpenAI-compatible reference server.

    python -m reference_engine.serve --model DIR [--dflash-draft-model-path DIR]
        [--block-size N] [--commit-strategy NAME] [--dtype ...] [--device ...]
        [--max-num-seqs N] [--max-model-len N] [--max-waiting N]
        [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--served-model-name NAME]
        [--tensor-parallel-size N (under torchrun --nproc-per-node N)]

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(SSE streaming with `[DONE]`, `stream_options.include_usage` and
`continuous_usage_stats`), GET /metrics (Prometheus text; see metrics.py). Protocol
details and extensions: protocol.py. Bad requests get HTTP 400 with an OpenAI-style error
body; a body over --max-body-mb 413; a body not complete within --body-timeout 408 (400 at
once when the client closes its side first); a request on a connection past --max-connections
503; a full queue 429; a wrong or missing API key 401 (compared in constant time;
--api-key-scope all protects every endpoint but /health). A request the
engine fails gets 500 (an error event and [DONE] when streaming) and harms no other request.
SIGTERM stops admitting (503), gives requests in flight --shutdown-grace seconds, then ends
the rest with an error event and [DONE] (lifecycle.py).

This module holds `main`. Its options: args.py; the model and its engine behind the
routes: service.py; the routes and the API key: app.py; one request's event stream:
generation.py; the streamed and the whole reply made from it: replies.py; start, drain and
shutdown: lifecycle.py; what one connection may hold (timeouts, the cap): connections.py.
"""

from __future__ import annotations

import logging
import sys

import uvicorn

from ..errors import ReferenceEngineError, exit_with
from ..runtime.tensor_parallel import leads
from .app import create_app
from .args import ServeArgs
from .connections import connection_policy_protocol
from .followers import follow
from .lifecycle import BACKSTOP_S
from .service import Server

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = ServeArgs.parse(argv)
    try:
        server = Server(args)
    except ReferenceEngineError as exc:
        return exit_with(exc)
    logging.basicConfig(
        stream=sys.stderr, level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not leads():  # a rank above 0 under tensor parallelism: rank 0 serves
        follow(server.engine, server.make_oracle)
        return 0
    mode = f"DFlash block {server.info.block_size}" if server.info.speculative else "plain"
    mode += ", engine in a process of its own" if server.loop_mode == "process" else ", engine on a thread"
    if server.oracle_acceptance is not None:
        mode += f", acceptance forced to {server.oracle_acceptance} (benchmark only)"
    print(f"serving {server.name} on http://{args.host}:{args.port} ({mode})", flush=True)
    if server.info.step_costs is not None:  # what the verify width chooses from (verify_width.py)
        print(f"step ms by rows x verify width, measured at start-up: {server.info.step_costs}", flush=True)
    config = uvicorn.Config(
        create_app(server),
        host=args.host,
        port=args.port,
        log_level="warning",
        http=connection_policy_protocol(args.header_timeout, args.body_timeout, args.max_connections),
        timeout_keep_alive=args.timeout_keep_alive,
        timeout_graceful_shutdown=args.shutdown_grace + BACKSTOP_S,
    )
    server.lifecycle.serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
