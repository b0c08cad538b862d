"""The sampling gate's reference distribution and its statistical tests.

Reference. `reference_probabilities` follows the documented semantics of
`runtime.sampling.probabilities`, not its code, so that a fault there cannot move both
sides: logits / T in float64, keep the top_k largest, softmax, then keep the smallest set of
most likely tokens whose mass reaches top_p (the token that crosses it included),
renormalised. `TargetReference` runs the target itself (teacher-forced, float64) for the
distribution after any prefix.

Tests. Every sampled token has a known reference distribution given what came before it:
an output token, the target's after its prefix (lossless sampling means exactly this,
whatever the draft did); a proposal, the draft's q; a rejected slot's replacement, the
residual norm(max(p - q, 0)). `rank_test` bins tokens by their rank in that distribution (0:
the most likely) and compares the observed counts with the expected ones (the sums of the
sorted distributions) by Pearson's statistic, ranks pooled so that every bin expects at
least MIN_EXPECTED. For draws from one distribution it is asymptotically chi-square with
bins - 1 degrees of freedom; for draws from different distributions (each prefix has its
own) its covariance is smaller, so the chi-square tail bounds the false-alarm rate from
above. Ranks and not token ids: the faults of this class (temperature, top-k, top-p, a wrong
slot, a wrong residual) move mass between ranks alike in every context, so pooled contexts
add up where token counts would cancel. `boundary_test` and `Rate` are two-sided z-tests of
one count (the last token of each support; accepted proposals) against its expectation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from reference_engine.models import CausalLM
from reference_engine.runtime.decode import new_state

MIN_EXPECTED = 5.0  # expected draws per pooled rank bin, and the least a z-test runs on


@dataclass(frozen=True)
class Cell:
    """One setting of the sampling grid."""

    temperature: float
    top_k: int  # 0: no top-k cut
    top_p: float  # 1.0: no nucleus cut

    def __str__(self) -> str:
        return f"T={self.temperature} top_k={self.top_k} top_p={self.top_p}"


def reference_probabilities(logits: torch.Tensor, cell: Cell) -> torch.Tensor:
    """[..., vocab] logits -> [..., vocab] float64 sampling distribution (the rule above)."""
    scaled = logits.double() / cell.temperature
    vocab = scaled.shape[-1]
    if 0 < cell.top_k < vocab:
        ranks = scaled.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        scaled = torch.where(ranks < cell.top_k, scaled, torch.full_like(scaled, float("-inf")))
    probs = torch.softmax(scaled, dim=-1)
    if cell.top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True, stable=True)
        mass_before = ordered.cumsum(dim=-1) - ordered
        kept = torch.zeros_like(probs).scatter(-1, order, (mass_before < cell.top_p).double())
        probs = probs * kept
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def reference_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) per row ([..., vocab]); p itself where p - q has no mass."""
    residual = (p.double() - q.double()).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=1e-300), p.double())


class TargetReference:
    """The target's reference distribution after any prefix, computed in batches (one
    forward over padded rows, every position kept) and cached by prefix."""

    def __init__(self, target: CausalLM, cell: Cell) -> None:
        self.target, self.cell = target, cell
        self.cache: dict[tuple[int, ...], torch.Tensor] = {}  # prefix -> [vocab]

    @torch.inference_mode()
    def after(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        """[len(prefixes), vocab]: the distribution of the token after each prefix."""
        keys = [tuple(p) for p in prefixes]
        missing = sorted({k for k in keys if k not in self.cache})
        # a run caches every prefix of its rows: run only the rows no other row extends (in
        # sorted order a row's extensions follow it)
        longest = [k for i, k in enumerate(missing) if i + 1 == len(missing) or missing[i + 1][: len(k)] != k]
        if longest:
            self._run(longest)
        return torch.stack([self.cache[k] for k in keys])

    def _run(self, rows: list[tuple[int, ...]]) -> None:
        device = self.target.model.embed_tokens.weight.device
        width = max(len(r) for r in rows)
        ids = torch.tensor([list(r) + [0] * (width - len(r)) for r in rows], device=device)
        state = new_state(self.target, width, num_slots=len(rows))
        out = self.target(
            ids,
            torch.arange(width, device=device).expand(len(rows), -1),
            torch.arange(len(rows), device=device),
            state,
            width,
            valid_len=torch.tensor([len(r) for r in rows], device=device),
        )
        probs = reference_probabilities(out.logits, self.cell)  # [rows, width, vocab]
        for i, row in enumerate(rows):
            for t in range(len(row)):
                self.cache.setdefault(row[: t + 1], probs[i, t])


@dataclass
class Draws:
    """Sampled tokens and the reference distribution each one was drawn from."""

    probs: list[torch.Tensor] = field(default_factory=list)  # [n, vocab] each
    tokens: list[torch.Tensor] = field(default_factory=list)  # [n] each
    where: list[str] = field(default_factory=list)  # one label per group, for messages

    def add(self, probs: torch.Tensor, tokens: Sequence[int] | torch.Tensor, where: str) -> None:
        self.probs.append(probs.double().cpu())
        self.tokens.append(torch.as_tensor(tokens, dtype=torch.int64).cpu())
        self.where.append(where)

    def __len__(self) -> int:
        return sum(len(t) for t in self.tokens)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs [n, vocab], tokens [n]) over every group."""
        return torch.cat(self.probs), torch.cat(self.tokens)


@dataclass
class Rate:
    """Bernoulli events, each with its own probability: a count against its expectation."""

    expected: float = 0.0
    variance: float = 0.0
    observed: int = 0

    def add(self, probability: torch.Tensor, happened: torch.Tensor) -> None:  # both [n]
        p = probability.double()
        self.expected += float(p.sum())
        self.variance += float((p * (1 - p)).sum())
        self.observed += int(happened.sum())

    @property
    def z(self) -> float:
        return (self.observed - self.expected) / max(self.variance, 1e-300) ** 0.5


def z_bound(alpha: float) -> float:
    """The two-sided normal bound for level alpha."""
    return float(torch.special.ndtri(torch.tensor(1 - alpha / 2, dtype=torch.float64)))


def assert_in_support(draws: Draws, what: str) -> None:
    """No draw outside its reference distribution's support (the top-k/top-p set)."""
    for probs, tokens, where in zip(draws.probs, draws.tokens, draws.where):
        chosen = probs.gather(1, tokens[:, None])[:, 0]  # [n]
        bad = (~(chosen > 0)).nonzero()  # NaN counts as outside
        if len(bad):
            j = int(bad[0])
            support = probs[j].nonzero()[:, 0].tolist()
            raise AssertionError(
                f"{what}: the speculative joint distribution puts mass outside the reference "
                f"support: sampled token {int(tokens[j])} at {where} (draw {j}), support "
                f"{support}"
            )


