"""The verify width choice (reference_engine/runtime/verify_width.py) on made-up costs and
acceptance: the candidates, expected committed tokens per second, ties, the estimates from a
request's counts and the engine's, and the per-position counts it reads (stats.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from reference_engine.errors import ConfigError
from reference_engine.runtime.engine_config import EngineConfig
from reference_engine.runtime.stats import SpecCounters
from reference_engine.runtime.verify_width import (
    ENGINE_WEIGHT,
    PROBE_AFTER,
    PROBE_SHARE,
    REQUEST_WEIGHT,
    StepCosts,
    VerifyWidth,
    choose_width,
    engine_rates,
    prefix_rates,
    width_candidates,
    width_spacing,
)

WIDTHS = (0, 1, 3, 7, 15)


def conditional_rates(
    accepted: list[int], verified: list[int], prior: list[float], weight: float
) -> list[float]:
    """The shrunk conditional rate of each position, as the module's docstrings define it:
    c_j = (accepted_j + weight x prior_j) / (verified_j + weight)."""
    return [(a + weight * p) / (v + weight) for a, v, p in zip(accepted, verified, prior)]


def costs(by_width: dict[int, float], rows: tuple[int, ...] = (1, 16, 64)) -> StepCosts:
    return StepCosts({(r, w): s * r for r in rows for w, s in by_width.items()}, measured=True)


def geometric(rate: float, n: int = 15) -> list[float]:
    return [rate**k for k in range(1, n + 1)]


def test_candidates_are_a_plain_step_blocks_of_powers_of_two_and_the_full_block() -> None:
    assert width_candidates(16, "auto") == WIDTHS
    assert width_candidates(10, "auto") == (0, 1, 3, 7, 9)
    assert width_candidates(2, "auto") == (0, 1)
    assert width_candidates(16, "fixed") == (15,)
    # on CUDA (no plain step yet): the blocks alone
    assert width_candidates(16, "auto", plain_step=False) == (1, 3, 7, 15)
    assert VerifyWidth("auto", 16, plain_step=False).candidates == (1, 3, 7, 15)
    with pytest.raises(ConfigError, match="verify width must be one of auto, fixed"):
        width_candidates(16, "wide")
    with pytest.raises(ConfigError, match="verify_width must be one of auto, fixed"):
        EngineConfig(verify_width="wide")


def test_a_full_block_that_is_itself_a_halves_block_is_listed_once() -> None:
    """Spaced by halves, a B of 1.5 times a power of two (3, 12, 24) is one of the blocks:
    its width B-1 is a candidate once, not twice."""
    assert width_candidates(12, "auto", plain_step=False, spacing="halves") == (1, 2, 3, 5, 7, 11)
    assert width_candidates(3, "auto", spacing="halves") == (0, 1, 2)
    assert width_candidates(24, "auto", plain_step=False, spacing="halves") == (1, 2, 3, 5, 7, 11, 15, 23)


def test_with_graphs_every_width_is_a_candidate_and_one_short_of_a_block_can_win() -> None:
    """With CUDA graphs up to 16 rows (spacing `every`) the candidates are 1 .. B-1, and a
    verify whose cost grows with every token (a mixture of experts) takes the width its
    acceptance reaches: rows that always accept 5 or 6 proposals commit as much at W = 6 as
    at W = 7, for less."""
    every = tuple(range(1, 16))
    assert width_candidates(16, "auto", plain_step=False, spacing="every") == every
    assert width_candidates(16, "auto", spacing="every") == (0, *every)
    assert width_candidates(16, "fixed", spacing="every") == (15,)
    assert VerifyWidth("auto", 16, plain_step=False, spacing="every").candidates == every
    # only captured graphs time every width; past 16 rows they are spaced by halves
    assert width_spacing(True, 1) == width_spacing(True, 16) == "every"
    assert width_spacing(True, 17) == width_spacing(True, 64) == "halves"
    assert width_spacing(False, 1) == width_spacing(False, 64) == "doublings"
    with pytest.raises(ConfigError, match="width spacing must be one of every, halves, doublings"):
        width_candidates(16, "auto", spacing="dense")
    table = costs({w: 5.0 + 0.4 * w for w in every})
    step = [[1.0] * 5 + [0.5] + [0.0] * 9] * 2  # position 6 half the time, never position 7
    assert choose_width(step, [15, 15], table, every) == 6
    assert choose_width(step, [15, 15], table, width_candidates(16, "auto", plain_step=False)) == 7


def test_past_sixteen_rows_the_blocks_are_spaced_by_halves_and_a_six_token_block_can_win() -> None:
    """Past 16 rows the graphs cover blocks of 2, 3, 4, 6, 8, 12, 16 tokens: no two choices
    are more than 1.5x apart in verify rows. On an arithmetic-bound verify (cost linear in
    the rows it verifies) rows that accept 5 proposals every step commit 6 tokens a block of
    6 as of 8, for less; with blocks of 2, 4, 8 and 16 alone the step pays for 8."""
    halves = (1, 2, 3, 5, 7, 11, 15)
    assert width_candidates(16, "auto", plain_step=False, spacing="halves") == halves
    assert width_candidates(16, "auto", spacing="halves") == (0, *halves)
    assert width_candidates(8, "auto", plain_step=False, spacing="halves") == (1, 2, 3, 5, 7)
    assert width_candidates(10, "auto", plain_step=False, spacing="halves") == (1, 2, 3, 5, 7, 9)
    assert width_candidates(4, "auto", plain_step=False, spacing="halves") == (1, 2, 3)
    assert width_candidates(2, "auto", plain_step=False, spacing="halves") == (1,)
    assert width_candidates(16, "fixed", spacing="halves") == (15,)
    assert VerifyWidth("auto", 16, plain_step=False, spacing="halves").candidates == halves
    table = costs({w: 6.0 + (w + 1) for w in halves}, rows=(64,))  # a draft, then a row a token
    five = [[1.0] * 5 + [0.0] * 10] * 64
    assert choose_width(five, [15] * 64, table, halves) == 5
    assert choose_width(five, [15] * 64, table, (1, 3, 7, 15)) == 7


def test_flat_costs_verify_the_full_block() -> None:
    flat = StepCosts.flat(WIDTHS)
    assert choose_width([geometric(0.1)] * 64, [15] * 64, flat, WIDTHS) == 15
    assert choose_width([[0.0] * 15], [15], flat, WIDTHS) == 15  # a tie goes to the wider


def test_a_wide_batch_with_low_acceptance_verifies_fewer_tokens() -> None:
    """Arithmetic-bound wide verifies: a full block costs 3x a one-token verify."""
    table = costs({0: 0.9, 1: 1.0, 3: 1.2, 7: 1.6, 15: 3.0})
    # tokens per row: 1 + sum of r[:w]; per cost: w=1 1.5/1, w=3 1.875/1.2, w=7 ~2/1.6
    assert choose_width([geometric(0.5)] * 64, [15] * 64, table, WIDTHS) == 3
    assert choose_width([geometric(0.95)] * 64, [15] * 64, table, WIDTHS) == 7
    assert choose_width([geometric(0.99)] * 64, [15] * 64, table, WIDTHS) == 15
    # rows near their max_tokens cannot use a wide verify: the narrow one wins
    assert choose_width([geometric(0.95)] * 64, [1] * 64, table, WIDTHS) == 1


def test_a_plain_step_wins_where_a_speculative_step_costs_more_than_it_commits() -> None:
    """A CPU, or a batch wide enough that every verify is bound by arithmetic: a speculative
    step costs 2.5-6 plain steps. Low acceptance: the plain step (W = 0, one token a row for
    one unit) beats every width; high acceptance still pays for the full block."""
    table = costs({0: 1.0, 1: 2.5, 3: 3.0, 7: 4.0, 15: 6.0})
    # per row and unit of cost: w=0 1/1, w=1 1.5/2.5, w=3 1.875/3, w=7 ~2/4
    assert choose_width([geometric(0.5)] * 16, [15] * 16, table, WIDTHS) == 0
    # w=15: 1 + sum 0.95^k = 11.2 tokens for 6 units
    assert choose_width([geometric(0.95)] * 16, [15] * 16, table, WIDTHS) == 15
    # the same rows on a table where a plain step costs as much as a narrow verify: never 0
    assert (
        choose_width([[0.0] * 15] * 16, [15] * 16, costs({0: 1.0, 1: 1.0, 3: 1.2, 7: 1.6, 15: 3.0}), WIDTHS)
        == 1
    )


def test_the_cost_is_read_at_the_smallest_measured_row_count_that_holds_the_batch() -> None:
    table = StepCosts({(1, 1): 1.0, (1, 15): 1.1, (64, 1): 1.0, (64, 15): 4.0}, measured=True)
    rates = geometric(0.6)
    assert choose_width([rates], [15], table, (1, 15)) == 15
    assert choose_width([rates] * 40, [15] * 40, table, (1, 15)) == 1  # read at 64 rows
    assert table.of(100, 15) == 4.0  # past every measured count: the largest


def test_unpadded_costs_are_interpolated_between_the_measured_row_counts() -> None:
    """Eager steps run their own rows: a step of 12 rows costs between the 8- and 16-row
    steps, linearly; graphs (padded) pay their bucket's cost. Below the smallest count and
    past the largest, both read the nearest count."""
    seconds = {(2, 0): 1.0, (2, 7): 3.0, (8, 0): 2.0, (8, 7): 6.0, (16, 0): 4.0, (16, 7): 14.0}
    padded = StepCosts(seconds, measured=True)
    eager = StepCosts(seconds, measured=True, unpadded=True)
    assert padded.of(12, 7) == 14.0 and padded.of(12, 0) == 4.0
    assert eager.of(12, 7) == pytest.approx(10.0) and eager.of(12, 0) == pytest.approx(3.0)
    assert eager.of(5, 7) == pytest.approx(4.5) and eager.of(9, 0) == pytest.approx(2.25)
    for table in (padded, eager):
        assert table.of(8, 7) == 6.0 and table.of(16, 0) == 4.0  # a measured count: as measured
        assert table.of(1, 7) == 3.0 and table.of(40, 7) == 14.0  # outside: the nearest count


def test_rows_between_two_measured_counts_draft_where_their_interpolated_cost_pays() -> None:
    """A start-up table of the size the CPU times for the demo pair, 16 rows (69.5 ms at W = 7,
    17.3 plain) and 8 (45.7, 13.3): 11 rows expecting 3.92 tokens a row at W = 7 lose to
    plain steps at the 16-row cost (0.62 tokens a ms against 0.64) and win at the
    interpolated one (0.79 against 0.74, 54.6 and 14.8 ms)."""
    seconds = {(8, 0): 13.3, (8, 7): 45.7, (16, 0): 17.3, (16, 7): 69.5}
    rates = [geometric(0.78, 7)] * 11
    assert 1 + sum(rates[0]) == pytest.approx(3.92, abs=0.01)
    assert choose_width(rates, [7] * 11, StepCosts(seconds, measured=True), (0, 7)) == 0
    assert choose_width(rates, [7] * 11, StepCosts(seconds, measured=True, unpadded=True), (0, 7)) == 7


def test_an_engine_without_history_verifies_the_full_block() -> None:
    assert engine_rates(SpecCounters(), 15) == [1.0] * 15
    chooser = VerifyWidth("auto", 16, costs({0: 0.9, 1: 1.0, 3: 1.2, 7: 1.6, 15: 3.0}))
    assert chooser.choose([15] * 64, [SpecCounters()] * 64, SpecCounters()) == 15


def test_a_request_with_no_steps_borrows_the_engines_rates() -> None:
    totals = SpecCounters()
    for _ in range(200):
        totals.record(15, 2, 3)  # draft tokens 1 and 2 accepted, 3 rejected, every step
    prior = engine_rates(totals, 15)
    assert prior[0] > 0.98 and prior[1] > 0.98 and prior[2] < 0.03
    before = 1.0  # each position's rate shrunk toward the one before it, by ENGINE_WEIGHT
    for j, rate in enumerate(prior, 1):
        (expected,) = conditional_rates(
            [totals.accepted_per_position[j]], [totals.verified_per_position[j]], [before], ENGINE_WEIGHT
        )
        assert rate == expected
        before = expected
    assert prior[3:] == pytest.approx([prior[2]] * 12)  # unverified positions: the last rate
    assert prefix_rates(SpecCounters(), prior) == pytest.approx(
        [prior[0], prior[0] * prior[1], *[prior[0] * prior[1] * prior[2] ** k for k in range(1, 14)]]
    )
    own = SpecCounters()
    for _ in range(50):
        own.record(15, 15, 16)  # this request accepts every draft token
    assert prefix_rates(own, prior)[14] > 0.3 > 1e6 * prefix_rates(SpecCounters(), prior)[14]


def test_positions_count_as_verified_up_to_the_first_rejection() -> None:
    counters = SpecCounters()
    counters.record(7, 2, 3)  # tokens 1, 2 accepted, 3 rejected: 1..3 verified
    counters.record(3, 3, 4)  # a narrow verify, all accepted: 1..3 verified, 4 never was
    counters.record(5, 0, 1)
    assert dict(counters.verified_per_position) == {1: 3, 2: 2, 3: 2}
    assert dict(counters.accepted_per_position) == {1: 2, 2: 2, 3: 1}


def test_costs_must_cover_every_candidate() -> None:
    with pytest.raises(ConfigError, match=r"no entry for verify width\(s\) \[7, 15\]"):
        VerifyWidth("auto", 16, costs({1: 1.0, 3: 1.0}))


def counts(accepted: int, steps: int = 40) -> SpecCounters:
    """A request (or engine) whose every step verified 15 draft tokens and accepted `accepted`."""
    out = SpecCounters()
    for _ in range(steps):
        out.record(15, accepted, accepted + 1)
    return out


def probe_gaps(
    chooser: VerifyWidth, counters: SpecCounters, steps: int, rows: int = 16
) -> tuple[list[int], list[int]]:
    """The plain steps between consecutive probes over `steps` choices, and the widths probed."""
    picks = [chooser.choose([15] * rows, [counters] * rows, counters) for _ in range(steps)]
    drafted = [i for i, w in enumerate(picks) if w > 0]
    return [b - a - 1 for a, b in zip([-1, *drafted], drafted)], [picks[i] for i in drafted]


def test_probes_take_a_bounded_share_of_a_plain_run() -> None:
    """Plain steps move no acceptance count, so a run of them is broken by a probe at the best
    width above 0 once the run's plain steps have cost 1 / PROBE_SHARE times the probe's
    expected loss (its cost less what plain steps take for its expected tokens): never before
    PROBE_AFTER plain steps, never after PROBE_LIMIT."""
    from reference_engine.runtime.verify_width import PROBE_AFTER, PROBE_LIMIT, PROBE_SHARE

    table = {0: 1.0, 1: 2.5, 3: 3.0, 7: 4.0, 15: 6.0}
    # every first draft token rejected: a width-1 step commits about one token for 2.5 plain
    # steps' time, so it loses about 1.5 plain steps and waits for 1.5 / PROBE_SHARE of them
    chooser = VerifyWidth("auto", 16, costs(table))
    low = counts(0)
    gaps, widths = probe_gaps(chooser, low, 1000)
    prior = engine_rates(low, 15)
    rate = prefix_rates(low, prior)[0]  # the first draft token's estimated acceptance
    loss = 2.5 - (1.0 + rate)  # in plain steps
    run = max(PROBE_AFTER, min(PROBE_LIMIT, math.ceil(loss / PROBE_SHARE - 1e-9)))
    assert 60 < run < PROBE_LIMIT and gaps == [run] * len(gaps) and len(gaps) == 1000 // (run + 1)
    assert set(widths) == {1}  # the best width above 0 on these costs
    # the probes' expected loss is PROBE_SHARE of the plain steps' time, give or take a step
    assert abs(len(gaps) * loss - PROBE_SHARE * sum(gaps)) <= loss
    # a drafted width that nearly wins loses little a probe: probed after PROBE_AFTER steps
    near = VerifyWidth("auto", 16, costs({0: 1.0, 1: 2.05, 3: 3.0, 7: 4.5, 15: 8.5}))
    assert probe_gaps(near, counts(1), 60)[0] == [PROBE_AFTER] * 12
    # one far behind is probed after PROBE_LIMIT plain steps at the latest
    far = VerifyWidth("auto", 16, costs({0: 1.0, 1: 40.0, 3: 50.0, 7: 60.0, 15: 80.0}))
    assert probe_gaps(far, low, 3 * (PROBE_LIMIT + 1))[0] == [PROBE_LIMIT] * 3
    # a step that drafts on its own merit starts the run afresh
    high = counts(15)
    assert chooser.choose([15] * 16, [high] * 16, high) == 15
    assert probe_gaps(chooser, low, run + 1)[0] == [run]


def test_a_wider_probe_that_loses_little_breaks_every_run_of_probe_after_narrow_steps() -> None:
    """Rows whose estimates never move (3 of 15 draft tokens accepted every step) and costs
    under which W = 3 wins but W = 7 loses very little: a wider probe at 7 follows every
    PROBE_AFTER steps at 3, also when 7 is exactly the most draft tokens the rows can still
    commit (a probe may reach the rows' limit)."""
    table = costs({0: 10.0, 1: 2.0, 3: 2.2, 7: 2.3, 15: 6.0})
    seen = counts(3)
    for limit in (15, 7):
        chooser = VerifyWidth("auto", 16, table)
        widths = [chooser.choose([limit] * 16, [seen] * 16, seen) for _ in range(20)]
        assert widths == ([3] * PROBE_AFTER + [7]) * 4, (limit, widths)


def test_a_table_without_a_plain_step_never_takes_one_and_reset_forgets_the_run() -> None:
    table = costs({1: 1.0, 3: 1.2, 7: 1.6, 15: 3.0})  # made for an engine without plain steps
    assert VerifyWidth("auto", 16, table).candidates == (1, 3, 7, 15)
    chooser = VerifyWidth("auto", 16, costs({0: 1.0, 1: 2.5, 3: 3.0, 7: 4.0, 15: 6.0}))
    low = counts(0)
    first = [chooser.choose([15] * 16, [low] * 16, low) for _ in range(200)]
    chooser.reset()
    assert [chooser.choose([15] * 16, [low] * 16, low) for _ in range(200)] == first and any(first)


@pytest.mark.parametrize("vocab", [7, 64, 128256, 151936, 248320])
def test_timing_ids_are_fixed_in_range_and_all_different_within_a_block(vocab: int) -> None:
    from reference_engine.runtime.verify_width import timing_ids

    rows, width = {7: (2, 3), 64: (4, 16)}.get(vocab, (64, 16))  # at most vocab tokens
    ids = timing_ids(rows, width, vocab)
    assert ids.shape == (rows, width) and ids.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < vocab
    assert len(set(ids.flatten().tolist())) == rows * width  # no token repeated: no routing shared
    assert torch.equal(ids, timing_ids(rows, width, vocab))


def test_timing_ids_follow_the_documented_table() -> None:
    """Position i of the flattened block takes (i * TIMING_STRIDE + 1) mod vocab: the first
    is token 1, never token 0."""
    from reference_engine.runtime.verify_width import TIMING_STRIDE, timing_ids

    ids = timing_ids(2, 3, 1000)
    assert ids.tolist() == [
        [(i * TIMING_STRIDE + 1) % 1000 for i in range(r * 3, r * 3 + 3)] for r in range(2)
    ]
    assert int(ids[0, 0]) == 1


class _Timed:
    """A captured graph stand-in: its replay records the token ids its buffers hold."""

    def __init__(self, rows: int, width: int, seen: list, inputs=None, name: str | None = None) -> None:
        self.inputs = inputs or SimpleNamespace(ids=torch.zeros(rows, width, dtype=torch.int64))
        name = name or str(width)
        self.graph = SimpleNamespace(replay=lambda: seen.append((width, self.inputs.ids.clone(), name)))


class _Event:
    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: _Event) -> float:
        return 1.0


