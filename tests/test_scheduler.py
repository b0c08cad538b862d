"""The scheduler's token budget: which prefilling requests run a chunk beside the decodes."""

from __future__ import annotations

from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.scheduler import Scheduler
from reference_engine.runtime.sequence import Phase, Sequence

CHUNK, BLOCK = 16, 4


def scheduler(budget: int | None, prompts: dict[str, int], running: dict[str, bool]) -> Scheduler:
    """Requests `running` (id -> speculative) already decoding, then `prompts` (id -> prompt
    length) prefilling, admitted in that order."""
    s = Scheduler(8, "wait", 8, None, 8, CHUNK, budget, BLOCK)
    for rid, speculative in running.items():
        s.queue(Sequence(rid, [1], SamplingParams(max_tokens=8), frozenset(), 0.0, speculative))
    for rid, n in prompts.items():
        s.queue(Sequence(rid, [1] * n, SamplingParams(max_tokens=8), frozenset(), 0.0, True))
    for seq in s.admit():
        if seq.request_id in running:
            seq.phase = Phase.RUNNING
    return s


def ids(seqs: list[Sequence]) -> list[str]:
    return [s.request_id for s in seqs]


def test_without_a_budget_every_prefilling_request_runs_a_chunk() -> None:
    assert ids(scheduler(None, {"a": 100, "b": 100, "c": 5}, {"x": True}).prefilling()) == ["a", "b", "c"]


def test_chunks_fit_what_the_decodes_leave_and_a_shorter_later_one_may_still_fit() -> None:
    # 43 - (4 + 1) decode tokens = 38: a (16) and b (16) fit; c's chunk (16) does not in the 6
    # left, d's last chunk does (2 tokens and the verify block of 4 its first step runs)
    s = scheduler(43, {"a": 100, "b": 100, "c": 100, "d": 2}, {"x": True, "y": False})
    assert ids(s.prefilling()) == ["a", "b", "d"]


def test_the_oldest_prompt_runs_its_chunk_even_past_the_budget() -> None:
    s = scheduler(CHUNK, {"a": 100, "b": 100}, {f"x{i}": True for i in range(4)})
    assert ids(s.prefilling()) == ["a"]


def test_a_request_may_join_the_next_step_when_it_can_get_a_slot_or_ends_its_prefill() -> None:
    """may_join_next (whether the next step's draft may be queued ahead): a waiting request
    counts only with a slot for it (free now, or freed by a request already finished); a
    prefilling one only with at most a chunk of its prompt left."""
    full = Scheduler(2, "wait", 8, None, 8, CHUNK, None, BLOCK)
    for rid in ("x", "y", "z"):
        full.queue(Sequence(rid, [1], SamplingParams(max_tokens=8), frozenset(), 0.0, True))
    for seq in full.admit():
        seq.phase = Phase.RUNNING
    assert ids(list(full.waiting)) == ["z"] and not full.may_join_next()  # no slot for z
    full.get("x").finish_reason = "length"  # finished before the step: its slot frees at its end
    assert full.may_join_next()

    assert not scheduler(None, {}, {"x": True}).may_join_next()
    assert not scheduler(None, {"a": CHUNK + 1}, {"x": True}).may_join_next()  # two chunks left
    assert scheduler(None, {"a": CHUNK}, {"x": True}).may_join_next()  # its last chunk
    free = scheduler(None, {}, {"x": True})
    free.queue(Sequence("w", [1], SamplingParams(max_tokens=8), frozenset(), 0.0, True))
    assert free.may_join_next()  # a free slot for w