def rank_test(draws: Draws) -> tuple[float, int, float, list[tuple[str, float, int]]]:
    """Pearson's statistic of the draws' rank counts against the expected ones. Returns
    (statistic, degrees of freedom, p-value, bins as (ranks, expected, observed))."""
    probs, tokens = draws.stacked()  # [n, vocab], [n]
    ordered, order = probs.sort(dim=1, descending=True, stable=True)
    ranks = (order == tokens[:, None]).to(torch.int64).argmax(dim=1)  # [n]
    expected = ordered.sum(dim=0).tolist()
    observed = torch.bincount(ranks, minlength=probs.shape[1]).tolist()
    bins: list[tuple[int, int, float, int]] = []  # first rank, last rank, expected, observed
    first, e, o = 0, 0.0, 0
    for r in range(len(expected)):
        e, o = e + expected[r], o + observed[r]
        if e >= MIN_EXPECTED:
            bins.append((first, r, e, o))
            first, e, o = r + 1, 0.0, 0
    if bins and (e > 0 or o > 0):  # the thin tail joins the last full bin
        start, _, e0, o0 = bins.pop()
        bins.append((start, len(expected) - 1, e0 + e, o0 + o))
    statistic = sum((o - e) ** 2 / e for _, _, e, o in bins)
    df = len(bins) - 1
    shown = [(f"{a}" if a == b else f"{a}-{b}", e, o) for a, b, e, o in bins]
    if df <= 0:
        return statistic, df, 1.0, shown
    p = float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
        )
    )
    return statistic, df, p, shown


def assert_distributed_as(draws: Draws, what: str, alpha: float) -> None:
    """The draws follow their reference distributions (rank test at level alpha)."""
    statistic, df, p, bins = rank_test(draws)
    if not p >= alpha:  # NaN fails
        shown = ", ".join(f"rank {r}: {o} vs {e:.1f}" for r, e, o in bins)
        raise AssertionError(
            f"{what}: the speculative joint distribution departs from the reference: rank "
            f"chi-square {statistic:.1f} on {df} degrees of freedom, p = {p:.3g} < alpha "
            f"{alpha:.3g} over {len(draws)} draws (observed vs expected by rank: {shown})"
        )


def boundary_rate(draws: Draws) -> Rate:
    """How often the draws hit the last token of their support (the least likely one kept:
    the k-th of top-k, the token that crosses the top-p threshold)."""
    probs, tokens = draws.stacked()  # [n, vocab], [n]
    last = torch.where(probs > 0, probs, torch.full_like(probs, 2.0)).argmin(dim=1)  # [n]
    rate = Rate()
    rate.add(probs.gather(1, last[:, None])[:, 0], tokens == last)
    return rate


def assert_rate(rate: Rate, what: str, alpha: float) -> None:
    """The count matches its expectation (two-sided z-test at level alpha; skipped where
    fewer than MIN_EXPECTED events are expected)."""
    if rate.expected < MIN_EXPECTED:
        return
    if not abs(rate.z) <= z_bound(alpha):  # NaN fails
        raise AssertionError(
            f"{what}: the speculative joint distribution departs from the reference: "
            f"{rate.observed} times where {rate.expected:.1f} are expected (z = {rate.z:.1f}, "
            f"bound {z_bound(alpha):.1f} for alpha {alpha:.3g})"
        )
