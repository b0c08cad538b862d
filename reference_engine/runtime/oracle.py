"""The oracle proposer: scheduled acceptance for tests and benchmarks, in place of the draft's
proposals, behind the `Proposer` protocol the speculative step reads (speculative_step.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..errors import ConfigError


class Proposer(Protocol):
    """What the speculative step asks of a request's oracle."""

    forced: bool  # take the scheduled count as accepted (benchmarks on random weights)

    def scheduled(self, step: int, n: int) -> int:
        """Draft tokens step `step` should accept when it drafts n."""
        ...

    def propose(self, step: int, generated: int, n: int) -> list[int]:
        """The proposals for block slots 1..n when `generated` tokens are out."""
        ...


class OracleProposer:
    """Replaces the draft's proposals so that each step accepts a scheduled count.

    The draft model still runs (its cost is real); only its tokens are swapped. Built from
    the target's plain greedy continuation computed beforehand: step i proposes the true
    next tokens for its first `schedule[i % len(schedule)]` slots and a wrong token in the
    next slot, so that a lossless engine accepts exactly that many ("corrupt position j"
    is the entry j - 1). Greedy only.

    `forced=True` is for benchmarks on random bfloat16 weights, where a continuation
    computed by plain decode does not survive the verify kernels' different rounding (one
    flipped near-tie and every later proposal is wrong): the engine then takes the
    scheduled count as accepted instead of comparing. Every step does the same work as a
    real one (draft, verify, acceptance, commit of a + 1 tokens), so costs are right, but
    the output is not checked against plain decode. The gates never force.
    """

    def __init__(
        self, continuation: Sequence[int], schedule: Sequence[int], vocab_size: int, forced: bool = False
    ):
        if not schedule or any(k < 0 for k in schedule):
            raise ConfigError(f"oracle schedule must be non-empty counts >= 0, got {schedule}")
        self.continuation = list(continuation)
        self.schedule = list(schedule)
        self.vocab_size = vocab_size
        self.forced = forced

    def scheduled(self, step: int, n: int) -> int:
        """Draft tokens step `step` should accept when it drafts n."""
        return min(self.schedule[step % len(self.schedule)], n)

    @classmethod
    def for_mean_acceptance(
        cls,
        continuation: Sequence[int],
        mean_length: float,
        block_size: int,
        vocab_size: int,
        forced: bool = False,
    ) -> OracleProposer:
        """A schedule whose mean acceptance length (bonus included) is `mean_length`: the
        accepted counts floor(m) and floor(m) + 1 interleaved evenly, m = mean_length - 1."""
        if not 1.0 <= mean_length <= block_size:
            raise ConfigError(
                f"oracle acceptance length must be in [1, {block_size}] for block size "
                f"{block_size}, got {mean_length}"
            )
        m = mean_length - 1
        low, frac = int(m), m - int(m)
        period = 20
        schedule = [low + int((k + 1) * frac + 1e-9) - int(k * frac + 1e-9) for k in range(period)]
        return cls(continuation, schedule, vocab_size, forced)

    def propose(self, step: int, generated: int, n: int) -> list[int]:
        """Draft tokens for block slots 1..n when `generated` tokens are out (the anchor is
        continuation[generated - 1])."""
        truth = self.continuation[generated : generated + n]
        last = truth[-1] if truth else (self.continuation[-1] if self.continuation else 0)
        filler = last + 1
        truth += [filler % self.vocab_size] * (n - len(truth))
        k = self.scheduled(step, n)
        if k < n:
            truth[k] = (truth[k] + 1) % self.vocab_size  # wrong for sure
        return truth