def test_graph_step_costs_are_timed_on_spread_token_ids_and_the_buffers_put_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The replayed draft and verify read a different token at every position while timed (a
    mixture of experts' verify then reads as many experts as a verify of text does, not the k
    of one repeated token), and their buffers hold zeros again after."""
    from reference_engine.runtime.graphs import EngineGraphs
    from reference_engine.runtime.verify_width import timing_ids

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    seen: list = []
    graphs = EngineGraphs.__new__(EngineGraphs)
    graphs.target = SimpleNamespace(config=SimpleNamespace(vocab_size=1000))
    graphs.device = torch.device("cpu")
    graphs.block_size = 4
    body = _Timed(2, 4, seen)
    graphs.draft_graphs = {(2, 4): body}
    # each verify width's draft head reads the body's buffers (and its hidden states)
    graphs.draft_head_graphs = {(2, w): _Timed(2, 4, seen, body.inputs, f"head {w}") for w in (1, 3)}
    graphs.verify_graphs = {(2, w): _Timed(2, w, seen) for w in (1, 2, 4)}
    graphs.commit_graphs = graphs.accept_graphs = {}
    costs = graphs.step_seconds(repeats=1)
    assert set(costs) == {(2, 0), (2, 1), (2, 3)}
    assert seen and all(torch.equal(ids, timing_ids(2, w, 1000)) for w, ids, _ in seen)
    # the draft (width 4) and the head of each verify's width replayed with the verifies
    assert {name for _, _, name in seen} == {"1", "2", "4", "head 1", "head 3"}
    for g in (*graphs.verify_graphs.values(), *graphs.draft_graphs.values()):
        assert not g.inputs.ids.any()


def test_choose_width_is_the_formula_of_its_docstring():
    """The running sums choose what the formula does, row by row, on rows of every kind
    (limits under, at and past the widths; rates from counts; ties), and prefix_rates is the
    product of conditional_rates."""
    import random

    def by_formula(rates, limits, costs, candidates):
        best, best_value = candidates[-1], -1.0
        for width in sorted(candidates, reverse=True):
            tokens = sum(1.0 + sum(r[: min(width, n)]) for r, n in zip(rates, limits))
            if tokens / costs.of(len(rates), width) > best_value:
                best, best_value = width, tokens / costs.of(len(rates), width)
        return best

    rng = random.Random(0)
    chosen = set()
    for trial in range(400):
        rows = rng.choice([1, 3, 16, 64])
        prior = [rng.uniform(0.3, 1.0) for _ in range(15)]
        counters = []
        for _ in range(rows):
            c = SpecCounters()
            for _ in range(rng.randrange(0, 12)):
                proposed = rng.choice([1, 3, 7, 15])
                c.record(proposed, rng.randrange(0, proposed + 1), 1)
            counters.append(c)
        rates = [prefix_rates(c, prior) for c in counters]
        for c, r in zip(counters, rates):
            product, expected = 1.0, []
            for rate in conditional_rates(
                [c.accepted_per_position[j] for j in range(1, 16)],
                [c.verified_per_position[j] for j in range(1, 16)],
                prior,
                REQUEST_WEIGHT,
            ):
                product *= rate
                expected.append(product)
            assert r == expected
        limits = [rng.choice([0, 1, 2, 5, 15, 15]) for _ in range(rows)]
        seconds = {(b, w): rng.uniform(1.0, 3.0) * (1 + w / 8) for b in (1, 4, 16, 64) for w in WIDTHS}
        if trial % 5 == 0:  # ties
            seconds = {key: 1.0 for key in seconds}
        table = StepCosts(seconds, measured=True)
        width = choose_width(rates, limits, table, WIDTHS)
        assert width == by_formula(rates, limits, table, WIDTHS)
        chosen.add(width)
    assert chosen == set(WIDTHS)  # every candidate came up


def _run_steps(chooser, rows, steps, accepts, limit=15):
    """Choose `steps` widths for `rows` rows, recording what each row accepts: `accepts(step,
    row)` draft tokens are right, of which the step verifies its width's worth."""
    counters, totals, widths = [SpecCounters() for _ in range(rows)], SpecCounters(), []
    for step in range(steps):
        width = chooser.choose([limit] * rows, counters, totals)
        widths.append(width)
        for row, c in enumerate(counters):
            accepted = min(width, accepts(step, row))
            for counts in (c, totals):
                counts.record(width, accepted, accepted + 1)
    return widths


