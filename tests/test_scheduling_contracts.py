"""Contracts of the engine's scheduling policies, checked on the classes directly: admission
and the waiting queue (duplicates, `reject`, `max_waiting`, slots lowest first), aborts and
finishes (what stays known, what is counted), the prefill token budget, the fallbacks'
counts, the verify width's candidates, its cost table and its runs of plain and narrow steps
(when a probe comes, what the remembered estimates are keyed on), and the pooled cache's
cells (a trial of room never takes cells)."""

from __future__ import annotations

import math

import pytest

from reference_engine.errors import ConfigError, RequestError
from reference_engine.runtime.kv_pool import CellAllocator
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.scheduler import EngineFullError, Scheduler
from reference_engine.runtime.sequence import Phase, Sequence
from reference_engine.runtime.stats import SpecCounters
from reference_engine.runtime.verify_width import (
    PROBE_AFTER,
    PROBE_LIMIT,
    PROBE_SHARE,
    StepCosts,
    VerifyWidth,
    best_width,
    probe_loss,
    width_candidates,
)

CHUNK, BLOCK = 16, 4


def seq(rid: str, prompt: int = 1, speculative: bool = False, **options) -> Sequence:
    params = SamplingParams(max_tokens=8, **options)
    return Sequence(rid, [1] * prompt, params, frozenset(), 0.0, speculative)


def plain_scheduler(
    slots: int, admission: str = "wait", max_waiting: int = 8, budget: int | None = None, **pool
) -> Scheduler:
    """No low-acceptance fallback; chunks of CHUNK tokens, verify blocks of BLOCK; `pool`:
    `cells` and `cells_needed` for a pooled cache."""
    return Scheduler(slots, admission, max_waiting, None, 8, CHUNK, budget, BLOCK, **pool)


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


# ------------------------------------------------------------------ admission and the queue
def finished(s: Scheduler, rid: str) -> Sequence:
    """Request `rid` queued, admitted and finished by its step ("length"), not collected yet."""
    s.queue(seq(rid))
    (request,) = s.admit()
    request.finish_reason = "length"
    s.finish_done()
    return request


def test_a_finished_id_is_a_duplicate_until_it_is_collected_and_collect_forgets_it() -> None:
    """check_new refuses the id of a request that finished but was not collected yet; after
    collect the id is free again, and a second collect of it is refused."""
    s = plain_scheduler(2)
    s.check_new("a")
    a = finished(s, "a")
    with pytest.raises(RequestError, match="duplicate request id 'a'"):
        s.check_new("a")
    assert s.collect("a") is a
    s.check_new("a")
    with pytest.raises(RequestError, match="'a' is not finished"):
        s.collect("a")
    with pytest.raises(RequestError, match="unknown request id 'a'"):
        s.get("a")


def test_reject_takes_exactly_as_many_queued_requests_as_there_are_free_slots() -> None:
    """Under `reject` the requests queued since the last admission hold the free slots: with
    two free slots a second queued request is taken and a third refused."""
    s = plain_scheduler(2, "reject", 0)
    for rid in ("a", "b"):
        s.check_new(rid)
        s.queue(seq(rid))
    with pytest.raises(EngineFullError, match="no free slot for request 'c'"):
        s.check_new("c")
    assert ids(s.admit()) == ["a", "b"]


def test_the_waiting_queue_holds_max_waiting_requests_beyond_the_free_slots() -> None:
    """With one free slot and max_waiting 2, three requests may be queued before the next
    admission (one takes the slot, two wait) and the fourth is refused; with max_waiting 0
    the free slots alone take requests."""
    s = plain_scheduler(1, max_waiting=2)
    for rid in ("a", "b", "c"):
        s.check_new(rid)
        s.queue(seq(rid))
    with pytest.raises(EngineFullError, match=r"waiting queue full \(2 requests\)"):
        s.check_new("d")
    assert ids(s.admit()) == ["a"] and ids(s.waiting) == ["b", "c"]
    with pytest.raises(EngineFullError, match="waiting queue full"):
        s.check_new("d")
    none = plain_scheduler(2, max_waiting=0)
    for rid in ("a", "b"):
        none.check_new(rid)
        none.queue(seq(rid))
    with pytest.raises(EngineFullError, match=r"waiting queue full \(0 requests\)"):
        none.check_new("c")


