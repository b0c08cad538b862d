"""The pure speculative core of sampling.py: greedy acceptance, the sampling distribution
(temperature, top-k, top-p) and lossless speculative sampling (accept_sampled)."""

from __future__ import annotations

import pytest
import torch

from reference_engine.runtime.sampling import accept_greedy, accept_sampled, probabilities


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- accept_greedy
def test_accept_greedy_accepts_the_longest_matching_prefix_and_takes_the_next_target_token() -> None:
    draft = torch.tensor([[5, 6, 9, 8]])  # [1, n=4]; slot 2 mismatches, slot 3 matches again
    target = torch.tensor([[5, 6, 7, 8, 2]])  # [1, n + 1]
    accepted, bonus = accept_greedy(draft, target)
    assert accepted.tolist() == [2]
    assert bonus.tolist() == [7]


def test_accept_greedy_all_accepted_gives_n_and_the_last_target_token_as_bonus() -> None:
    draft = torch.tensor([[3, 1, 4, 1, 5]])
    target = torch.tensor([[3, 1, 4, 1, 5, 9]])
    accepted, bonus = accept_greedy(draft, target)
    assert accepted.tolist() == [5]
    assert bonus.tolist() == [9]


def test_accept_greedy_first_mismatch_accepts_none_and_the_bonus_is_the_first_target_token() -> None:
    draft = torch.tensor([[4, 1, 4]])
    target = torch.tensor([[3, 1, 4, 1]])
    accepted, bonus = accept_greedy(draft, target)
    assert accepted.tolist() == [0]
    assert bonus.tolist() == [3]


def test_accept_greedy_counts_each_row_of_a_batch_on_its_own() -> None:
    target = torch.tensor(
        [
            [10, 11, 12, 13],
            [20, 21, 22, 23],
            [30, 31, 32, 33],
            [40, 41, 42, 43],
        ]
    )  # [4, n + 1 = 4]
    draft = torch.tensor(
        [
            [10, 11, 12],  # all 3
            [20, 0, 22],  # 1
            [0, 31, 32],  # 0
            [40, 41, 0],  # 2
        ]
    )
    accepted, bonus = accept_greedy(draft, target)
    assert accepted.tolist() == [3, 1, 0, 2]
    assert bonus.tolist() == [13, 21, 30, 42]
    assert accepted.dtype == torch.int64


# ----------------------------------------------------------------------------- probabilities
def test_probabilities_divide_the_logits_by_the_temperature() -> None:
    logits = torch.randn(3, 50, generator=gen(), dtype=torch.float64)
    for temperature in (0.25, 1.0, 3.0):
        expected = torch.softmax(logits / temperature, dim=-1)
        torch.testing.assert_close(probabilities(logits, temperature), expected, rtol=0, atol=1e-15)


def test_lower_temperature_sharpens_the_distribution() -> None:
    logits = torch.randn(50, generator=gen(), dtype=torch.float64)
    top = int(logits.argmax())
    peaks = [float(probabilities(logits, t)[top]) for t in (2.0, 1.0, 0.5, 0.1)]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]


@pytest.mark.parametrize("k", [1, 2, 7, 49])
def test_top_k_keeps_exactly_the_k_most_likely_tokens(k: int) -> None:
    logits = torch.randn(4, 50, generator=gen(k), dtype=torch.float64)  # no ties
    probs = probabilities(logits, 1.0, top_k=k)
    assert ((probs > 0).sum(dim=-1) == k).all()
    kept = probs > 0
    top = logits.topk(k, dim=-1).indices
    assert kept.gather(-1, top).all()
    # inside the kept set the ratios are those of the full softmax
    full = torch.softmax(logits, dim=-1)
    renorm = torch.where(kept, full, 0.0) / torch.where(kept, full, 0.0).sum(-1, keepdim=True)
    torch.testing.assert_close(probs, renorm, rtol=0, atol=1e-15)


def test_top_k_zero_or_at_least_the_vocabulary_cuts_nothing() -> None:
    logits = torch.randn(2, 20, generator=gen(), dtype=torch.float64)
    full = torch.softmax(logits, dim=-1)
    for k in (0, 20, 25):
        torch.testing.assert_close(probabilities(logits, 1.0, top_k=k), full, rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.45, [0]),  # the first token alone reaches 0.45
        (0.6, [0, 1]),  # 0.5 < 0.6: the crossing token 1 is kept
        (0.85, [0, 1, 2]),
        (0.97, [0, 1, 2, 3]),
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_the_smallest_prefix_whose_mass_reaches_top_p(top_p: float, kept: list[int]) -> None:
    base = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    order = torch.tensor([2, 0, 3, 1])  # tokens shuffled: token order[j] has base[j]
    logits = torch.empty(4, dtype=torch.float64)
    logits[order] = base.log()
    probs = probabilities(logits, 1.0, top_p=top_p)
    kept_tokens = sorted(order[kept].tolist())
    assert sorted(torch.nonzero(probs).flatten().tolist()) == kept_tokens
    expected = torch.zeros(4, dtype=torch.float64)
    expected[order[kept]] = base[kept] / base[kept].sum()
    torch.testing.assert_close(probs, expected, rtol=0, atol=1e-12)