def test_a_position_its_first_blocks_rejected_is_probed_again_and_wins_its_width() -> None:
    """Every width costs a little more than the one below it. The rows' first block accepts 5
    draft tokens, every later block 5 or 6 (position 6 half the time, worth its cost): the
    first estimates put position 6 low, and steps at W = 5 never verify it. A wider probe
    now and then measures it, and the steps go to W = 6."""
    table = costs({w: 8.0 + 0.3 * w for w in range(1, 16)})
    chooser = VerifyWidth("auto", 16, table, plain_step=False, spacing="every")
    widths = _run_steps(chooser, 16, 60, lambda step, row: 5 + (step > 0 and (step + row) % 2))
    assert widths[0] == 15 and widths[1] == 5  # the full block, then position 6 looked poor
    assert 6 in widths[1:12]  # a probe within a few steps
    assert 5 not in widths[-20:] and widths[-20:].count(6) >= 15, widths  # 7 now and then: a probe


def test_wider_probes_take_a_bounded_share_of_a_narrow_run() -> None:
    """Rows that never accept a sixth token: the steps stay at W = 5 but for probes, which
    are expected to cost at most about PROBE_SHARE of the run's time; rows that cannot
    commit past W get no probe."""
    table = costs({w: 8.0 + 0.3 * w for w in range(1, 16)})
    chooser = VerifyWidth("auto", 16, table, plain_step=False, spacing="every")
    widths = _run_steps(chooser, 16, 400, lambda step, row: 5)
    run = widths[1:]
    probed = [w for w in run if w != 5]
    assert probed  # the estimates of the positions past 5 are refreshed now and then
    assert len(probed) <= len(run) // (PROBE_AFTER + 1) + 1  # never before PROBE_AFTER steps at 5
    extra = sum(table.of(16, w) - table.of(16, 5) for w in probed)
    assert extra <= PROBE_SHARE * sum(table.of(16, w) for w in run)
    chooser = VerifyWidth("auto", 16, table, plain_step=False, spacing="every")
    assert set(_run_steps(chooser, 16, 60, lambda step, row: 5, limit=5)) == {5}


