"""Tensor parallelism is exact (reference_engine/runtime/tensor_parallel.py), on the CPU tier:
gloo processes (two, or --gate-tensor-parallel-size) on the tiny pairs of every family, in
float64.

- TP=N greedy output equals TP=1 (the unsharded model) for every family;
- under TP=N, DFlash equals plain greedy in both numerics, every rank chose the same
  tokens, and every reduction gave a row the bits it gets alone;
- a planted fault, a reduction whose order of addition depends on the rows in the message,
  is caught by that row check (at four ranks: with two, a + b == b + a leaves no order to
  get wrong).
"""

from __future__ import annotations

import pytest
import torch

from reference_engine.checkpoint import load_target
from reference_engine.config import FAMILIES
from reference_engine.runtime.engine import EngineConfig

from .exact import run_engine
from .parallel import run_group, sharded_runs

BLOCK_SIZE = 4
MAX_TOKENS = 10
PROMPTS = {"a": [5, 17, 33, 2, 90, 41, 7], "b": [250, 3, 3, 61, 128]}


@pytest.fixture(scope="module")
def pairs(tiny_pair) -> dict[str, tuple[str, str]]:
    return {family: tuple(map(str, tiny_pair(family, block_size=BLOCK_SIZE))) for family in FAMILIES}


@pytest.fixture(scope="module")
def tp_size(request: pytest.FixtureRequest) -> int:
    size = request.config.getoption("--gate-tensor-parallel-size")
    if size < 2:
        pytest.fail(f"--gate-tensor-parallel-size must be at least 2, got {size}")
    return size


@pytest.fixture(scope="module")
def tp2(pairs, tp_size: int) -> list[dict]:
    """Every rank's plain and DFlash outputs of every family in both numerics, at TP=N."""
    args = (pairs, PROMPTS, MAX_TOKENS, "float64", ("exact", "fast"), BLOCK_SIZE)
    return run_group(tp_size, sharded_runs, *args)


def sharded(tp2: list[dict], family: str) -> list[dict]:
    """Each rank's results of one family; a family this degree cannot shard is skipped."""
    if "refused" in tp2[0][family]:
        pytest.skip(f"{family} at this degree: {tp2[0][family]['refused']}")
    return [result[family] for result in tp2]


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_greedy_equals_tp1_in_float64(pairs, tp2, family: str) -> None:
    target = load_target(pairs[family][0], dtype=torch.float64)
    config = EngineConfig(max_num_seqs=len(PROMPTS), block_size=BLOCK_SIZE)
    unsharded = run_engine(target, None, PROMPTS, MAX_TOKENS, config)
    for rank, result in enumerate(sharded(tp2, family)):
        for numerics, runs in result.items():
            assert runs["plain"] == unsharded, f"rank {rank}, {numerics}: TP=N greedy differs from TP=1"


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_dflash_equals_plain_greedy_and_every_rank_agrees(tp2, family: str) -> None:
    ranks = sharded(tp2, family)
    for numerics, runs in ranks[0].items():
        assert runs["dflash"] == runs["plain"], f"{numerics}: DFlash differs from plain greedy under TP=N"
        for rank, result in enumerate(ranks[1:], 1):
            assert result[numerics]["dflash"] == runs["dflash"], f"{numerics}: rank {rank} disagrees"


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_reductions_give_a_row_the_bits_it_gets_alone(tp2, tp_size: int, family: str) -> None:
    """The exact numerics' reductions. The fast numerics' all-reduce promises no such thing,
    and from three ranks on it breaks it: gloo's at four ranks changed 132 of 414 rows' bits
    on one tiny family (--gate-tensor-parallel-size 4), while its greedy output still
    equalled plain greedy's. At two ranks any order of two terms gives the same bits, so there
    the fast numerics are held to it too."""
    for rank, result in enumerate(sharded(tp2, family)):
        for numerics, runs in result.items():
            if numerics != "exact" and tp_size > 2:
                continue
            assert runs["compared"] > 0, "no reduction of several rows was checked"
            assert runs["differed"] == 0, (
                f"rank {rank}, {numerics}: {runs['differed']} of {runs['compared']} rows changed "
                "bits with the rows reduced alongside them"
            )


def test_a_size_dependent_reduction_order_is_caught(tiny_pair) -> None:
    """Four ranks (the tiny Qwen3's 4 query heads, its 2 KV heads copied to two ranks each),
    in float32, the exact numerics: clean, no row changes bits; with the fault, rows do."""
    pair = {"qwen3": tuple(map(str, tiny_pair("qwen3", block_size=BLOCK_SIZE)))}
    args = (pair, {"a": PROMPTS["a"]}, 4, "float32", ("exact",), BLOCK_SIZE, ("exact",), False)
    runs = run_group(4, sharded_runs, *args)
    clean, faulty = runs[0]["qwen3"]["exact"], runs[0]["qwen3"]["exact+fault"]
    assert clean["compared"] > 0 and clean["differed"] == 0, clean
    assert faulty["differed"] > 0, "the size-dependent reduction order went unnoticed"
