"""The GPU tier at long context: on the Qwen3-8B shape (random weights, bfloat16, the exact
numerics), a prompt of about 32K tokens (16 key splits) and a short one beside it, prefilled
in the engine's chunks and decoded by DFlash with scheduled acceptance: each request equals
plain greedy decode alone (prefilled in other chunks), and the verify logits of every
accepted position equal plain decode's bit for bit. Planted fault: a verify whose attention
cuts the keys at other split boundaries than decode does (splits of 1024 positions instead
of 2048), which gives another order of the online softmax's merges only past 2048
positions. Skipped without CUDA; DFLASH_GATE_LONG_TOKENS sets the long prompt's length.
"""

from __future__ import annotations

import os
import random
from functools import partial

import pytest
import torch

from reference_engine.kernels.attention import SPLIT
from reference_engine.runtime.engine import EngineConfig
from reference_engine.runtime.oracle import OracleProposer

from .exact import describe, divergences, model_ops, plain_with_logits, run_engine, verify_with

pytestmark = pytest.mark.gpu

LONG_TOKENS = int(os.environ.get("DFLASH_GATE_LONG_TOKENS", 16 * SPLIT - 200))
SHORT_TOKENS = 100
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def numerics(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--gate-numerics")


@pytest.fixture(scope="module")
def long_pair(numerics: str):
    """The Qwen3-8B shape, a long and a short prompt, and plain greedy with logits for each
    alone, prefilled in chunks of 1000 (the engine's are 2048)."""
    from reference_engine.bench.shapes import random_pair

    target, draft = random_pair("qwen3-8b", "cuda", torch.bfloat16, seed=7, block_size=16)
    rng = random.Random(11)
    vocab = target.config.vocab_size
    prompts = {
        "long": [rng.randrange(vocab - 1) for _ in range(LONG_TOKENS)],
        "short": [rng.randrange(vocab - 1) for _ in range(SHORT_TOKENS)],
    }
    ops = model_ops(target, numerics)
    plain = {
        rid: plain_with_logits(target, p, MAX_TOKENS, ops, prefill_chunk=1000) for rid, p in prompts.items()
    }
    yield target, draft, prompts, plain
    del target, draft
    torch.cuda.empty_cache()


def long_run(long_pair, numerics: str):
    target, draft, prompts, plain = long_pair
    references = {rid: out for rid, (out, _) in plain.items()}
    logits = {rid: lg for rid, (_, lg) in plain.items()}
    rng = random.Random(3)
    oracles = {
        rid: OracleProposer(references[rid], [rng.randrange(16) for _ in range(7)], target.config.vocab_size)
        for rid in prompts
    }
    config = EngineConfig(
        max_num_seqs=2,
        block_size=16,
        commit_strategy="per_token",
        numerics=numerics,
        max_model_len=LONG_TOKENS + MAX_TOKENS,
    )
    # the short request decodes while the long one prefills beside it, in chunks of 2048
    outputs = run_engine(
        target,
        draft,
        prompts,
        MAX_TOKENS,
        config,
        {"short": 0, "long": 1},
        oracles,
        check=(prompts, references, logits),
    )
    return references, logits, outputs


def test_long_context_dflash_equals_plain_alone_and_verify_logits_are_bitwise(
    long_pair, numerics: str
) -> None:
    references, logits, outputs = long_run(long_pair, numerics)
    found = divergences(references, logits, outputs)
    assert not found, describe(found, len(references))


def test_long_context_gate_fails_on_split_boundaries_of_its_own_in_verify(long_pair, numerics: str) -> None:
    if numerics == "fast":
        pytest.skip("the fast numerics promise no verify bits to break")
    exact = model_ops(long_pair[0], numerics)
    with (
        verify_with(attention=partial(exact.attention, split=SPLIT // 2)),
        pytest.raises(AssertionError, match="differ"),
    ):
        long_run(long_pair, numerics)
