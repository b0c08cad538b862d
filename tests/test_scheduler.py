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
