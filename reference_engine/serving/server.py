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
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..checkpoint import DTYPES, load_draft, load_target, parse_dtype
from ..errors import ReferenceEngineError, exit_with
from ..kernels import NUMERICS
from ..runtime.commit import COMMIT_STRATEGIES
from ..runtime.engine import Engine, EngineConfig, EngineFullError, StepOutput
from ..runtime.oracle import OracleProposer
from ..tokenizer import CHAT_TEMPLATE, load_tokenizer
from .async_engine import AsyncEngine, Finished, RequestFailed, ShuttingDown
from .chat_template import compile_chat_template, render_chat_template
from .lifecycle import BACKSTOP_S, GracefulServer, header_timeout_protocol
from .limits import BodyLimits, MiB, decode_json, read_body
from .metrics import FAILED, RequestMetrics, ServerMetrics
from .protocol import (
    ProtocolError,
    chunk,
    error_body,
    full_response,
    logprobs_body,
    new_id,
    parse_request,
    spec_summary,
    usage,
)
from .stop_strings import StopStringText


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
    """Model, tokenizer, engine thread and metrics behind the HTTP routes."""

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
        self.draining = False  # SIGTERM received: new requests get 503
        self.metrics = ServerMetrics()
        self.runner: AsyncEngine | None = None
        self.counter = 0
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

    def start(self) -> None:
        self.runner = AsyncEngine(self.engine, self.metrics.on_step, self.make_oracle)

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


