"""Gate: DFlash speculative decoding is byte-identical to plain greedy decode.

Grid: dense and hybrid targets; block sizes 2, 4, 8, 16; all three commit strategies;
prompts of 1, 17 and 300 tokens; the real draft and the oracle proposer with mixed
acceptance; max_tokens landing inside a block; a stop landing inside an accepted span.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import replace

import pytest

from reference_engine.runtime.commit import COMMIT_STRATEGIES
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.request import SamplingParams

from .checks import Pair, assert_lossless, require_block
from .faults import planted

# the faults this module's tests plant and see caught
CATCHES = ("stop_on_the_last_token_is_length",)

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


def first_occurrence_at(pair: Pair, indices: Sequence[int], length: int) -> tuple[list[int], list[int], int]:
    """A prompt of the pair, its free-running greedy output of `length` tokens, and the first
    of `indices` whose token appears there for the first time (so a stop on that token ends
    the output right there)."""
    for prompt in pair.prompts:
        free = generate_plain(pair.target, list(prompt), SamplingParams(max_tokens=length, ignore_eos=True))
        for i in indices:
            if free.output_ids[i] not in free.output_ids[:i]:
                return list(prompt), free.output_ids, i
    raise AssertionError(f"{pair.name}: no prompt's output has a new token at any of {list(indices)}")


@pytest.mark.parametrize("where", ["prefill", "accepted", "bonus"])
@pytest.mark.parametrize("stop_kind", ["stop_token_ids", "eos"])
def test_a_stop_on_the_last_token_max_tokens_allows_finishes_as_a_stop(
    pair: Pair, stop_kind: str, where: str
) -> None:
    """A stop token that is also the max_tokens-th token ends the request with "stop", as
    plain decode does, however the token came: the prefill's first token, a draft token
    accepted inside a block, or a block's bonus token; for one request, and in a batch,
    speculative and plain. (Both servers of the HTTP gate share the engine's request
    bookkeeping, so only a comparison with plain decode sees a wrong finish reason.)"""
    check_stop_on_the_last_token(pair, stop_kind, where)


@pytest.mark.parametrize("stop_kind", ["stop_token_ids", "eos"])
def test_the_last_token_stop_gate_catches_a_budget_checked_before_the_stop(
    pair: Pair, stop_kind: str
) -> None:
    with planted("stop_on_the_last_token_is_length"), pytest.raises(AssertionError, match="finish"):
        check_stop_on_the_last_token(pair, stop_kind, "accepted")


def check_stop_on_the_last_token(pair: Pair, stop_kind: str, where: str) -> None:
    """test_a_stop_on_the_last_token_max_tokens_allows_finishes_as_a_stop's checks."""
    block_size = 8
    require_block(pair, block_size)
    indices = {"prefill": [0], "accepted": range(1, block_size - 1), "bonus": [block_size, 2 * block_size]}
    prompt, free, index = first_occurrence_at(pair, indices[where], 2 * block_size + 1)
    stop = free[index]
    original = pair.target.config
    if stop_kind == "eos":
        pair.target.config = dataclasses.replace(original, eos_token_ids=(stop,))
        params = SamplingParams(max_tokens=index + 1)
    else:
        params = SamplingParams(max_tokens=index + 1, stop_token_ids=(stop,), ignore_eos=True)
    try:
        reference = generate_plain(pair.target, prompt, params, numerics=pair.numerics)
        assert (reference.output_ids, reference.finish_reason) == (free[: index + 1], "stop")
        options = EngineConfig(block_size=block_size)
        assert_lossless(pair, prompt, params, options, [block_size - 1], reference, free)
        # in a batch, beside requests that run on, speculative (full blocks accepted) and plain
        for draft in (pair.draft, None):
            engine = Engine(pair.target, draft, replace(options, max_num_seqs=3, numerics=pair.numerics))
            oracle = OracleProposer(free, [block_size - 1], pair.target.config.vocab_size) if draft else None
            engine.add_request("stop", prompt, params, oracle=oracle)
            for i, other in enumerate(pair.prompts[:2]):
                engine.add_request(
                    f"other{i}", list(other), SamplingParams(max_tokens=3 * block_size, ignore_eos=True)
                )
            finished = {}
            while engine.has_unfinished():
                finished.update((o.request_id, o.finish_reason) for o in engine.step() if o.finished)
            got = engine.collect("stop")
            what = "speculative" if draft else "plain"
            assert got.output_ids == reference.output_ids, f"{what} engine: {got.output_ids}"
            assert finished["stop"] == got.finish_reason == "stop", (
                f"{what} engine: finish reason {finished['stop']!r} where plain decode stops"
            )
    finally:
        pair.target.config = original
