"""Running a gate in a tensor-parallel group of local gloo processes, and the checks and the
planted fault of the tensor-parallel gates (gates/test_tensor_parallel.py).

`run_group` starts one process per rank, joins them in a gloo group on a free local port and
runs one job function in each; a hang fails after a timeout instead of blocking the suite.
Each rank returns its job's result; the ranks' results must agree (every rank holds the same
logits bits, so every rank chooses the same tokens).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.errors import ConfigError
from reference_engine.runtime.engine import EngineConfig
from reference_engine.runtime.tensor_parallel import TensorParallel, share_with_draft

from .exact import run_engine

GROUP_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, out_dir: str, job, args: tuple) -> None:
    """One rank, with the environment torchrun gives it (so an entry point run as the job
    joins the group as it would under torchrun)."""
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    dist.init_process_group("gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        result = job(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run_group(world_size: int, job, *args: Any, timeout_s: float = GROUP_TIMEOUT_S) -> list[Any]:
    """`job(rank, world_size, *args)` in `world_size` new gloo processes; each rank's
    JSON-able result, by rank. Raises if a rank fails or the group runs past `timeout_s`.

    The ranks are forked by the tests' fork server, which has imported torch and the engine
    (tests/server_process.py), instead of each importing them anew; with
    DFLASH_TEST_FRESH_SERVERS=1 they are spawned as new interpreters."""
    from tests.server_process import fresh_servers, start_fork_server

    if fresh_servers():
        start_method = "spawn"
    else:
        start_method = "forkserver"
        start_fork_server()
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _rank_main,
            args=(world_size, free_port(), out_dir, job, args),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.terminate()
                raise TimeoutError(f"a tensor-parallel group of {world_size} ran past {timeout_s} s")
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]


class RowInvariance:
    """Wraps a group's all_reduce: for every reduction of more than one row, the first and the
    last row are reduced again alone, and their bits must be those they got in the message
    (the tensor-parallel form of the verify invariance: a token's hidden state must not
    depend on how many rows its step reduces). Counts the rows compared and those that
    differed."""

    def __init__(self, tp: TensorParallel) -> None:
        self.compared = 0
        self.differed = 0
        reduce = tp.all_reduce

        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            partial = x.reshape(-1, x.shape[-1])
            out = reduce(x.clone())  # the fast all-reduce sums in place
            rows = out.reshape(-1, out.shape[-1])
            if len(rows) > 1:
                for r in (0, len(rows) - 1):
                    alone = reduce(partial[r : r + 1].clone())
                    self.compared += 1
                    self.differed += int(not torch.equal(alone[0], rows[r]))
            return out

        tp.all_reduce = all_reduce


def plant_size_dependent_order(tp: TensorParallel) -> None:
    """The planted fault: a reduction whose order of addition depends on the message size, as
    an all-reduce that picks its algorithm by size does: rank order for one row, reversed
    rank order for more. With two ranks the order of two terms changes no bit (a + b ==
    b + a), so the fault is caught from three ranks on."""
    correct = tp.all_reduce

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        if x.reshape(-1, x.shape[-1]).shape[0] == 1:
            return correct(x)
        parts = tp.all_gather(x).flip(0)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    tp.all_reduce = all_reduce


def sharded_runs(
    rank: int,
    world_size: int,
    pairs: dict[str, tuple[str, str]],
    prompts: dict[str, list[int]],
    max_tokens: int,
    dtype: str,
    numerics: tuple[str, ...],
    block_size: int,
    faulty: tuple[str, ...] = (),
    with_plain: bool = True,
) -> dict[str, Any]:
    """One rank's job: for each family's pair and each numerics (and, for each of `faulty`,
    that numerics with the planted fault, under the key "<numerics>+fault"), plain greedy
    and DFlash through a batched engine on the sharded target, with the row invariance
    checked. Returns {family: {key: {"plain": outputs (None without `with_plain`), "dflash":
    outputs, "compared": n, "differed": n}}}, or {family: {"refused": message}} for a family
    this degree cannot shard (its heads do not divide over the ranks): the same on every rank,
    since the check reads the config alone."""
    runs = [(mode, mode, False) for mode in numerics] + [(f"{mode}+fault", mode, True) for mode in faulty]
    results: dict[str, Any] = {}
    for family, (target_dir, draft_dir) in pairs.items():
        results[family] = {}
        for key, mode, fault in runs:
            tp = TensorParallel(rank, world_size, mode)
            if fault:
                plant_size_dependent_order(tp)
            check = RowInvariance(tp)
            try:
                target = load_target(target_dir, dtype=getattr(torch, dtype), tensor_parallel=tp)
            except ConfigError as exc:
                results[family] = {"refused": str(exc)}
                break
            draft = share_with_draft(load_draft(draft_dir, target), tp)
            config = EngineConfig(max_num_seqs=len(prompts), block_size=block_size, numerics=mode)
            plain = run_engine(target, None, prompts, max_tokens, config) if with_plain else None
            dflash = run_engine(target, draft, prompts, max_tokens, config)
            results[family][key] = {
                "plain": plain,
                "dflash": dflash,
                "compared": check.compared,
                "differed": check.differed,
            }
    return results
