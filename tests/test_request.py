"""Request checks: SamplingParams validation and prompt validation against vocab and context."""

from __future__ import annotations

from typing import Any

import pytest

from reference_engine.errors import RequestError
from reference_engine.runtime.request import SamplingParams, validate_prompt


def test_default_sampling_params_are_greedy() -> None:
    params = SamplingParams()
    assert params.greedy
    assert params.max_tokens == 16 and params.stop_token_ids == () and not params.ignore_eos
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"max_tokens": 0}, r"max_tokens must be positive, got 0"),
        ({"max_tokens": -3}, r"max_tokens must be positive, got -3"),
        ({"max_tokens": 2.0}, r"max_tokens must be an integer, got 2.0"),
        ({"max_tokens": True}, r"max_tokens must be an integer, got True"),
        ({"temperature": -0.1}, r"temperature must be >= 0, got -0.1"),
        ({"temperature": float("nan")}, r"temperature must be >= 0, got nan"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.01}, r"top_p must be in \(0, 1\], got 1.01"),
        ({"top_k": -1}, r"top_k must be >= 0 \(0 disables it\), got -1"),
    ],
)
def test_sampling_params_out_of_range_are_rejected_with_the_value(
    kwargs: dict[str, Any], pattern: str
) -> None:
    with pytest.raises(RequestError, match=pattern):
        SamplingParams(**kwargs)


def test_valid_prompt_passes() -> None:
    validate_prompt([0, 5, 511], vocab_size=512, context_len=8, max_tokens=5)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "pattern"),
    [
        ([], 1, r"the prompt is empty"),
        ([1, 512, 3], 1, r"prompt token id\(s\) \[512\] outside the vocabulary \[0, 512\)"),
        ([-1, 2], 1, r"prompt token id\(s\) \[-1\] outside the vocabulary"),
        ([1, 2.0], 1, r"prompt token id\(s\) \[2.0\] outside the vocabulary"),
        ([1] * 8, 1, r"the prompt has 8 tokens but the context holds 8"),
        ([1] * 9, 1, r"the prompt has 9 tokens but the context holds 8"),
        ([1] * 4, 5, r"prompt \(4 tokens\) \+ max_tokens \(5\) = 9 exceeds the context of 8"),
    ],
    ids=[
        "empty",
        "id-equal-vocab",
        "negative-id",
        "float-id",
        "fills-context",
        "past-context",
        "output-past-context",
    ],
)
def test_invalid_prompt_is_rejected_with_what_was_wrong(
    prompt: list[Any], max_tokens: int, pattern: str
) -> None:
    with pytest.raises(RequestError, match=pattern):
        validate_prompt(prompt, vocab_size=512, context_len=8, max_tokens=max_tokens)
