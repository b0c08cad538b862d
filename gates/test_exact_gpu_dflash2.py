"""The GPU tier with DFlash2 drafts: on real-shaped random targets in bfloat16 under the exact
numerics, a DFlash2 draft's speculative output equals plain greedy bit for bit and every
accepted position's verify logits equal plain decode's, alone and batched, replaying CUDA
graphs (the engine's default on CUDA); with the draft's own proposals (the selector's walk)
and with the oracle's (acceptance of every length). Skipped without CUDA.

DFLASH2_GATE_SHAPES (comma-separated --random-shape names; default the Qwen3-8B and
Qwen3.5-4B shapes) picks the targets; the MoE shapes are among the names.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from reference_engine.runtime.engine import EngineConfig
from reference_engine.runtime.oracle import OracleProposer

from .exact import describe, divergences, model_ops, plain_with_logits, run_engine

pytestmark = pytest.mark.gpu

SHAPES = tuple(os.environ.get("DFLASH2_GATE_SHAPES", "qwen3-8b,qwen3.5-4b").split(","))
BLOCK_SIZE = 16
TOKENS = 24
REQUESTS = 12


@pytest.fixture(scope="module", params=SHAPES)
def shaped(request: pytest.FixtureRequest):
    """A real-shaped random target with a random DFlash2 draft (the published DFlash2
    fields), 12 prompts of mixed lengths, and plain greedy with logits for each alone."""
    from reference_engine.bench.shapes import random_pair

    numerics = request.config.getoption("--gate-numerics")
    target, draft = random_pair(
        request.param, "cuda", torch.bfloat16, seed=3, block_size=BLOCK_SIZE, draft_arch="dflash2"
    )
    rng = random.Random(7)
    vocab = target.config.vocab_size
    prompts = {
        f"r{i}": [rng.randrange(vocab - 1) for _ in range(rng.randint(5, 160))] for i in range(REQUESTS)
    }
    ops = model_ops(target, numerics)
    plain = {rid: plain_with_logits(target, p, TOKENS, ops, prefill_chunk=64) for rid, p in prompts.items()}
    yield numerics, target, draft, prompts, plain
    del target, draft
    torch.cuda.empty_cache()


def config_for(prompts: dict[str, list[int]], concurrency: int, numerics: str) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=concurrency,
        block_size=BLOCK_SIZE,
        commit_strategy="per_token",
        prefill_chunk=64,
        numerics=numerics,
        max_model_len=max(map(len, prompts.values())) + TOKENS,
    )


@pytest.mark.parametrize("proposer", ["draft", "oracle"])
@pytest.mark.parametrize("concurrency", [1, 4, 12])
def test_dflash2_equals_plain_greedy_bitwise_in_bfloat16(shaped, concurrency: int, proposer: str) -> None:
    numerics, target, draft, prompts, plain = shaped
    references = {rid: out for rid, (out, _) in plain.items()}
    logits = {rid: lg for rid, (_, lg) in plain.items()}
    rng, vocab = random.Random(concurrency), target.config.vocab_size
    oracles = None
    if proposer == "oracle":
        oracles = {
            rid: OracleProposer(references[rid], [rng.randrange(BLOCK_SIZE) for _ in range(7)], vocab)
            for rid in prompts
        }
    arrivals = {rid: 3 * i for i, rid in enumerate(prompts)}  # staggered: rows join and leave
    outputs = run_engine(
        target,
        draft,
        prompts,
        TOKENS,
        config_for(prompts, concurrency, numerics),
        arrivals,
        oracles,
        check=(prompts, references, logits),
    )
    found = divergences(references, logits, outputs)
    assert not found, describe(found, len(references))
