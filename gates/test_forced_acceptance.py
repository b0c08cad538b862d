"""Gate: with the oracle proposer forcing each acceptance length, output stays
byte-identical and the recorded acceptance lengths equal the schedule."""

from __future__ import annotations

import random

import pytest

from reference_engine.runtime.commit import COMMIT_STRATEGIES
from reference_engine.runtime.engine import EngineConfig

from .checks import Pair, assert_forced_acceptance, require_block


@pytest.mark.parametrize("strategy", COMMIT_STRATEGIES)
@pytest.mark.parametrize("block_size", (4, 8, 16))
def test_every_acceptance_length_occurs_and_matches_the_schedule(
    pair: Pair, block_size: int, strategy: str
) -> None:
    require_block(pair, block_size)
    schedule = list(range(block_size))  # accepted draft tokens 0 .. B-1
    random.Random(block_size).shuffle(schedule)
    got = assert_forced_acceptance(
        pair, pair.prompts[1], EngineConfig(block_size=block_size, commit_strategy=strategy), schedule
    )
    assert sorted(step.accepted for step in got.steps) == list(range(block_size))
    assert all(step.proposed == block_size - 1 for step in got.steps[:-1])
