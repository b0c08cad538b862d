"""The verify width: how many of its draft tokens each request's block verifies in a step.

The draft's layers always run the full block (B-1 mask tokens: its block attention is
bidirectional, so a narrower block would change the proposals, and the acceptance measured on
them); its LM head runs for draft slots 1..W alone (a slot's logits read its own hidden
state), and the verify runs the anchor and those W proposals of every row. Verifying fewer
never changes output: a step commits the longest accepted prefix of what it verified plus
the target's own token after it, so a narrower verify commits fewer tokens per step, each
the token plain greedy decode gives. What it changes is cost: a verify of rows x (W + 1) tokens is bound by
arithmetic once the batch is wide (64 x 16 rows on the 8B shape), where its committed tokens
grow slower than its cost.

Policy `fixed` verifies every proposal (W = B-1). Policy `auto` picks, per step, the W of
the candidates that maximises expected committed tokens per second. With CUDA graphs the
candidates are every W from 1 to B-1 for an engine of at most EVERY_WIDTH_ROWS rows: each
is captured and its step replayed and timed at start-up, and a verify's cost grows with
every token it checks where the verify is bound by what its tokens read (a mixture of
experts reads each token's experts: on Qwen3.5-35B-A3B a verify of one row costs about
0.4 ms more per token) or by arithmetic (a wide batch), so a W one short of the next power
of two is worth having. Past EVERY_WIDTH_ROWS rows the graphs cover blocks of 2, 3, 4, 6,
8, 12, 16, ... tokens and B (`width_spacing` "halves": each block at most 1.5x the one
before: the Qwen3-8B shape at 64 rows took 19.9 ms a step for blocks of 6 tokens against
23.1 for blocks of 8, which commit the same where 5 or 6 proposals are accepted). Without
graphs (the costs then come from timing eager steps at start-up, slow on a CPU) the set is
smaller: 0, 1, 3, 7, ... and B-1 (a plain step, then blocks of 2, 4, 8, ... and B tokens).
The choice:

    sum over rows i of E_i(min(W, n_i)) / seconds(rows, W),   E_i(w) = 1 + sum_{k<=w} r_i[k]

where n_i is how many draft tokens row i can still commit (one less than the tokens it has
left: the step's last token is the target's own) and r_i[k] the probability that its draft tokens
1..k are all accepted. The forward is padded to its widest row, so one W for the step is best
for every row: a row verified narrower than its neighbours would save nothing. r_i[k] is the
product of conditional acceptance rates c_j (draft token j accepted, given 1..j-1 were and j
was verified), each the request's own count (its recent steps weighing more:
stats.RecentAcceptance) shrunk toward the engine's rate over all requests, and the engine's
toward its rate at j-1 (starting from 1: an engine with no history
verifies the full block, and a position no step has verified yet borrows the rate of the one
before it). Ties go to the wider W. The choice is a function of the counts, the costs and
the runs of plain and of narrow steps before it (VerifyWidth), so deterministic: the same requests with the
same history choose the same widths (`Engine.reset_stats` starts the run afresh too).

W = 0 (on the CPU; on CUDA its graphs are not captured yet, and the widths start at 1) is a
plain step for the speculative rows: no draft forward, the verify of the anchor
alone, whose token is the one plain decode gives; it keeps the anchor's context features
for the draft, appended in one batch before the request's next draft forward (dropped if it
ends first; speculative_step.DeferredContext), so a later step can draft again. It is chosen where a
speculative step costs more than the tokens it is expected to commit (a batch so wide that
the verify is bound by arithmetic, or a CPU). It costs a little more than a plain decode step
(the verify keeps the features, and the step's host work is a speculative step's;
docs/engine.md, "Verify width"). A plain step verifies nothing, so it moves no
acceptance count; a run of them is broken by a drafted step now and then, which measures
acceptance again (VerifyWidth). A step at W verifies no position past W either, so a run of
steps narrower than the rows could use is broken by a wider probe now and then, on the same
budget: a position whose first blocks rejected it is measured again, and wins its width if
it pays (VerifyWidth._past_narrow).

`seconds(rows, W)` is a step's measured time (draft + verify + commit, replayed from the CUDA
graphs at start-up, graphs.py; verify + commit for W = 0) for the smallest measured row count >=
rows (a graph runs its bucket's rows); timed eager steps run their own rows, so their costs are
interpolated between the measured counts (StepCosts.unpadded). The timed forwards read
`timing_ids`, a different token at every position: a mixture of experts routes each token to its
own k experts, so a verify of rows x (W + 1) tokens of text reads many more experts than a
decode step, and a block of one repeated token would be timed as if it read the k experts of one
token (a 16-token verify of Qwen3.5-35B-A3B reads about 100 of its 256 experts a layer, a decode
step 8). Without graphs (the CPU, an eager engine) the table is flat, every width costs the same
and `auto` verifies the full block as `fixed` does, unless the engine is told to time whole
eager steps at start-up, host work and commit included (`measure_step_costs`,
SpeculativeStep.seconds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import torch

from ..errors import ConfigError
from .stats import RecentAcceptance, SpecCounters

VERIFY_WIDTHS = ("auto", "fixed")
REQUEST_WEIGHT = 1.0  # pseudo-steps of the engine's rate in a request's estimate
ENGINE_WEIGHT = 4.0  # pseudo-steps of the previous position's rate in the engine's
PROBE_AFTER = 4  # the fewest plain steps in a row before a speculative step measures acceptance again
PROBE_SHARE = 0.02  # of the plain run's time, what a probe's expected loss may take
PROBE_LIMIT = 256  # the longest run of plain steps between two such probes
# the most rows (max_num_seqs) for which CUDA graphs are captured at every width: past it a
# bucket's 15 verify graphs (and their commits) cost start-up time for little (Qwen3-8B at 64
# rows captured in 16.5 s against 7.3 s for 1, 3, 7, 15), so the widths are spaced by halves
EVERY_WIDTH_ROWS = 16
SPACINGS = ("every", "halves", "doublings")


TIMING_STRIDE = 2_654_435_761  # a prime (Knuth's multiplicative hash): consecutive ids land far apart


def timing_ids(rows: int, width: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[rows, width] token ids for timing a step before any request runs: position i of the
    flattened block takes (i * TIMING_STRIDE + 1) mod vocab. The table is fixed (the same at
    every start-up) and spread over the vocabulary; the stride is a prime larger than any
    vocabulary, so the ids of a block of up to `vocab` tokens are all different."""
    index = torch.arange(rows * width, dtype=torch.int64, device=device)
    return ((index * TIMING_STRIDE + 1) % vocab).view(rows, width)


