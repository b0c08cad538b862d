"""Small contracts of the runtime's CPU helpers, checked on the classes and functions directly:
which sampling options send a speculative request to plain decode and under which reason the
scheduler counts it, that a pooled cache's run goes back to the allocator (and the request
holds no cell) when the request ends, the oracle proposer's schedule (capped at the tokens a
block drafts, the asked mean acceptance length, a wrong token that stays in the vocabulary),
the greedy bound of the temperature, and the seeds a request's generator takes."""

from __future__ import annotations

import pytest
import torch

from reference_engine.errors import ConfigError, RequestError
from reference_engine.runtime.kv_pool import CellAllocator
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.request import GREEDY_BELOW, SEED_RANGE, SamplingParams, new_generator
from reference_engine.runtime.scheduler import EngineFullError, Scheduler
from reference_engine.runtime.sequence import Phase, Sequence

CHUNK = 16


def sequence(rid: str, params: SamplingParams | None = None, speculative: bool = True) -> Sequence:
    return Sequence(rid, [1, 2, 3], params or SamplingParams(max_tokens=8), frozenset(), 0.0, speculative)


# ------------------------------------------------------------------ scheduler.py
@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"logprobs": 2}, "logprobs"),
        ({"repetition_penalty": 1.2}, "sampling_option"),
        ({"repetition_penalty": 0.5}, "sampling_option"),
        ({"presence_penalty": 0.5}, "penalties"),
        ({"frequency_penalty": -0.5}, "penalties"),
        ({"logit_bias": ((3, 1.0),)}, "penalties"),
    ],
)
def test_a_speculative_request_asking_for_a_plain_decode_option_falls_back_under_its_reason(
    options: dict, reason: str
) -> None:
    """queue: a speculative request that asks for logprobs, any repetition penalty other than
    1 (below 1 as well as above), or a presence/frequency penalty or logit bias leaves the
    speculative path at once, with the reason that names what it asked for; a plain request
    asking the same counts no fallback, and a speculative one asking nothing stays."""
    s = Scheduler(4, "wait", 8, None, 8, CHUNK, None, 4)
    seq = sequence("r", SamplingParams(max_tokens=8, **options))
    s.queue(seq)
    assert not seq.speculative and seq.fallback_reason == reason
    assert s.fallbacks == {reason: 1}
    plain = sequence("p", SamplingParams(max_tokens=8, **options), speculative=False)
    s.queue(plain)
    assert plain.fallback_reason is None and s.fallbacks == {reason: 1}
    kept = sequence("k")
    s.queue(kept)
    assert kept.speculative and kept.fallback_reason is None and s.fallbacks == {reason: 1}


def test_a_request_that_ends_gives_its_run_of_cells_back_and_holds_no_cell() -> None:
    """With a pooled cache, a finished request and an aborted one both return their run to
    the allocator and keep no cell of it (a stale cell would name rows another request may
    now hold); the freed run is the one the next admission takes."""
    cells = CellAllocator(8)
    s = Scheduler(2, "wait", 8, None, 8, CHUNK, None, 0, cells=cells, cells_needed=lambda seq: 3)
    for rid in ("a", "b", "c"):
        s.queue(sequence(rid, speculative=False))
    a, b = s.admit()
    assert (a.cell, b.cell) == (0, 3) and cells.free_cells == 2
    s.finish(a)
    assert a.cell is None and a.phase is Phase.FINISHED and cells.free_cells == 5
    (c,) = s.admit()
    assert c.request_id == "c" and c.cell == 0 and cells.free_cells == 2
    aborted = s.abort("b")
    assert aborted.cell is None and cells.free_cells == 5 and cells.runs == {0: 3}


# ------------------------------------------------------------------ oracle.py
def test_the_oracle_never_schedules_more_accepted_tokens_than_the_block_drafts() -> None:
    """scheduled(step, n): the schedule's count for the step, cut at the n tokens the step
    drafts (a forced oracle takes it as accepted, so more than n would commit tokens no one
    proposed); the schedule repeats with its period."""
    oracle = OracleProposer([1, 2, 3, 4], [5, 0, 2], 10, forced=True)
    assert [oracle.scheduled(step, 3) for step in range(6)] == [3, 0, 2, 3, 0, 2]
    assert oracle.scheduled(0, 7) == 5 and oracle.scheduled(2, 1) == 1 and oracle.scheduled(0, 0) == 0


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_an_oracle_schedule_has_the_mean_acceptance_length_it_was_asked_for(block_size: int) -> None:
    """for_mean_acceptance: every mean in [1, B] on a grid of 0.05 (what a command line asks,
    e.g. 2.3 or 6.45) gives a schedule whose mean acceptance length, bonus included, is that
    mean exactly, with accepted counts floor(m) and floor(m) + 1 only (m = mean - 1); the
    bounds 1 and B are accepted, and a mean outside them is refused."""
    for i in range(20 * (block_size - 1) + 1):
        mean = float(f"{1 + i / 20:.2f}")  # as typed: 1.0, 1.05, ..., 2.3, ...
        schedule = OracleProposer.for_mean_acceptance([], mean, block_size, 50).schedule
        assert 1 + sum(schedule) / len(schedule) == pytest.approx(mean, abs=1e-9), (mean, schedule)
        low = i // 20
        assert set(schedule) <= {low, low + 1}, (mean, schedule)
    assert (
        OracleProposer.for_mean_acceptance([], block_size, block_size, 50).schedule == [block_size - 1] * 20
    )
    assert set(OracleProposer.for_mean_acceptance([], 1.0, block_size, 50).schedule) == {0}
    for mean in (0.99, block_size + 0.01):
        with pytest.raises(ConfigError, match=f"must be in \\[1, {block_size}\\]"):
            OracleProposer.for_mean_acceptance([], mean, block_size, 50)