def create_app(server: Server) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        server.start()
        yield
        server.runner.shutdown()

    app = FastAPI(title="DFlash reference server", lifespan=lifespan)

    def fail(exc: ProtocolError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), exc.kind, exc.param, exc.code),
                            status_code=exc.status)

    def authorized(request: Request) -> bool:
        if server.api_key is None:
            return True
        given = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
        # constant time: the comparison does not tell how much of a guess was right
        return hmac.compare_digest(given, f"Bearer {server.api_key}".encode())

    @app.middleware("http")
    async def protect_everything(request: Request, call_next):
        if (server.api_key_scope == "all" and request.url.path != "/health"
                and not request.url.path.startswith("/v1/") and not authorized(request)):
            return fail(ProtocolError("missing or wrong API key", None, 401,
                                      "authentication_error"))
        return await call_next(request)

    @app.get("/health")
    async def health():
        if server.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if server.runner is None or not server.runner.alive:
            return JSONResponse({"status": "unhealthy", "reason": "the engine loop is not running"},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/info")
    async def info():
        """What a benchmark records about this server (harness meta.json, the report's run table)."""
        engine = server.engine
        return {"model": server.name, "torch": torch.__version__, "device": str(engine.device),
                "dtype": str(engine.dtype).removeprefix("torch."), "numerics": engine.numerics,
                "mode": "dflash" if engine.draft is not None else "plain",
                "block_size": engine.block_size or None, "max_num_seqs": engine.config.max_num_seqs,
                "threads": torch.get_num_threads()}

    @app.get("/v1/models")
    async def models(request: Request):
        if not authorized(request):
            return fail(ProtocolError("missing or wrong API key", None, 401,
                                      "authentication_error"))
        return {"object": "list", "data": [{"id": server.name, "object": "model",
                                            "owned_by": "reference_engine"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics.render(server.engine),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def generate(request: Request, chat: bool):
        arrival_s = time.monotonic()
        if not authorized(request):
            return fail(ProtocolError("missing or wrong API key", None, 401,
                                      "authentication_error"))
        if server.draining:
            return fail(ProtocolError("the server is shutting down", None, 503,
                                      "service_unavailable"))
        try:
            raw = await read_body(request, server.limits)
            # decoding and tokenising a large body take a while: not on the event loop
            parsed = await asyncio.to_thread(_parse, server, raw, chat)
        except ProtocolError as exc:
            return fail(exc)
        server.counter += 1
        request_id = f"{new_id(chat)}-{server.counter}"
        # the request's metrics, counted here: only this handler knows how the request ends
        # for its client (a stop string cut, a client gone), and it ends each one exactly once
        counted = server.metrics.request(len(parsed.prompt_ids), arrival_s)
        try:
            queue = await server.runner.submit(request_id, parsed.prompt_ids, parsed.params)
        except EngineFullError as exc:
            return fail(ProtocolError(str(exc), None, 429, "rate_limit_error"))
        except ReferenceEngineError as exc:
            return fail(ProtocolError(str(exc)))
        except RequestFailed as exc:
            counted.finish(FAILED)
            return fail(ProtocolError(str(exc), None, 500, "server_error"))
        text = StopStringText(server.detokenize, parsed.stop)

        def close() -> None:  # however the response ends; a client gone leaves it unfinished
            if not counted.finished:
                server.runner.abort(request_id)
                counted.finish("abort")

        if parsed.stream:
            return EventStream(stream_events(request_id, parsed, queue, text, counted), close)
        try:
            return await collect_response(request_id, parsed, queue, text, counted)
        finally:
            close()

    def piece(parsed, out: StepOutput, text: StopStringText,
              counted: RequestMetrics) -> tuple[str, list[int], dict | None]:
        delta, ids = text.push(out.new_token_ids, out.finished)
        counted.delivered(len(ids), out.time_s)
        if text.stopped:
            counted.finish("stop")
        elif out.finished:
            counted.finish(out.finish_reason)
        lp = None
        if parsed.logprobs is not None and out.new_logprobs:
            lp = logprobs_body(parsed.chat, [server.detokenize([t]) for t in ids], ids,
                               out.new_logprobs[: len(ids)], lambda t: server.detokenize([t]),
                               parsed.logprobs)
        return delta, ids, lp

    async def collect_response(request_id, parsed, queue, text, counted: RequestMetrics):
        pieces, ids, entries, finish = [], [], [], None
        while True:
            item = await queue.get()
            if isinstance(item, Finished):
                counted.finish(_ended(item))
                if isinstance(item.error, ShuttingDown):
                    return fail(ProtocolError(str(item.error), None, 503, "service_unavailable"))
                if item.error is not None:
                    return fail(ProtocolError(f"engine error: {item.error}", None, 500,
                                              "server_error"))
                sequence = item.sequence
                break
            if text.stopped:
                continue  # cut at a stop string: drain until the abort lands
            delta, new_ids, _ = piece(parsed, item, text, counted)
            pieces.append(delta)
            ids.extend(new_ids)
            if item.new_logprobs:
                entries.extend(item.new_logprobs[: len(new_ids)])
            finish = item.finish_reason
            if text.stopped:
                server.runner.abort(request_id)
                finish = "stop"
        lp = None
        if parsed.logprobs is not None:
            lp = logprobs_body(parsed.chat, [server.detokenize([t]) for t in ids], ids,
                               entries, lambda t: server.detokenize([t]), parsed.logprobs)
        return full_response(request_id, server.name, parsed.chat, "".join(pieces), ids,
                             finish or "abort", lp, usage(len(parsed.prompt_ids), len(ids)),
                             spec_summary(sequence), parsed.prompt_ids)

    async def stream_events(request_id, parsed, queue, text, counted: RequestMetrics):
        emitted, first = 0, True
        while True:
            item = await queue.get()
            if isinstance(item, Finished):
                counted.finish(_ended(item))
                if isinstance(item.error, ShuttingDown):
                    yield _sse(error_body(str(item.error), "service_unavailable", None, 503))
                elif item.error is not None:
                    yield _sse(error_body(f"engine error: {item.error}", "server_error",
                                          None, 500))
                elif parsed.include_usage:
                    body = chunk(request_id, server.name, parsed.chat, "", [], None)
                    body["choices"] = []
                    body["usage"] = usage(len(parsed.prompt_ids), emitted)
                    spec = spec_summary(item.sequence)
                    if spec is not None:
                        body["spec_decode"] = spec
                    yield _sse(body)
                yield "data: [DONE]\n\n"
                return
            if text.stopped:
                continue  # cut at a stop string: drain until the abort lands
            delta, ids, lp = piece(parsed, item, text, counted)
            finish = "stop" if text.stopped else item.finish_reason
            if text.stopped:
                server.runner.abort(request_id)
            emitted += len(ids)
            body = chunk(request_id, server.name, parsed.chat, delta, ids, finish, lp,
                         role=first)
            first = False
            if parsed.continuous_usage:
                body["usage"] = usage(len(parsed.prompt_ids), emitted)
            yield _sse(body)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


class EventStream(StreamingResponse):
    """An SSE response that calls `close` however it ends: streamed to the end, or cut short
    by a client that went away (mid-stream, or before the first event was sent)."""

    def __init__(self, events: AsyncIterator[str], close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.close = close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.close()


def _ended(item: Finished) -> str:
    """How a request ended that its handler had not seen end (an error, or an abort: the
    server shut down)."""
    if item.error is not None and not isinstance(item.error, ShuttingDown):
        return FAILED
    return "abort"


def _parse(server: Server, raw: bytes, chat: bool):
    body = decode_json(raw, server.limits)
    return parse_request(body, server.name, server.tokenize, chat, server.apply_chat_template,
                         server.engine.target.config.vocab_size)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def main(argv: list[str] | None = None) -> int:
    args = ServeArgs.parse(argv)
    try:
        server = Server(args)
    except ReferenceEngineError as exc:
        return exit_with(exc)
    import uvicorn

    logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    app = create_app(server)
    mode = f"DFlash block {server.engine.block_size}" if server.engine.draft else "plain"
    if server.oracle_acceptance is not None:
        mode += f", acceptance forced to {server.oracle_acceptance} (benchmark only)"
    print(f"serving {server.name} on http://{args.host}:{args.port} ({mode})", flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            http=header_timeout_protocol(args.header_timeout),
                            timeout_keep_alive=args.timeout_keep_alive,
                            timeout_graceful_shutdown=args.shutdown_grace + BACKSTOP_S)

    def drain() -> None:
        server.draining = True

    def deadline() -> None:
        if server.runner is not None:
            server.runner.end_all(f"the server shut down before this request finished "
                                  f"(--shutdown-grace {args.shutdown_grace:g} s)")

    def idle() -> bool:
        return server.runner is None or not server.runner.streams

    GracefulServer(config, args.shutdown_grace, drain, deadline, idle).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
