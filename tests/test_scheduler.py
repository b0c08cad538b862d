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


def test_a_steps_tokens_stay_within_the_budget_counting_each_last_chunks_first_decode() -> None:
    """Random mixes: the decodes' tokens (a verify block per speculative row, one per plain
    row), every chosen chunk and, for a chunk that ends its prompt, the decode its first step
    runs in the same step, stay within the budget, unless the oldest prompt's chunk alone
    passes it; and a prompt left out would not have fit in what was left when its turn came."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        budget = rng.randint(CHUNK, 4 * CHUNK)
        running = {f"x{i}": rng.random() < 0.5 for i in range(rng.randint(0, 5))}
        prompts = {f"p{i}": rng.randint(1, 3 * CHUNK) for i in range(rng.randint(1, 5))}
        s = scheduler(budget, prompts, running)
        for seq in s.active.values():  # some prompts part-way through already
            if seq.phase is Phase.PREFILL:
                seq.prefilled = rng.randrange(0, len(seq.prompt_ids), CHUNK)

        def cost(seq: Sequence) -> int:
            tokens = min(CHUNK, len(seq.prompt_ids) - seq.prefilled)
            last = seq.prefilled + tokens == len(seq.prompt_ids)
            return tokens + (BLOCK if last else 0)  # every prompt here is speculative

        chosen = s.prefilling()
        left = budget - sum(BLOCK if speculative else 1 for speculative in running.values())
        prefilling = [seq for seq in s.active.values() if seq.phase is Phase.PREFILL]
        assert chosen and chosen[0] is prefilling[0]  # the oldest always runs
        for seq in prefilling:
            if seq in chosen:
                left -= cost(seq)
            else:
                assert cost(seq) > left, (budget, running, prompts)
        assert left >= 0 or len(chosen) == 1, (budget, running, prompts)


def test_an_aborted_waiting_request_leaves_the_queue_and_never_takes_a_slot() -> None:
    """abort on a request still waiting for a slot: it leaves the queue, so the slot freed
    next goes to the request behind it, and the aborted one is unknown afterwards."""
    s = Scheduler(1, "wait", 8, None, 8, CHUNK, None, BLOCK)
    for rid in ("x", "w", "z"):
        s.queue(Sequence(rid, [1], SamplingParams(max_tokens=8), frozenset(), 0.0, False))
    assert ids(s.admit()) == ["x"]
    aborted = s.abort("w")
    assert aborted.phase is Phase.FINISHED and aborted.finish_reason == "abort" and aborted.slot is None
    assert ids(list(s.waiting)) == ["z"]
    s.finish(s.get("x"))
    assert ids(s.admit()) == ["z"] and s.get("z").slot == 0
    assert not s.waiting and aborted.slot is None


def test_low_acceptance_falls_back_once_after_steps_have_run_and_not_at_the_threshold() -> None:
    """check_low_acceptance: a speculative request is judged only once it has run
    `fallback_after_steps` steps (none before), and falls back only when its mean acceptance
    length is below the threshold (a mean exactly at it keeps drafting)."""
    s = Scheduler(2, "wait", 8, 2.0, 3, CHUNK, None, BLOCK)
    low = Sequence("low", [1], SamplingParams(max_tokens=8), frozenset(), 0.0, True)
    even = Sequence("even", [1], SamplingParams(max_tokens=8), frozenset(), 0.0, True)
    for seq in (low, even):
        s.queue(seq)
    for step in range(3):
        low.record_step(3, 0, 1, [5, 5, 5])  # acceptance length 1 every step
        even.record_step(3, 1, 2, [5, 5, 5])  # exactly the threshold, 2
        s.check_low_acceptance(low)
        s.check_low_acceptance(even)
        assert low.speculative == (step < 2)  # judged at the third step, not before
    assert low.fallback_reason == "low_acceptance" and s.fallbacks == {"low_acceptance": 1}
    assert even.speculative and even.fallback_reason is None