def test_slots_are_given_lowest_first_and_freed_slots_are_reused_lowest_first() -> None:
    """admit hands out the lowest free slot in arrival order; slots freed in any order go
    back to the lowest-first order."""
    s = plain_scheduler(3)
    for rid in ("a", "b", "c", "d", "e"):
        s.queue(seq(rid))
    assert [(x.request_id, x.slot) for x in s.admit()] == [("a", 0), ("b", 1), ("c", 2)]
    s.finish(s.get("c"))
    s.finish(s.get("a"))
    assert s.free_slots == [0, 2]
    assert [(x.request_id, x.slot) for x in s.admit()] == [("d", 0), ("e", 2)]


def test_a_speculative_request_asking_for_zero_logprobs_falls_back() -> None:
    """logprobs=0 (the sampled token's own logprob, no alternatives) is still a request for
    logprobs, which only plain decode serves: it falls back under the reason `logprobs`."""
    s = plain_scheduler(2)
    r = seq("r", speculative=True, logprobs=0)
    s.queue(r)
    assert not r.speculative and r.fallback_reason == "logprobs" and s.fallbacks == {"logprobs": 1}


def test_fallbacks_are_counted_per_request_and_reset_stats_clears_them() -> None:
    """Each request that falls back adds one to its reason's count; reset_stats sets the
    counts and finished_requests back to nothing."""
    s = plain_scheduler(4)
    for rid in ("a", "b", "c"):
        s.queue(seq(rid, speculative=True, logprobs=1))
    s.queue(seq("d", speculative=True, presence_penalty=0.5))
    assert s.fallbacks == {"logprobs": 3, "penalties": 1}
    for x in s.admit():
        s.finish(x)
    assert s.finished_requests == 4
    s.reset_stats()
    assert s.fallbacks == {} and s.finished_requests == 0


# ------------------------------------------------------------------ finishing and aborts
def test_an_aborted_request_is_forgotten_and_never_collectable() -> None:
    """abort on a request holding a slot: the slot is free at once, the request is neither
    known nor finished (get and collect refuse it, finished_requests does not count it),
    and its id may be used again."""
    s = plain_scheduler(2)
    s.queue(seq("a"))
    s.admit()
    aborted = s.abort("a")
    assert aborted.finish_reason == "abort" and aborted.phase is Phase.FINISHED
    assert s.free_slots == [0, 1] and not s.has_unfinished() and s.finished_requests == 0
    with pytest.raises(RequestError, match="unknown request id 'a'"):
        s.get("a")
    with pytest.raises(RequestError, match="not finished"):
        s.collect("a")
    with pytest.raises(RequestError, match="unknown request id 'a'"):
        s.abort("a")
    s.check_new("a")


def test_a_finished_request_cannot_be_aborted_and_keeps_its_finish_reason() -> None:
    """Once finished a request is no longer live: abort refuses it as unknown and its finish
    reason stays the one its step set; it stays collectable."""
    s = plain_scheduler(2)
    a = finished(s, "a")
    with pytest.raises(RequestError, match="unknown request id 'a'"):
        s.abort("a")
    assert a.finish_reason == "length" and s.collect("a") is a


def test_running_leaves_out_rows_whose_step_set_a_finish_reason() -> None:
    """running: requests past prefill still decoding, in admission order; one whose finish
    reason is set (finished in the step, not yet released) is not among them."""
    s = plain_scheduler(3)
    for rid in ("a", "b", "c"):
        s.queue(seq(rid))
    for x in s.admit():
        x.phase = Phase.RUNNING
    s.get("b").finish_reason = "stop"
    assert ids(s.running()) == ["a", "c"]


def test_waiting_requests_alone_are_unfinished_work() -> None:
    """has_unfinished is true while a request waits for a slot though none holds one."""
    s = plain_scheduler(1)
    s.queue(seq("a"))
    assert s.has_unfinished() and not s.active


# ------------------------------------------------------------------ the prefill budget
def prefill_scheduler(budget: int, prompts: dict[str, int]) -> Scheduler:
    s = plain_scheduler(8, budget=budget)
    for rid, n in prompts.items():
        s.queue(seq(rid, n, speculative=True))
    s.admit()
    return s


