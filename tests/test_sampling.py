"""Greedy token choice: argmax with the lowest token id winning an exact tie."""

from __future__ import annotations

import pytest
import torch

from reference_engine.runtime.sampling import greedy

INF = float("inf")


@pytest.mark.parametrize(
    ("logits", "expected"),
    [
        ([1.0, 3.0, 0.0, 3.0], 1),
        ([3.0, 3.0, 3.0, 3.0], 0),
        ([0.0, -1.0, 2.5, 2.5, 2.5], 2),
        ([-5.0, -2.0, -2.0], 1),
        ([0.0, 1.0, 2.0, 7.0], 3),
    ],
)
def test_greedy_picks_the_lowest_id_among_exact_ties(logits: list[float], expected: int) -> None:
    assert int(greedy(torch.tensor(logits))) == expected


@pytest.mark.parametrize(
    "logits",
    [[-INF, -INF, -INF], [-INF, INF, 0.0, INF], [1.0, float("nan"), 2.0]],
    ids=["-inf", "inf", "nan"],
)
def test_greedy_gives_no_token_for_a_row_whose_maximum_is_not_finite(logits: list[float]) -> None:
    """A row of -inf throughout, one whose maximum is +inf (tied or not) and one holding a NaN
    are no distribution: greedy gives `vocab`, which the engine fails the request on."""
    assert int(greedy(torch.tensor(logits))) == len(logits)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_greedy_tie_rule_holds_in_every_float_dtype(dtype: torch.dtype) -> None:
    # 1.0 and 1.0 + 2**-12 differ in float32 but round to the same bf16 / fp16 value
    logits = torch.tensor([0.5, 1.0, 1.0 + 2**-12, 0.25], dtype=torch.float64).to(dtype)
    half = dtype in (torch.bfloat16, torch.float16)
    assert (logits[1] == logits[2]) == half
    assert int(greedy(logits)) == (1 if half else 2)


def test_greedy_applies_the_tie_rule_per_row_of_a_batch() -> None:
    logits = torch.tensor(
        [
            [[2.0, 0.0, 2.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 4.0, 4.0, 4.0]],
            [[0.0, 1.0, 0.0, 1.0], [9.0, 8.0, 9.0, 9.0], [-1.0, -3.0, -2.0, -1.0]],
        ]
    )  # [batch 2, T 3, vocab 4]
    choice = greedy(logits)
    assert choice.shape == (2, 3)
    assert choice.dtype == torch.int64
    assert choice.tolist() == [[0, 0, 1], [1, 0, 0]]


def test_greedy_equals_argmax_without_ties() -> None:
    logits = torch.randn(8, 5, 1000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(greedy(logits), logits.argmax(dim=-1))


def test_greedy_ties_placed_at_random_ids_resolve_to_the_lowest() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 300, generator=gen)
    tied = torch.stack([torch.randperm(300, generator=gen)[:3] for _ in range(64)])  # [64, 3]
    logits.scatter_(1, tied, 10.0)
    assert torch.equal(greedy(logits), tied.min(dim=1).values)


def test_top_p_keeps_the_smallest_set_whose_mass_reaches_it_exactly() -> None:
    """Four equally likely tokens (0.25 each, exact): top_p 0.5 is reached by two of them, so
    two are kept, not the third whose mass before it is exactly 0.5."""
    from reference_engine.runtime.sampling import probabilities

    probs = probabilities(torch.zeros(4, dtype=torch.float64), 1.0, top_p=0.5)
    assert sorted(probs.tolist()) == [0.0, 0.0, 0.5, 0.5]
    probs = probabilities(torch.zeros(4, dtype=torch.float64), 1.0, top_p=0.75)
    assert sorted(probs.tolist()) == pytest.approx([0.0, 1 / 3, 1 / 3, 1 / 3])


def test_seed_zero_is_a_seed() -> None:
    """seed 0 is as reproducible as any other seed (not "no seed")."""
    from reference_engine.runtime.request import new_generator

    draws = [torch.rand(4, generator=new_generator(torch.device("cpu"), 0)) for _ in range(2)]
    assert torch.equal(*draws)
    assert not torch.equal(draws[0], torch.rand(4, generator=new_generator(torch.device("cpu"), 1)))


def test_a_row_with_a_negative_entry_draws_not_a_distribution_and_the_others_draw() -> None:
    """`sample` fails only the rows that hold no distribution (a negative entry here, as NaN,
    inf or no mass elsewhere): the batch's other rows still draw, from their own support."""
    from reference_engine.runtime.sampling import NOT_A_DISTRIBUTION, sample

    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, -0.25, 0.5, 0.25], [0.0, 1.0, 0.0, 0.0]])
    drawn = sample(probs, torch.Generator().manual_seed(0))
    assert drawn.tolist() == [2, NOT_A_DISTRIBUTION, 1]