def test_the_remembered_estimates_are_those_a_fresh_chooser_computes() -> None:
    """The chooser keeps the last step's expected tokens while nothing they were computed from
    moved (a run of plain steps): over random steps whose rows' limits, counts and rows change
    (or not), every estimate it gives equals a fresh chooser's for the same rows."""
    import random

    rng = random.Random(1)
    table = costs({w: 1.0 + w / 8 for w in WIDTHS})
    chooser = VerifyWidth("auto", 16, table)
    totals = SpecCounters()
    counters = [SpecCounters() for _ in range(4)]
    limits = [15] * 4
    for _ in range(200):
        move = rng.random()
        if move < 0.3:  # a drafted step: counts move
            for c in counters:
                proposed = rng.choice([1, 3, 7, 15])
                accepted = rng.randrange(0, proposed + 1)
                for counts in (c, totals):
                    counts.record(proposed, accepted, accepted + 1)
        elif move < 0.6:  # rows nearer their ends: fewer draft tokens left
            limits = [rng.choice([0, 1, 2, 5, 15]) for _ in counters]
        elif move < 0.7:  # a row leaves, another joins
            counters = [*counters[1:], SpecCounters()]
        got = chooser.expected(limits, counters, totals)
        assert got == VerifyWidth("auto", 16, table).expected(limits, counters, totals), limits