def test_a_chunk_that_fills_what_is_left_exactly_still_runs() -> None:
    """A budget of two chunks and no decodes: the second prompt's chunk fits exactly in what
    the first left, so both run."""
    assert ids(prefill_scheduler(2 * CHUNK, {"a": 100, "b": 100}).prefilling()) == ["a", "b"]
    assert ids(prefill_scheduler(2 * CHUNK - 1, {"a": 100, "b": 100}).prefilling()) == ["a"]


def test_a_last_chunk_counts_its_first_verify_block_against_the_budget() -> None:
    """A prompt whose chunk ends it runs its first decode (a speculative request: a verify
    block) in the same step, so it needs its chunk and the block: 2 + 4 tokens do not fit in
    the 5 a full chunk left, and fit in 6."""
    assert ids(prefill_scheduler(CHUNK + 5, {"a": 100, "d": 2}).prefilling()) == ["a"]
    assert ids(prefill_scheduler(CHUNK + 6, {"a": 100, "d": 2}).prefilling()) == ["a", "d"]


# ------------------------------------------------------------------ the pooled cache's cells
def test_checking_room_never_takes_cells_from_the_allocator() -> None:
    """check_room tries the queued requests' runs on a copy: the allocator's runs are the same
    after it, and the request checked is then admitted to the run the check found."""
    cells = CellAllocator(8)
    s = plain_scheduler(3, "reject", 0, cells=cells, cells_needed=lambda q: 3)
    a = seq("a")
    s.check_room(a)
    assert cells.runs == {} and cells.free_cells == 8
    s.queue(a)
    b = seq("b")
    s.check_room(b)
    s.queue(b)
    assert cells.runs == {}
    assert [(x.request_id, x.cell) for x in s.admit()] == [("a", 0), ("b", 3)]
    assert cells.runs == {0: 3, 3: 3}


# ------------------------------------------------------------------ verify width
def costs(by_width: dict[int, float], rows: tuple[int, ...] = (1, 16, 64)) -> StepCosts:
    return StepCosts({(r, w): s * r for r in rows for w, s in by_width.items()}, measured=True)


def counts(accepted: int, steps: int = 40) -> SpecCounters:
    out = SpecCounters()
    for _ in range(steps):
        out.record(15, accepted, accepted + 1)
    return out


def test_a_block_of_one_token_has_the_plain_step_as_its_only_width() -> None:
    """B = 1 drafts nothing: `auto` and `fixed` alike offer W = 0 once."""
    for spacing in ("doublings", "halves", "every"):
        assert width_candidates(1, "auto", spacing=spacing) == (0,)
    assert width_candidates(1, "fixed") == (0,)
    assert VerifyWidth("auto", 1).candidates == (0,)


def test_a_cost_asked_for_is_the_one_of_its_own_rows_and_width() -> None:
    """of(rows, width) answers for that pair however the table was asked before: asking (1, 3)
    first and then (3, 1) gives each its own entry."""
    table = StepCosts({(1, 1): 2.0, (1, 3): 1.0, (3, 1): 5.0, (3, 3): 7.0}, measured=True)
    assert table.of(1, 3) == 1.0 and table.of(3, 1) == 5.0
    assert table.of(3, 3) == 7.0 and table.of(1, 1) == 2.0
    assert table.of(1, 3) == 1.0 and table.of(3, 1) == 5.0


def test_a_tie_goes_to_the_wider_width_also_when_nothing_is_expected() -> None:
    """best_width: among widths of equal tokens per second the wider wins, a tie at no
    expected tokens (no rows) included."""
    flat = StepCosts.flat((0, 1, 7))
    assert best_width({0: 0.0, 1: 0.0, 7: 0.0}, 1, flat) == 7
    assert best_width({0: 2.0, 1: 2.0, 7: 2.0}, 1, flat) == 7
    assert best_width({0: 2.0, 1: 3.0, 7: 3.0}, 1, flat) == 7


def test_costs_must_cover_the_narrowest_candidate_too() -> None:
    """Without plain steps the narrowest candidate is W = 1: a table lacking it is refused."""
    with pytest.raises(ConfigError, match=r"no entry for verify width\(s\) \[1\]"):
        VerifyWidth("auto", 16, costs({3: 1.0, 7: 1.2, 15: 2.0}), plain_step=False)


