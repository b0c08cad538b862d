"""Gate: DFlash speculative decoding is byte-identical to plain greedy decode.

Grid: dense and hybrid targets; block sizes 2, 4, 8, 16; all three commit strategies;
prompts of 1, 17 and 300 tokens; the real draft and the oracle proposer with mixed
acceptance; max_tokens landing inside a block; a stop landing inside an accepted span.
"""

from __future__ import annotations

import dataclasses

import pytest

from reference_engine.runtime.commit import COMMIT_STRATEGIES
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import EngineConfig
from reference_engine.runtime.request import SamplingParams

from .checks import Pair, assert_lossless, require_block

BLOCK_SIZES = (2, 4, 8, 16)


@pytest.mark.parametrize("strategy", COMMIT_STRATEGIES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_speculative_equals_plain_greedy_over_the_grid(pair: Pair, block_size: int, strategy: str) -> None:
    require_block(pair, block_size)
    options = EngineConfig(block_size=block_size, commit_strategy=strategy)
    # max_tokens lands inside a block: not a multiple of any acceptance pattern's span
    params = SamplingParams(
        max_tokens=pair.max_tokens or 2 * block_size + block_size // 2 + 1, ignore_eos=True
    )
    mixed = [block_size - 1, 0, block_size // 2, 1]
    for prompt in pair.prompts:
        reference = generate_plain(pair.target, list(prompt), params, numerics=pair.numerics)
        assert_lossless(pair, prompt, params, options, reference=reference)
        got = assert_lossless(pair, prompt, params, options, mixed, reference=reference)
        assert sum(got.acceptance_lengths) + 1 == len(got.output_ids)


@pytest.mark.parametrize("strategy", COMMIT_STRATEGIES)
@pytest.mark.parametrize("stop_kind", ["stop_token_ids", "eos"])
def test_stop_inside_an_accepted_span_ends_where_plain_decode_ends(
    pair: Pair, strategy: str, stop_kind: str
) -> None:
    block_size = 8
    require_block(pair, block_size)
    prompt = list(pair.prompts[1])
    free = generate_plain(pair.target, prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    # a token whose first occurrence is well inside the output
    index = next(i for i in range(5, 40) if free.output_ids[i] not in free.output_ids[:i])
    stop = free.output_ids[index]
    if stop_kind == "eos":
        target = pair.target
        original = target.config
        target.config = dataclasses.replace(original, eos_token_ids=(stop,))
        params = SamplingParams(max_tokens=40)
    else:
        params = SamplingParams(max_tokens=40, stop_token_ids=(stop,), ignore_eos=True)
    try:
        reference = generate_plain(pair.target, prompt, params)
        assert reference.output_ids == free.output_ids[: index + 1]
        assert reference.finish_reason == "stop"
        got = assert_lossless(
            pair,
            prompt,
            params,
            EngineConfig(block_size=block_size, commit_strategy=strategy),
            schedule=[block_size - 1],
            reference=reference,
            continuation=free.output_ids,
        )
    finally:
        if stop_kind == "eos":
            pair.target.config = original
    # the stop really landed inside a fully accepted block: the last step was cut short
    assert got.steps[-1].accepted == block_size - 1
    assert got.acceptance_lengths[-1] < block_size


def test_first_token_stop_and_single_token_requests(pair: Pair) -> None:
    prompt = list(pair.prompts[0])
    first = generate_plain(pair.target, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    for params in (
        SamplingParams(max_tokens=1, ignore_eos=True),
        SamplingParams(max_tokens=5, stop_token_ids=(first.output_ids[0],), ignore_eos=True),
    ):
        got = assert_lossless(pair, prompt, params, EngineConfig(block_size=4))
        assert got.acceptance_lengths == []
