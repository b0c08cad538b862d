"""The engine a server runs, as its options ask: built (`build_engine`), where it steps
(`engine_loop_mode`), what the HTTP side knows of it (`EngineInfo`) and the benchmarks' forced
acceptance (`oracle_maker`). The server's process or the engine's own (engine_process.py)
builds it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..checkpoint import load_draft, load_target
from ..engine_args import engine_config, resolve_device, resolve_dtype
from ..errors import ReferenceEngineError
from ..kernels import default_numerics
from ..runtime.engine import Engine
from ..runtime.oracle import OracleProposer
from ..runtime.request import SamplingParams
from ..runtime.tensor_parallel import (
    TensorParallel,
    init_tensor_parallel,
    rank_device,
    share_with_draft,
)
from .async_engine import MakeOracle

if TYPE_CHECKING:
    from .args import ServeArgs


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side needs to know of the engine (it may run in another process)."""

    device: str
    dtype: str
    numerics: str
    speculative: bool
    block_size: int | None
    max_num_seqs: int
    vocab_size: int
    context_len: int
    threads: int  # torch's CPU threads where the engine runs
    # the verify width's step costs, when measured at start-up (StepCosts.text), else None
    step_costs: str | None = None

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        costs = engine.verify_width.costs if engine.verify_width is not None else None
        return cls(
            str(engine.device),
            str(engine.dtype).removeprefix("torch."),
            engine.numerics,
            engine.draft is not None,
            engine.block_size or None,
            engine.config.max_num_seqs,
            engine.target.config.vocab_size,
            engine.context_len,
            torch.get_num_threads(),
            costs.text() if costs is not None and costs.measured else None,
        )


def engine_loop_mode(args: ServeArgs) -> str:
    """`--engine-loop`: auto is a process of its own on a GPU at one rank (where a step takes
    as little host time as the HTTP side's work for it), a thread otherwise; tensor
    parallelism keeps rank 0's engine on a thread (its followers repeat its calls)."""
    if args.engine_loop == "process" and args.tensor_parallel_size > 1:
        raise ReferenceEngineError(
            "--engine-loop process runs one rank; with --tensor-parallel-size "
            f"{args.tensor_parallel_size} use --engine-loop thread (or auto)"
        )
    if args.engine_loop != "auto":
        return args.engine_loop
    if args.tensor_parallel_size > 1 or resolve_device(args.device).type != "cuda":
        return "thread"
    return "process"


def build_engine(args: ServeArgs) -> tuple[Engine, TensorParallel | None, MakeOracle | None]:
    """The engine `args` ask for, with its tensor-parallel group (None at one rank) and its
    benchmarks' forced acceptance (`oracle_maker`); raises ReferenceEngineError for options
    that cannot be served."""
    device = resolve_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, args.model, device)
    numerics = args.numerics or default_numerics(device, dtype)
    # above one rank, rank 0 serves and the others follow its engine (followers.py)
    tp = init_tensor_parallel(args.tensor_parallel_size, device, numerics, "serve")
    device = rank_device(device, tp)
    target = load_target(args.model, dtype=dtype, device=device, tensor_parallel=tp)
    draft = None
    if args.draft:
        draft = load_draft(args.draft, target)
        if tp is not None:
            share_with_draft(draft, tp)
    elif args.block_size is not None:
        raise ReferenceEngineError("--block-size needs --dflash-draft-model-path")
    if args.oracle_acceptance is not None and draft is None:
        raise ReferenceEngineError("--oracle-acceptance needs --dflash-draft-model-path")
    config = engine_config(args, max_waiting=args.max_waiting)
    engine = Engine(target, draft, config)  # validates the pair and the options
    return engine, tp, oracle_maker(args.oracle_acceptance, engine)


def oracle_maker(acceptance: float | None, engine: Engine) -> MakeOracle | None:
    """Benchmarks only (--oracle-acceptance): each greedy request's proposer forcing that
    mean acceptance length; raises ReferenceEngineError for one the block cannot give."""
    if acceptance is None:
        return None
    block, vocab = engine.block_size, engine.target.config.vocab_size
    OracleProposer.for_mean_acceptance([], acceptance, block, vocab)

    def make_oracle(params: SamplingParams) -> OracleProposer | None:
        if not params.greedy:
            return None
        return OracleProposer.for_mean_acceptance([], acceptance, block, vocab, forced=True)

    return make_oracle