def test_every_run_of_plain_steps_is_as_long_as_the_probe_budget_says_from_the_first() -> None:
    """One row, a plain step costing 1: the first run of plain steps from a fresh chooser,
    every later one, and the first after reset have the same length, the fewest steps whose
    cost times PROBE_SHARE covers the probe's expected loss (within PROBE_AFTER..PROBE_LIMIT)."""
    table = costs({0: 1.0, 1: 2.5, 3: 3.0, 7: 4.0, 15: 6.0}, rows=(1,))
    low = counts(0)
    chooser = VerifyWidth("auto", 16, table)
    tokens = chooser.expected([15], [low], low)
    loss = probe_loss(tokens, 1, table, 1)
    run = max(PROBE_AFTER, min(PROBE_LIMIT, math.ceil(loss / (PROBE_SHARE * table.of(1, 0)))))
    assert 60 < run < PROBE_LIMIT

    def picks(n: int) -> list[int]:
        return [chooser.choose([15], [low], low) for _ in range(n)]

    assert picks(3 * (run + 1)) == ([0] * run + [1]) * 3
    chooser.reset()
    assert picks(run + 1) == [0] * run + [1]


def test_a_wider_probe_comes_after_the_narrow_steps_that_pay_for_its_expected_loss() -> None:
    """Rows that accept 5 draft tokens, costs under which W = 3 wins and W = 7 is the best
    wider width: a probe at 7 follows each run of n steps at 3, n the fewest (at least
    PROBE_AFTER) with PROBE_SHARE x n x cost(3) >= cost(7) - tokens(7) x cost(3) / tokens(3)."""
    table = costs({0: 10.0, 1: 1.9, 3: 2.0, 7: 3.3, 15: 6.0})
    seen = counts(5)
    chooser = VerifyWidth("auto", 16, table)
    tokens = chooser.expected([15] * 16, [seen] * 16, seen)
    loss = table.of(16, 7) - tokens[7] * table.of(16, 3) / tokens[3]
    run = max(PROBE_AFTER, math.ceil(loss / (PROBE_SHARE * table.of(16, 3))))
    assert run == 8
    widths = [chooser.choose([15] * 16, [seen] * 16, seen) for _ in range(3 * (run + 1))]
    assert widths == ([3] * run + [7]) * 3


def test_a_step_with_nothing_wider_to_probe_starts_the_narrow_run_afresh() -> None:
    """A step whose rows cannot commit past its width has no wider probe and ends the run of
    narrow steps: the steps after it wait PROBE_AFTER narrow steps again before a probe."""
    table = costs({0: 10.0, 1: 2.0, 3: 2.2, 7: 2.3, 15: 6.0})
    seen = counts(3)
    chooser = VerifyWidth("auto", 16, table)
    before = [chooser.choose([15] * 16, [seen] * 16, seen) for _ in range(PROBE_AFTER - 1)]
    assert before == [3] * (PROBE_AFTER - 1)
    assert chooser.choose([3] * 16, [seen] * 16, seen) == 3  # nothing wider the rows can use
    after = [chooser.choose([15] * 16, [seen] * 16, seen) for _ in range(PROBE_AFTER + 1)]
    assert after == [3] * PROBE_AFTER + [7]


def test_the_remembered_estimates_follow_new_counters_with_the_same_step_counts() -> None:
    """expected() keeps the last step's tokens only for the very same counters: engine totals
    or a row's counters replaced by others with as many steps but other counts give the
    estimates a fresh chooser computes for them."""
    table = costs({w: 1.0 + w / 8 for w in (0, 1, 3, 7, 15)})
    chooser = VerifyWidth("auto", 16, table)
    high, low = counts(15), counts(0)
    rows = [counts(15), counts(15)]
    first = chooser.expected([15, 15], rows, high)
    assert first == VerifyWidth("auto", 16, table).expected([15, 15], rows, high)
    other_totals = chooser.expected([15, 15], rows, low)
    assert other_totals == VerifyWidth("auto", 16, table).expected([15, 15], rows, low)
    assert other_totals != first
    swapped = [rows[0], counts(0)]
    got = chooser.expected([15, 15], swapped, low)
    assert got == VerifyWidth("auto", 16, table).expected([15, 15], swapped, low) != other_totals