# ------------------------------------------------------------------ recent acceptance
def decayed_counts(steps: list[tuple[int, int]]) -> tuple[dict[int, float], dict[int, float]]:
    """RecentAcceptance's counts written out: over (proposed, accepted) steps, oldest first,
    each weighs DECAY^age; position k is accepted when k <= accepted, verified when k <=
    min(proposed, accepted + 1) (SpecCounters)."""
    from reference_engine.runtime.stats import RecentAcceptance

    accepted_at: dict[int, float] = {}
    verified_at: dict[int, float] = {}
    for age, (proposed, accepted) in enumerate(reversed(steps)):
        weight = RecentAcceptance.DECAY**age
        for k in range(1, accepted + 1):
            accepted_at[k] = accepted_at.get(k, 0.0) + weight
        for k in range(1, min(proposed, accepted + 1) + 1):
            verified_at[k] = verified_at.get(k, 0.0) + weight
    return accepted_at, verified_at


def test_recent_counts_weigh_each_step_by_decay_to_its_age_and_survive_a_rescale() -> None:
    """RecentAcceptance's decayed counts are sum over steps of DECAY^age x the step's counts
    (positions as SpecCounters counts them), and its rates are those of the decayed counts at
    the prior's weight, however large its scale has grown (rescaled past RESCALE)."""
    import random

    from reference_engine.runtime.stats import RecentAcceptance

    rng = random.Random(5)
    steps = [(rng.choice([3, 7, 15]), rng.randrange(0, 16)) for _ in range(1200)]  # past a rescale
    steps = [(proposed, min(accepted, proposed)) for proposed, accepted in steps]
    recent = RecentAcceptance()
    for proposed, accepted in steps:
        recent.record(proposed, accepted)
    assert recent.steps == len(steps) and recent.scale < RecentAcceptance.RESCALE
    want_accepted, want_verified = decayed_counts(steps[-200:])  # older ones weigh < 1e-44
    accepted_at, verified_at = recent.counts()
    assert accepted_at == pytest.approx(want_accepted, rel=1e-9)
    assert verified_at == pytest.approx(want_verified, rel=1e-9)
    prior = [0.9, 0.8, 0.7, *[0.6] * 12]
    want, product = [], 1.0
    for j, p in enumerate(prior, 1):
        product *= (want_accepted.get(j, 0) + REQUEST_WEIGHT * p) / (want_verified.get(j, 0) + REQUEST_WEIGHT)
        want.append(product)
    assert prefix_rates(recent, prior) == pytest.approx(want, rel=1e-9)
    assert prefix_rates(RecentAcceptance(), prior) == pytest.approx(prefix_rates(SpecCounters(), prior))


