"""The OpenAI-compatible reference server.

    python -m reference_engine.serve --model DIR [--dflash-draft-model-path DIR]
        [--block-size N] [--commit-strategy NAME] [--dtype ...] [--device ...]
        [--max-num-seqs N] [--max-model-len N] [--max-waiting N]
        [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--served-model-name NAME]

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(SSE streaming with `[DONE]`, `stream_options.include_usage` and
`continuous_usage_stats`), GET /metrics (Prometheus text; see metrics.py). Protocol
details and extensions: protocol.py. Bad requests get HTTP 400 with an OpenAI-style error
body; a body over --max-body-mb 413; a full queue 429; a wrong or missing API key 401 (compared
in constant time; --api-key-scope all protects every endpoint but /health). A request the
engine fails gets 500 (an error event and [DONE] when streaming) and harms no other request.
SIGTERM stops admitting (503), gives requests in flight --shutdown-grace seconds, then ends
the rest with an error event and [DONE] (lifecycle.py).

This module holds the options, the model and its engine behind the routes (`Server`) and
`main`. The routes and the API key: app.py; one request's event stream: generation.py; the
streamed and the whole reply made from it: replies.py; start, drain and shutdown: lifecycle.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import uvicorn

from ..checkpoint import DTYPES, load_draft, load_target, parse_dtype
from ..errors import ReferenceEngineError, exit_with
from ..kernels import NUMERICS
from ..runtime.commit import COMMIT_STRATEGIES
from ..runtime.engine import Engine, EngineConfig
from ..runtime.oracle import OracleProposer
from ..tokenizer import CHAT_TEMPLATE, load_tokenizer
from .app import create_app
from .async_engine import AsyncEngine
from .chat_template import compile_chat_template, render_chat_template
from .lifecycle import BACKSTOP_S, Lifecycle, header_timeout_protocol
from .limits import BodyLimits, MiB, decode_json
from .metrics import ServerMetrics
from .protocol import ParsedRequest, ProtocolError, new_id, parse_request


@dataclass(frozen=True)
class ServeArgs:
    model: str
    dflash_draft_model_path: str | None
    block_size: int | None
    commit_strategy: str
    dtype: str
    device: str
    max_num_seqs: int
    max_model_len: int | None
    threads: int | None
    max_waiting: int
    host: str
    port: int
    api_key: str | None
    served_model_name: str | None
    oracle_acceptance: float | None
    numerics: str | None
    enforce_eager: bool
    max_body_mb: float = 4.0
    shutdown_grace: float = 5.0
    api_key_scope: str = "api"
    timeout_keep_alive: float = 5.0
    header_timeout: float = 10.0

    @classmethod
    def parse(cls, argv: list[str] | None) -> ServeArgs:
        p = argparse.ArgumentParser(prog="python -m reference_engine.serve",
                                    description="The OpenAI-compatible reference server.")
        p.add_argument("--model", required=True,
                       help="target checkpoint directory (Hugging Face layout)")
        p.add_argument("--dflash-draft-model-path", default=None,
                       help="DFlash draft checkpoint directory; without it, plain decode")
        p.add_argument("--block-size", type=int, default=None,
                       help="DFlash block size (anchor included; default: the draft's)")
        p.add_argument("--commit-strategy", default="replay", choices=COMMIT_STRATEGIES,
                       help="how hybrid (Gated DeltaNet) state reaches the accepted boundary")
        p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                       help="weights and activations")
        p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
        p.add_argument("--max-num-seqs", type=int, default=8,
                       help="slots: requests decoded at once")
        p.add_argument("--threads", type=_threads, default=None,
                       help="CPU threads per operator (torch.set_num_threads; default: torch's). "
                            "1 when a load generator shares the machine's few cores: "
                            "threads that wait on each other for a busy core slow every step")
        p.add_argument("--max-model-len", type=int, default=None,
                       help="context length (default: the target's max_position_embeddings)")
        p.add_argument("--max-waiting", type=int, default=256,
                       help="queued requests beyond the slots; more get HTTP 429")
        p.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (loopback by default)")
        p.add_argument("--port", type=_port, default=8000, help="TCP port, 1-65535")
        p.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on the API (else 401)")
        p.add_argument("--served-model-name", default=None,
                       help="the model name clients send (default: the model directory's name)")
        p.add_argument("--oracle-acceptance", type=float, default=None,
                       help="benchmarks only: force this mean acceptance length on greedy "
                       "requests (the draft still runs; output is not checked)")
        p.add_argument("--numerics", choices=NUMERICS, default=None,
                       help="kernels: exact (batch- and verify-invariant: DFlash equals plain "
                            "greedy bit for bit in bfloat16) or fast (cuBLAS matrix products); default "
                            "exact on cuda; the CPU runs the PyTorch references")
        p.add_argument("--enforce-eager", action="store_true",
                       help="run every forward eagerly (no CUDA graphs)")
        p.add_argument("--max-body-mb", type=float, default=4.0,
                       help="largest request body in MiB; a larger one gets HTTP 413")
        p.add_argument("--shutdown-grace", type=float, default=5.0,
                       help="seconds that requests in flight get to finish after SIGTERM; "
                       "then each ends with an error event and [DONE]")
        p.add_argument("--api-key-scope", choices=("api", "all"), default="api",
                       help="what --api-key protects: 'api' (/v1/*) or 'all' (also /metrics, "
                       "/info, /docs, /openapi.json; /health stays open)")
        p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                       help="seconds an idle keep-alive connection stays open")
        p.add_argument("--header-timeout", type=float, default=10.0,
                       help="seconds a connection has to send a request's headers")
        return cls(**vars(p.parse_args(argv)))


def _threads(text: str) -> int:
    try:
        threads = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a thread count: {text!r}") from None
    if threads < 1:
        raise argparse.ArgumentTypeError(f"threads must be >= 1, got {threads}")
    return threads


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 1-65535, got {port}")
    return port


class Server:
    """Model, tokenizer, engine and metrics behind the HTTP routes (app.py); the engine
    thread, draining and shutdown are its `lifecycle` (lifecycle.py)."""

    def __init__(self, args: ServeArgs) -> None:
        device = torch.device(args.device)
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ReferenceEngineError(f"--device {args.device}: no CUDA device available")
        target = load_target(args.model, dtype=parse_dtype(args.dtype), device=device)
        draft = None
        if args.dflash_draft_model_path:
            draft = load_draft(args.dflash_draft_model_path, target)
        elif args.block_size is not None:
            raise ReferenceEngineError("--block-size needs --dflash-draft-model-path")
        config = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                              block_size=args.block_size, commit_strategy=args.commit_strategy,
                              max_waiting=args.max_waiting, numerics=args.numerics,
                              enforce_eager=args.enforce_eager)
        self.engine = Engine(target, draft, config)  # validates the pair and the options
        self.tokenizer = load_tokenizer(args.model)
        self.max_token_bytes = max(len(t.encode()) for t in self.tokenizer.get_vocab())
        self.chat_template = compile_chat_template(_chat_template(Path(args.model)))
        self.limits = BodyLimits(max_bytes=int(args.max_body_mb * MiB))
        self.name = args.served_model_name or Path(args.model).name
        self.api_key = args.api_key
        self.api_key_scope = args.api_key_scope
        self.metrics = ServerMetrics()
        self.lifecycle = Lifecycle(self._start_runner, args.shutdown_grace)
        self._request_numbers = itertools.count(1)  # the last part of each request id
        self.oracle_acceptance = args.oracle_acceptance
        if self.oracle_acceptance is not None:
            if draft is None:
                raise ReferenceEngineError("--oracle-acceptance needs --dflash-draft-model-path")
            OracleProposer.for_mean_acceptance([], self.oracle_acceptance,
                                               self.engine.block_size, target.config.vocab_size)

    def make_oracle(self, params) -> OracleProposer | None:
        if self.oracle_acceptance is None or not params.greedy:
            return None
        return OracleProposer.for_mean_acceptance(
            [], self.oracle_acceptance, self.engine.block_size,
            self.engine.target.config.vocab_size, forced=True)

    def _start_runner(self) -> AsyncEngine:
        return AsyncEngine(self.engine, self.metrics.on_step, self.make_oracle)

    def new_request_id(self, chat: bool) -> str:
        return f"{new_id(chat)}-{next(self._request_numbers)}"

    def parse(self, raw: bytes, chat: bool) -> ParsedRequest:
        """A request body as the engine takes it (ProtocolError: 400, 404). Slow for a large
        body: the routes call it off the event loop."""
        body = decode_json(raw, self.limits)
        return parse_request(body, self.name, self.tokenize, chat, self.apply_chat_template,
                             self.engine.target.config.vocab_size)

    def tokenize(self, text: str) -> list[int]:
        # no token is longer than the vocabulary's longest, so a text too long for the
        # context is refused without tokenising it
        fewest = len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes
        if fewest >= self.engine.context_len:
            raise ProtocolError(f"the prompt has at least {fewest} tokens but the context holds "
                                f"{self.engine.context_len}", "prompt")
        return self.tokenizer.encode_batch([text])[0].ids  # releases the GIL, unlike encode

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return render_chat_template(self.chat_template, messages)


def _chat_template(model_dir: Path) -> str:
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text()).get("chat_template")
        if isinstance(template, str):
            return template
    return CHAT_TEMPLATE  # ChatML, documented default for tiny models


def main(argv: list[str] | None = None) -> int:
    args = ServeArgs.parse(argv)
    try:
        server = Server(args)
    except ReferenceEngineError as exc:
        return exit_with(exc)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mode = f"DFlash block {server.engine.block_size}" if server.engine.draft else "plain"
    if server.oracle_acceptance is not None:
        mode += f", acceptance forced to {server.oracle_acceptance} (benchmark only)"
    print(f"serving {server.name} on http://{args.host}:{args.port} ({mode})", flush=True)
    config = uvicorn.Config(create_app(server), host=args.host, port=args.port,
                            log_level="warning", http=header_timeout_protocol(args.header_timeout),
                            timeout_keep_alive=args.timeout_keep_alive,
                            timeout_graceful_shutdown=args.shutdown_grace + BACKSTOP_S)
    server.lifecycle.serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
