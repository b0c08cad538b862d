"""Gate: after each speculative commit the target state (KV rows up to the committed
length, conv state, recurrent state) equals what plain decode reaches at that length, and
the three commit strategies agree with each other.

Tolerance: verify runs B tokens per forward and plain decode one, so float64 results may
differ in the last bits (different matmul shapes); 1e-9 absolute is far below any real
fault (a skipped rollback moves the state by O(0.1)); float32 (a user's checkpoints) gets
1e-3, and bfloat16 state is not compared. per_token and recompute run the very same
recurrence, so they must agree bit for bit. per_token's checkpoints every few tokens (8 on
the GPU) are run here on the references at 2 and 3 tokens of a block of 8: each commit then
runs a row on from a checkpoint, and the state must still be plain decode's.
"""

from __future__ import annotations

import pytest

from reference_engine.runtime.commit import COMMIT_STRATEGIES
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import EngineConfig
from reference_engine.runtime.request import SamplingParams

from .checks import (
    Pair,
    assert_states_close,
    plain_states,
    require_block,
    speculative_states,
    state_tolerance,
)

BLOCK_SIZE = 8
SCHEDULE = [7, 0, 3, 1, 5, 2]


@pytest.fixture(scope="module")
def reference(pair: Pair):
    require_block(pair, BLOCK_SIZE)
    prompt = pair.prompts[1]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = generate_plain(pair.target, list(prompt), params)
    # a verify may process a few positions past the last output token before the cut
    longer = SamplingParams(max_tokens=params.max_tokens + BLOCK_SIZE, ignore_eos=True)
    beyond = generate_plain(pair.target, list(prompt), longer).output_ids
    return prompt, params, ref, plain_states(pair.target, prompt, beyond)


@pytest.mark.parametrize("strategy", COMMIT_STRATEGIES)
@pytest.mark.parametrize("proposer", ["draft", "oracle"])
def test_state_after_each_commit_equals_plain_decode(
    pair: Pair, reference, strategy: str, proposer: str
) -> None:
    prompt, params, ref, expected = reference
    atol = state_tolerance(pair)
    schedule = SCHEDULE if proposer == "oracle" else None
    got = speculative_states(
        pair, prompt, params, EngineConfig(block_size=BLOCK_SIZE, commit_strategy=strategy), schedule, ref
    )
    compared = assert_states_close(expected, got, atol, f"{pair.name}/{strategy}")
    assert compared >= 4


def test_commit_strategies_agree_with_each_other(pair: Pair, reference) -> None:
    prompt, params, ref, _ = reference
    atol = state_tolerance(pair)
    by_strategy = {
        s: speculative_states(
            pair, prompt, params, EngineConfig(block_size=BLOCK_SIZE, commit_strategy=s), SCHEDULE, ref
        )
        for s in COMMIT_STRATEGIES
    }
    assert_states_close(by_strategy["per_token"], by_strategy["recompute"], 0.0, "per_token vs recompute")
    assert_states_close(by_strategy["per_token"], by_strategy["replay"], atol, "per_token vs replay")


@pytest.mark.parametrize("every", [2, 3])
def test_per_token_checkpoints_every_few_tokens_reach_the_state_of_plain_decode(
    pair: Pair, reference, every: int
) -> None:
    prompt, params, ref, expected = reference
    atol = state_tolerance(pair)
    config = EngineConfig(block_size=BLOCK_SIZE, commit_strategy="per_token", checkpoint_every=every)
    got = speculative_states(pair, prompt, params, config, SCHEDULE, ref)
    compared = assert_states_close(expected, got, atol, f"{pair.name}/per_token every {every}")
    assert compared >= 4
