"""The server's command line: one frozen dataclass, built from argparse."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from ..engine_args import add_engine_options
from .metrics import SPEC_NAMINGS


@dataclass(frozen=True)
class ServeArgs:
    model: str
    draft: str | None
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
    gpu_memory_utilization: float = 0.9
    verify_width: str = "auto"
    steps_per_turn: int = 1
    draft_span: str = "block"
    measure_step_costs: bool = False
    device_phase_times: bool = False
    prefill_chunk: int = 2048
    max_num_batched_tokens: int | None = None
    kv_cache_tokens: int | None = None
    kv_cell_tokens: int = 256
    max_body_mb: float = 4.0
    shutdown_grace: float = 5.0
    api_key_scope: str = "api"
    timeout_keep_alive: float = 5.0
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 512
    metrics_names: tuple[str, ...] = ("dflash",)
    tensor_parallel_size: int = 1
    engine_loop: str = "auto"

    @classmethod
    def parse(cls, argv: list[str] | None) -> ServeArgs:
        return cls(**vars(cls.parser().parse_args(argv)))

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            prog="python -m reference_engine.serve", description="The OpenAI-compatible reference server."
        )
        add_engine_options(
            p,
            "model",
            "draft",
            "block_size",
            "commit_strategy",
            "dtype",
            "device",
            "max_num_seqs",
            model={"required": True},
        )
        p.add_argument(
            "--threads",
            type=_threads,
            default=None,
            help="CPU threads per operator (torch.set_num_threads; default: torch's). "
            "1 when a load generator shares the machine's few cores: "
            "threads that wait on each other for a busy core slow every step",
        )
        add_engine_options(p, "max_model_len", "prefill_chunk", "max_num_batched_tokens")
        add_engine_options(p, "kv_cache_tokens", "kv_cell_tokens")
        p.add_argument(
            "--max-waiting", type=int, default=256, help="queued requests beyond the slots; more get HTTP 429"
        )
        p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
        p.add_argument("--port", type=_port, default=8000, help="TCP port, 1-65535")
        p.add_argument(
            "--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API (else 401)"
        )
        p.add_argument(
            "--served-model-name",
            default=None,
            help="the model name clients send (default: the model directory's name)",
        )
        p.add_argument(
            "--oracle-acceptance",
            type=float,
            default=None,
            help="benchmarks only: force this mean acceptance length on greedy "
            "requests (the draft still runs; output is not checked)",
        )
        add_engine_options(
            p,
            "numerics",
            "enforce_eager",
            "gpu_memory_utilization",
            "verify_width",
            "steps_per_turn",
            "draft_span",
            "measure_step_costs",
            "device_phase_times",
            "tensor_parallel_size",
        )
        p.add_argument(
            "--engine-loop",
            choices=("auto", "process", "thread"),
            default="auto",
            help="where the engine steps: a process of its own beside the HTTP server, which "
            "then never waits for the engine's interpreter lock, or a thread of the server's "
            "process; auto (default): process on a GPU at one rank, thread otherwise",
        )
        p.add_argument(
            "--max-body-mb",
            type=_body_mib,
            default=4.0,
            help="largest request body in MiB; a larger one gets HTTP 413",
        )
        p.add_argument(
            "--shutdown-grace",
            type=_non_negative_float,
            default=5.0,
            help="seconds that requests in flight get to finish after SIGTERM; "
            "then each ends with an error event and [DONE]",
        )
        p.add_argument(
            "--api-key-scope",
            choices=("api", "all"),
            default="api",
            help="what --api-key protects: 'api' (/v1/*) or 'all' (also /metrics, "
            "/info, /docs, /redoc, /openapi.json; /health stays open)",
        )
        p.add_argument(
            "--timeout-keep-alive",
            type=_positive_float,
            default=5.0,
            help="seconds an idle keep-alive connection stays open",
        )
        p.add_argument(
            "--header-timeout",
            type=_positive_float,
            default=10.0,
            help="seconds a connection has to send a request's headers",
        )
        p.add_argument(
            "--body-timeout",
            type=_positive_float,
            default=30.0,
            help="seconds a request has to send its whole body after its headers; then HTTP 408",
        )
        p.add_argument(
            "--metrics-names",
            type=_metrics_names,
            default=("dflash",),
            help="comma-separated namings of the acceptance counters on /metrics: dflash "
            "(positions from 1), vllm, lmdeploy (theirs, positions from 0), side by side; "
            "e.g. dflash,vllm so that vLLM's benchmark client reads our acceptance",
        )
        p.add_argument(
            "--max-connections",
            type=_positive_int,
            default=512,
            help="open connections at most; a request on one more gets HTTP 503",
        )
        return p


def _threads(text: str) -> int:
    try:
        threads = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a thread count: {text!r}") from None
    if threads < 1:
        raise argparse.ArgumentTypeError(f"threads must be >= 1, got {threads}")
    return threads


def _metrics_names(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    unknown = [n for n in names if n not in SPEC_NAMINGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(SPEC_NAMINGS)}, got {text!r}"
        )
    return names


def _finite_float(text: str) -> float:
    value = float(text)
    if value != value or abs(value) == float("inf"):
        raise ValueError(text)
    return value


def _bounded(parse, what: str, ok, bound: str):
    """An argparse type: `parse` the text (`what` it must be otherwise), then require `ok`;
    each refusal is one line naming the value."""

    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value:g}")
        return value

    return convert


_positive_int = _bounded(int, "an integer", lambda v: v >= 1, ">= 1")
# seconds or MiB: 0 or less would refuse or close every request
_positive_float = _bounded(_finite_float, "a finite number", lambda v: v > 0, "> 0")
_non_negative_float = _bounded(_finite_float, "a finite number", lambda v: v >= 0, ">= 0")
# a body limit in MiB: at least one byte, and finite once counted in bytes
_body_mib = _bounded(
    _finite_float,
    "a finite number",
    lambda v: 1 <= v * 1024 * 1024 < math.inf,
    f"at least one byte ({1 / 1024 / 1024:.3g} MiB) and finite in bytes",
)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 1-65535, got {port}")
    return port