def test_top_k_applies_before_top_p() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64).log()
    # after top_k=2 the two survivors hold 0.625 and 0.375: top_p 0.6 keeps only the first
    probs = probabilities(logits, 1.0, top_k=2, top_p=0.6)
    assert torch.nonzero(probs).flatten().tolist() == [0]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8), (0.5, 20, 0.9)]
)
def test_probability_rows_sum_to_one(temperature: float, top_k: int, top_p: float) -> None:
    logits = 4 * torch.randn(2, 3, 100, generator=gen())
    probs = probabilities(logits, temperature, top_k, top_p)
    assert probs.shape == logits.shape
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float64, torch.float64),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
    ],
)
def test_probabilities_are_float32_or_wider(dtype: torch.dtype, expected: torch.dtype) -> None:
    logits = torch.randn(10, generator=gen()).to(dtype)
    assert probabilities(logits, 0.9, top_k=5, top_p=0.9).dtype == expected


# ----------------------------------------------------------------------------- accept_sampled
def random_distributions(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.softmax(2 * torch.randn(*shape, generator=gen(seed), dtype=torch.float64), -1)


def test_draft_equal_to_target_is_always_accepted() -> None:
    batch, n, vocab = 4000, 5, 12
    p = random_distributions((batch, n + 1, vocab), 0)
    q = p[:, :n].clone()
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen(1)).reshape(batch, n)
    accepted, bonus = accept_sampled(draft, q, p, gen(2))
    assert (accepted == n).all()  # u * q < p  <=>  u < 1
    assert bonus.shape == (batch,)


def test_bonus_after_a_fully_accepted_block_is_drawn_from_the_last_target_distribution() -> None:
    batch, n, vocab = 2000, 3, 10
    p = random_distributions((batch, n + 1, vocab), 3)
    p[:, n] = 0.0
    p[:, n, 7] = 1.0  # the bonus distribution is a point mass on token 7
    q = p[:, :n].clone()
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen(4)).reshape(batch, n)
    accepted, bonus = accept_sampled(draft, q, p, gen(5))
    assert (accepted == n).all()
    assert (bonus == 7).all()


def test_disjoint_supports_accept_nothing_and_the_bonus_comes_from_the_target_support() -> None:
    batch, n, vocab = 2000, 4, 16
    q = torch.zeros(batch, n, vocab, dtype=torch.float64)
    q[..., :8] = random_distributions((batch, n, 8), 6)  # draft: tokens 0..7 only
    p = torch.zeros(batch, n + 1, vocab, dtype=torch.float64)
    p[..., 8:] = random_distributions((batch, n + 1, 8), 7)  # target: tokens 8..15 only
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen(8)).reshape(batch, n)
    accepted, bonus = accept_sampled(draft, q, p, gen(9))
    assert (accepted == 0).all()
    assert (bonus >= 8).all()


def test_the_first_committed_token_is_distributed_as_the_target() -> None:
    """The lossless property for one slot: accepted draft or residual replacement, the
    token is distributed as p, however far q is from p."""
    batch, vocab = 200_000, 5
    p_row = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05], dtype=torch.float64)
    q_row = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4], dtype=torch.float64)
    p = p_row.expand(batch, 2, vocab)
    q = q_row.expand(batch, 1, vocab)
    draft = torch.multinomial(q_row, batch, replacement=True, generator=gen(10))[:, None]
    accepted, bonus = accept_sampled(draft, q, p, gen(11))
    first = torch.where(accepted > 0, draft[:, 0], bonus)
    freq = torch.bincount(first, minlength=vocab).double() / batch
    # 5 standard errors of a frequency near 0.5 at this batch is ~0.006
    torch.testing.assert_close(freq, p_row, rtol=0, atol=0.006)
    # acceptance rate is sum(min(p, q)) = 0.05 + 0.1 + 0.15 + 0.1 + 0.05
    assert abs(float(accepted.double().mean()) - 0.45) < 0.006


def test_accept_sampled_is_reproducible_with_a_seeded_generator() -> None:
    batch, n, vocab = 64, 6, 20
    p = random_distributions((batch, n + 1, vocab), 12)
    q = random_distributions((batch, n, vocab), 13)
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen(14)).reshape(batch, n)
    first = accept_sampled(draft, q, p, gen(15))
    second = accept_sampled(draft, q, p, gen(15))
    other = accept_sampled(draft, q, p, gen(16))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert not (torch.equal(first[0], other[0]) and torch.equal(first[1], other[1]))


def test_a_draft_token_neither_distribution_gives_any_mass_is_never_accepted() -> None:
    """A proposal outside both supports (p(x) = q(x) = 0: a greedy draft's token that the
    request's top-k or top-p cut from both) is rejected whatever the uniform draw, and the
    replacement comes from the target's support."""
    batch, n, vocab = 500, 3, 8
    p = torch.zeros(batch, n + 1, vocab, dtype=torch.float64)
    p[..., :4] = 0.25  # the target: tokens 0..3
    q = torch.zeros(batch, n, vocab, dtype=torch.float64)
    q[..., 4:7] = 1 / 3  # the draft: tokens 4..6
    draft = torch.full((batch, n), 7)  # in neither support
    accepted, bonus = accept_sampled(draft, q, p, gen(21))
    assert (accepted == 0).all()
    assert (bonus < 4).all()