def test_the_oracles_wrong_token_is_a_different_token_inside_the_vocabulary() -> None:
    """propose: the slot after the scheduled count holds a token other than the true one, and
    that token stays in [0, vocab) when the true one is the last id of the vocabulary (it
    wraps to 0); the slots before it hold the continuation."""
    vocab = 10
    oracle = OracleProposer([4, vocab - 1, vocab - 1, 7], [1], vocab)
    proposed = oracle.propose(0, 1, 3)  # slots 1..3 after 1 token out: truth [9, 9, 7]
    assert proposed == [vocab - 1, 0, 7]
    past_the_end = oracle.propose(0, 3, 3)  # the continuation runs out after one token
    assert len(past_the_end) == 3 and past_the_end[0] == 7 and all(0 <= t < vocab for t in past_the_end)


# ------------------------------------------------------------------ request.py
def test_a_temperature_at_the_greedy_bound_samples_and_one_below_it_is_greedy() -> None:
    """greedy: a temperature below GREEDY_BELOW is served as greedy; GREEDY_BELOW itself is
    not below it, so it samples (and so stays off the device-argmax path)."""
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
    assert not SamplingParams(temperature=GREEDY_BELOW).argmax_only
    assert SamplingParams(temperature=GREEDY_BELOW * 0.99).greedy
    assert SamplingParams(temperature=GREEDY_BELOW * 0.99).argmax_only


def test_seeds_at_both_ends_of_the_int64_range_are_taken_and_one_past_is_refused() -> None:
    """seed: every int64 is a seed, both ends included, and builds the request's generator;
    one past either end is refused with the range in the message."""
    low, high = SEED_RANGE
    assert (low, high) == (-(2**63), 2**63 - 1)
    for seed in (low, high, 0):
        assert SamplingParams(seed=seed).seed == seed
        new_generator(torch.device("cpu"), seed)
    for seed in (low - 1, high + 1):
        with pytest.raises(RequestError, match=r"seed must be an integer in \[-2\*\*63, 2\*\*63 - 1\]"):
            SamplingParams(seed=seed)


def test_an_unseeded_generator_draws_a_fresh_seed_and_a_seeded_one_repeats() -> None:
    """new_generator: without a seed each request's generator starts from fresh entropy (two
    requests do not draw the same numbers); with one, two generators draw the same."""
    cpu = torch.device("cpu")
    first, second = new_generator(cpu, None), new_generator(cpu, None)
    assert first.initial_seed() != second.initial_seed()
    assert not torch.equal(torch.rand(8, generator=first), torch.rand(8, generator=second))
    again = [torch.rand(8, generator=new_generator(cpu, 1234)) for _ in range(2)]
    assert torch.equal(again[0], again[1])


def test_reject_refuses_a_request_that_would_wait_for_cells_with_a_slot_free() -> None:
    """Admission `reject` with a pooled cache: a request whose run of cells is not free (the
    requests queued before it taking theirs first) is refused at once, naming the cells, though
    a slot is free; under `wait` it queues; one that fits is taken."""
    cells = CellAllocator(4)
    s = Scheduler(3, "reject", 0, None, 8, CHUNK, None, 0, cells=cells, cells_needed=lambda seq: 3)
    a = sequence("a", speculative=False)
    s.check_room(a)
    s.queue(a)
    s.admit()
    b = sequence("b", speculative=False)
    with pytest.raises(
        EngineFullError, match=r"no free run of 3 KV cache cells for request 'b' \(1 of 4 free"
    ):
        s.check_room(b)
    assert s.free_slots == [1, 2] and not s.waiting
    small = Scheduler(
        3, "reject", 0, None, 8, CHUNK, None, 0, cells=CellAllocator(6), cells_needed=lambda q: 3
    )
    first, second, third = (sequence(r, speculative=False) for r in "xyz")
    for seq in (first, second):
        small.check_room(seq)
        small.queue(seq)  # both queued, not yet admitted: their runs are promised
    with pytest.raises(EngineFullError, match="'z'"):
        small.check_room(third)
    waiting = Scheduler(
        3, "wait", 8, None, 8, CHUNK, None, 0, cells=CellAllocator(4), cells_needed=lambda q: 3
    )
    waiting.queue(sequence("a", speculative=False))
    waiting.admit()
    waiting.check_room(sequence("b", speculative=False))  # it may wait


def test_an_engine_under_reject_refuses_a_request_its_pooled_cache_cannot_hold_now(tiny_checkpoint) -> None:
    """The engine asks the scheduler before it queues: with a pool of 4 cells of 16 tokens and
    requests of 3 cells each, the second is refused while the first holds its run, and taken
    once the first has ended."""
    from reference_engine.checkpoint import load_target
    from reference_engine.runtime.engine import Engine, EngineConfig

    target = load_target(tiny_checkpoint("qwen3"), dtype=torch.float64)
    config = EngineConfig(
        max_num_seqs=3, admission="reject", kv_cache_tokens=64, kv_cell_tokens=16, max_model_len=48
    )
    engine = Engine(target, None, config)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.step()
    with pytest.raises(EngineFullError, match="KV cache cells"):
        engine.add_request("b", [1, 2, 3], params)
    while engine.has_unfinished():
        engine.step()
    engine.collect("a")
    engine.add_request("b", [1, 2, 3], params)
