"""OpenAI presence/frequency penalties and logit bias on one row (runtime/penalties.py)."""

from __future__ import annotations

import pytest
import torch

from reference_engine.errors import RequestError
from reference_engine.runtime.penalties import apply_penalties
from reference_engine.runtime.request import SamplingParams


def test_penalties_count_generated_tokens_and_bias_adds() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((0, 10.0), (3, -1.0)))
    out = apply_penalties(logits, [2, 2, 3], params)
    # token 2: twice -> 3 - 0.5 - 0.5; token 3: once -> 4 - 0.5 - 0.25 - 1; token 0: + 10
    assert out.tolist() == [11.0, 2.0, 2.0, 2.25]
    assert logits.tolist() == [1.0, 2.0, 3.0, 4.0]  # the input is left alone


def test_nothing_to_apply_returns_the_same_row() -> None:
    logits = torch.zeros(4)
    assert apply_penalties(logits, [1, 2], SamplingParams()) is logits
    assert apply_penalties(logits, [], SamplingParams(presence_penalty=1.0)) is logits


@pytest.mark.parametrize(
    "kwargs",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3.0},
        {"logit_bias": ((1, 101.0),)},
        {"logit_bias": ((-1, 1.0),)},
    ],
)
def test_out_of_range_values_are_refused(kwargs: dict) -> None:
    with pytest.raises(RequestError):
        SamplingParams(**kwargs)