def test_a_requests_estimate_follows_its_acceptance_as_it_moves() -> None:
    """Acceptance moves along a continuation (low at its start, high later; or a request
    that turns to text the draft cannot guess): after a few steps at the new rate the
    request's expected tokens are near what it now commits, where counts of every step alike
    stay near the old rate's. The engine-wide prior is the mix of both phases."""
    from reference_engine.runtime.stats import RecentAcceptance

    totals = SpecCounters()
    for _ in range(100):
        totals.record(7, 0, 1)
        totals.record(7, 7, 8)
    prior = engine_rates(totals, 7)
    for before, after in ((0, 7), (7, 0)):  # rising, then falling acceptance
        recent, alike = RecentAcceptance(), SpecCounters()
        for accepted in [before] * 20 + [after] * 5:
            recent.record(7, accepted)
            alike.record(7, accepted, accepted + 1)
        now = 1 + after  # what a step at the new rate commits
        then = 1 + before
        recent_tokens = 1 + sum(prefix_rates(recent, prior))
        alike_tokens = 1 + sum(prefix_rates(alike, prior))
        assert abs(recent_tokens - now) < 1.5, (before, after, recent_tokens)  # of a swing of 7
        assert abs(alike_tokens - then) < 1.5, (before, after, alike_tokens)