def width_spacing(cuda_graphs: bool, max_rows: int) -> str:
    """How densely an engine of `max_rows` rows spaces its candidate widths: with CUDA graphs
    every width up to EVERY_WIDTH_ROWS rows, blocks spaced by halves past them; without
    graphs (eager steps timed at start-up) blocks spaced by doublings."""
    if not cuda_graphs:
        return "doublings"
    return "every" if max_rows <= EVERY_WIDTH_ROWS else "halves"


def width_candidates(
    block_size: int, policy: str, plain_step: bool = True, spacing: str = "doublings"
) -> tuple[int, ...]:
    """The verify widths (draft tokens) a policy may choose: B-1 alone for `fixed`; for `auto`
    0 (a plain step, with `plain_step`), then the widths of the blocks below B and B-1:
    blocks of 2, 4, 8, ... tokens (`doublings`), of 2, 3, 4, 6, 8, 12, ... (`halves`: powers
    of two and 1.5 times them), or every width 1 .. B-1 (`every`)."""
    if policy not in VERIFY_WIDTHS:
        raise ConfigError(f"verify width must be one of {', '.join(VERIFY_WIDTHS)}, got {policy!r}")
    if spacing not in SPACINGS:
        raise ConfigError(f"width spacing must be one of {', '.join(SPACINGS)}, got {spacing!r}")
    full = block_size - 1
    if policy == "fixed" or full <= 0:
        return (full,)
    out = [0] if plain_step else []
    if spacing == "every":
        return (*out, *range(1, full + 1))
    block = 2
    while block - 1 < full:
        out.append(block - 1)
        if spacing == "halves" and block + block // 2 - 1 < full:
            out.append(block + block // 2 - 1)
        block *= 2
    return (*out, full)


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one speculative step by (rows, verify width).

    A CUDA graph's step runs its bucket's rows, padding included, so a step of `rows` costs
    what the smallest measured row count >= rows cost. An eager step (`unpadded`: the CPU's
    timed steps) runs its own rows alone, so between two measured counts its cost is
    interpolated linearly: on the 2-core CPU, the demo pair's steps of 8 to 15 rows took a
    median 53-59 ms at W = 7 where the 16-row entry said 68.5 (docs/engine.md, "Verify width")."""

    seconds: dict[tuple[int, int], float]
    measured: bool  # False: the flat default, every width the same
    unpadded: bool = False  # True: steps run their own rows (eager), interpolated between counts

    @classmethod
    def flat(cls, widths: Sequence[int]) -> StepCosts:
        return cls({(1, w): 1.0 for w in widths}, measured=False)

    def of(self, rows: int, width: int) -> float:
        """The cost at the smallest measured row count >= rows (the largest past them all);
        `unpadded`, interpolated linearly from the largest measured count below rows."""
        cost = self._known.get((rows, width))
        if cost is None:
            cost = self._known[rows, width] = self._of(rows, width)
        return cost

    @cached_property
    def _known(self) -> dict[tuple[int, int], float]:
        """`of`'s answers so far (a step asks for each candidate width, twice or more)."""
        return {}

    def _of(self, rows: int, width: int) -> float:
        counts = self.row_counts
        upper = next((r for r in counts if r >= rows), None)
        if upper is None:
            return self.seconds[counts[-1], width]
        cost = self.seconds[upper, width]
        lower = max((r for r in counts if r < rows), default=None)
        if not self.unpadded or lower is None:
            return cost
        below = self.seconds[lower, width]
        return below + (cost - below) * (rows - lower) / (upper - lower)

    @cached_property
    def row_counts(self) -> list[int]:
        """The measured row counts, ascending (once: `of` runs for every candidate a step)."""
        return sorted({r for r, _ in self.seconds})

    def as_dict(self) -> dict[str, float]:
        return {f"{r}x{w}": s for (r, w), s in sorted(self.seconds.items())}

    def text(self) -> str:
        """The table in milliseconds, `rows`x`width` pairs: "1x0 8.01, 1x1 20.70, ..."."""
        return ", ".join(f"{key} {1000 * s:.2f}" for key, s in self.as_dict().items())


def engine_rates(totals: SpecCounters, positions: int) -> list[float]:
    """The engine's conditional acceptance rate per position, each shrunk toward the one before
    it (and the first toward 1): c_j = (accepted_j + ENGINE_WEIGHT x c_{j-1}) /
    (verified_j + ENGINE_WEIGHT), c_0 = 1."""
    accepted, verified = totals.accepted_per_position, totals.verified_per_position
    rates, before = [], 1.0
    for j in range(1, positions + 1):
        before = (accepted.get(j, 0) + ENGINE_WEIGHT * before) / (verified.get(j, 0) + ENGINE_WEIGHT)
        rates.append(before)
    return rates


def prefix_rates(counters: SpecCounters | RecentAcceptance, prior: Sequence[float]) -> list[float]:
    """r[k], k = 1..len(prior): the chance that a request's draft tokens 1..k are all accepted,
    from its own counts shrunk toward the engine's conditional rates `prior`: the product of
    (accepted_j + weight x prior_j) / (verified_j + weight) over j = 1..k, in one pass (the
    engine runs this for every row of every step).
    The engine passes `RecentAcceptance` (recent steps weigh more): its counts are kept at a
    scale, so the prior's weight is taken at that scale too (`SpecCounters`: a scale of 1)."""
    accepted, verified = counters.accepted_per_position, counters.verified_per_position
    weight = REQUEST_WEIGHT * counters.scale
    out, product = [], 1.0
    for j, p in enumerate(prior, 1):
        product *= (accepted.get(j, 0) + weight * p) / (verified.get(j, 0) + weight)
        out.append(product)
    return out


def expected_tokens(
    rates: Sequence[Sequence[float]], limits: Sequence[int], candidates: Sequence[int]
) -> dict[int, float]:
    """Expected committed tokens of a step over the rows at each candidate W (row i: prefix
    acceptance `rates[i]`, at most `limits[i]` draft tokens): row i commits
    1 + sum(rates[i][:min(W, limits[i])]). The rows that may use every candidate (all but those
    near their max_tokens) are added up position by position first, and the running sums of
    those columns serve every candidate; each other row takes running sums of its own. (The
    engine runs this every step: at 16 rows, a row and candidate at a time took about half
    of the width's choice.)"""
    widths = sorted(candidates, reverse=True)
    top = widths[0]
    full = [r[:top] for r, n in zip(rates, limits) if n >= top]
    columns = list(accumulate(map(sum, zip(*full)), initial=0.0)) if full else [0.0]
    last = len(columns) - 1
    totals = [len(full) + columns[w if w < last else last] for w in widths]
    for r, n in zip(rates, limits):
        if n >= top:
            continue
        sums = list(accumulate(r[:n], initial=0))
        last = len(sums) - 1
        totals = [t + (1.0 + sums[w if w < last else last]) for t, w in zip(totals, widths)]
    return dict(zip(widths, totals))


def best_width(tokens: dict[int, float], rows: int, costs: StepCosts) -> int:
    """The W of `tokens` (expected_tokens) with the most per second; the wider on a tie."""
    best, best_value = 0, -1.0
    for width in sorted(tokens, reverse=True):
        value = tokens[width] / costs.of(rows, width)
        if value > best_value:
            best, best_value = width, value
    return best


def choose_width(
    rates: Sequence[Sequence[float]], limits: Sequence[int], costs: StepCosts, candidates: Sequence[int]
) -> int:
    """The candidate W with the most expected committed tokens per second over the rows
    (expected_tokens); the wider on a tie."""
    return best_width(expected_tokens(rates, limits, candidates), len(rates), costs)


def probe_loss(tokens: dict[int, float], rows: int, costs: StepCosts, width: int) -> float:
    """Seconds a step at `width` is expected to lose against plain steps (W = 0): its cost
    less the time plain steps take to commit its expected tokens (`tokens`: expected_tokens)."""
    plain = costs.of(rows, 0) / tokens[0]  # seconds a token of a plain step
    return costs.of(rows, width) - tokens[width] * plain


class VerifyWidth:
    """The engine's verify-width policy: the candidates it may choose and their costs.

    Plain steps verify nothing, so the estimates they were chosen on never move by
    themselves: an unlucky start (the first blocks of a continuation accept least) would keep
    a request plain for good. So a run of plain steps is broken by a probe, a step that
    drafts at the best width above 0 to measure acceptance again. A probe is expected to
    lose time: its cost less what plain steps would take for the tokens it is expected to
    commit (`probe_loss`). It comes once the run's plain steps have cost 1 / PROBE_SHARE
    times that loss (so probes take about PROBE_SHARE of a plain run's time), after at
    least PROBE_AFTER plain steps and at most PROBE_LIMIT. A drafted width that nearly wins
    is probed often (it loses little, and its acceptance may tip it), one far behind rarely
    (at 16 rows on a 2-core CPU a drafted step costs 3-6 plain steps and commits 2-3 tokens
    a row). A step that drafts on its own merit starts the run afresh. A cost table with
    no entry for W = 0 (made for an engine without plain steps) never takes one. Steps narrower
    than the rows could use have probes of their own, on the same budget (`_past_narrow`)."""

    def __init__(
        self,
        policy: str,
        block_size: int,
        costs: StepCosts | None = None,
        plain_step: bool = True,
        spacing: str = "doublings",
    ) -> None:
        self.policy, self.block_size = policy, block_size
        self.candidates = width_candidates(block_size, policy, plain_step, spacing)
        self.costs = costs or StepCosts.flat(self.candidates)
        if self.candidates[0] == 0 and all(w != 0 for _, w in self.costs.seconds):
            self.candidates = self.candidates[1:]
        self.reset()
        missing = sorted({w for w in self.candidates} - {w for _, w in self.costs.seconds})
        if missing:
            raise ConfigError(f"the step costs have no entry for verify width(s) {missing}")

    def reset(self) -> None:
        """Forget the runs of plain and of narrow steps (a fresh engine's state)."""
        self.plain_run, self.plain_seconds = 0, 0.0
        self.narrow_run, self.narrow_seconds = 0, 0.0
        self.memo: tuple | None = None  # (key, counters, expected tokens) of the last choice

    def expected(
        self, limits: Sequence[int], counters: Sequence[SpecCounters | RecentAcceptance], totals: SpecCounters
    ) -> dict[int, float]:
        """expected_tokens for these rows, or the last step's when nothing it was computed
        from has moved: the same counters (every count moves a step count) and limits. A run
        of plain steps moves no count, so it computes them once."""
        key = (totals.steps, tuple(limits), tuple(c.steps for c in counters))
        memo = self.memo
        if (
            memo is not None
            and memo[0] == key
            and memo[1][0] is totals
            and all(a is b for a, b in zip(memo[1][1:], counters))
        ):
            return memo[2]
        prior = engine_rates(totals, self.block_size - 1)
        rates = [prefix_rates(c, prior) for c in counters]
        tokens = expected_tokens(rates, limits, self.candidates)
        self.memo = (key, (totals, *counters), tokens)
        return tokens

    def choose(
        self, limits: Sequence[int], counters: Sequence[SpecCounters | RecentAcceptance], totals: SpecCounters
    ) -> int:
        """This step's verify width for rows that may still produce `limits` draft tokens, with
        their own and the engine's acceptance counts."""
        if len(self.candidates) == 1:
            return self.candidates[0]
        tokens = self.expected(limits, counters, totals)
        rows = len(limits)
        width = best_width(tokens, rows, self.costs)
        if width > 0:
            self.plain_run, self.plain_seconds = 0, 0.0
            return self._past_narrow(width, tokens, limits)
        drafted = {w: t for w, t in tokens.items() if w > 0}
        probe = best_width(drafted, rows, self.costs)
        if self.plain_run >= PROBE_AFTER and (
            self.plain_run >= PROBE_LIMIT
            or PROBE_SHARE * self.plain_seconds >= probe_loss(tokens, rows, self.costs, probe)
        ):
            self.plain_run, self.plain_seconds = 0, 0.0
            return probe
        self.plain_run += 1
        self.plain_seconds += self.costs.of(rows, 0)
        return 0

    def _past_narrow(self, width: int, tokens: dict[int, float], limits: Sequence[int]) -> int:
        """`width`, or now and then a wider probe: a step at `width` verifies no position past
        it, so those positions' estimates never move by themselves, and one that started low
        (the first blocks rejected it) would keep every later step at `width` for good. A
        run of steps narrower than the rows could use is broken by a step at the best wider
        width the rows can use, once the run has cost 1 / PROBE_SHARE times what that step is
        expected to lose against the run's rate of tokens per second (`probe_loss`'s
        arithmetic with `width` in place of a plain step), and after at least PROBE_AFTER
        steps."""
        rows = len(limits)
        wider = {w: t for w, t in tokens.items() if width < w <= max(limits)}
        if not wider:
            self.narrow_run, self.narrow_seconds = 0, 0.0
            return width
        probe = best_width(wider, rows, self.costs)
        loss = self.costs.of(rows, probe) - tokens[probe] * self.costs.of(rows, width) / tokens[width]
        if self.narrow_run >= PROBE_AFTER and PROBE_SHARE * self.narrow_seconds >= loss:
            self.narrow_run, self.narrow_seconds = 0, 0.0
            return probe
        self.narrow_run += 1
        self.narrow_seconds += self.costs.of(rows, width)
        return width
