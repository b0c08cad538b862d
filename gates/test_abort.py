"""Gate: an aborted request leaves nothing behind.

Requests are aborted in each phase of their life in one run: one waiting for a slot, one
between two chunks of its prompt, and one decoding (after a plain or a DFlash step), on the
per-slot cache and on a pooled one. When the engine has drained, it holds what a fresh engine
holds (every slot and cell free, no request known or finished and uncollected, no deferred
draft context, an empty cache), each aborted id can be used again, the request running beside
them and the ones that reuse the ids give plain greedy's output, and the statistics count the
requests that finished, not those aborted; with every step a plain one (verify width 0) the
request aborted while it decodes holds deferred draft context, which the drained engine must
not. Planted faults: an abort between two prompt chunks that keeps its slot
(`abort_mid_prefill_keeps_slot`), a release that forgets an aborted request's cells
(`abort_keeps_cells`) and an abort that keeps the draft context its plain steps deferred
(`abort_keeps_draft_context`)."""

from __future__ import annotations

import random

import pytest

from reference_engine.errors import RequestError
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.sequence import Phase
from reference_engine.runtime.verify_width import StepCosts

from .checks import Pair
from .faults import planted

CATCHES = ("abort_mid_prefill_keeps_slot", "abort_keeps_cells", "abort_keeps_draft_context")
BLOCK = 8
CHUNK = 8  # prompt tokens a step: a 40-token prompt takes five steps
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


def prompt(pair: Pair, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(pair.target.config.vocab_size - 16) for _ in range(length)]


# verify-width costs under which every step is a plain step (width 0): the anchor's draft
# context is then deferred (DeferredContext) when a request is aborted or ends
PLAIN_STEPS = StepCosts(
    {(rows, w): 1.0 if w == 0 else 50.0 for rows in (1, 2) for w in (0, 1, 3, 7)}, measured=True
)


def make_engine(pair: Pair, speculative: bool, pooled: bool, step_costs: StepCosts | None = None) -> Engine:
    config = EngineConfig(
        max_num_seqs=2,
        block_size=BLOCK if speculative else None,
        max_model_len=96,
        prefill_chunk=CHUNK,
        kv_cache_tokens=256 if pooled else None,
        kv_cell_tokens=8,
        numerics=pair.numerics,
    )
    return Engine(pair.target, pair.draft if speculative else None, config, step_costs=step_costs)


def footprint(engine: Engine) -> dict:
    """What an idle engine holds: equal to a fresh engine's once every request is done."""
    scheduler = engine.scheduler
    step = engine.speculative_step
    return {
        "free slots": sorted(scheduler.free_slots),
        "free cells": None if scheduler.cells is None else scheduler.cells.free_cells,
        "known": sorted(scheduler.known),
        "active": sorted(scheduler.active),
        "waiting": [s.request_id for s in scheduler.waiting],
        "finished, uncollected": sorted(scheduler.finished),
        "deferred draft context": 0 if step is None else len(step.deferred),
        "kv cache usage": engine.kv_cache_usage(),
        "unfinished": engine.has_unfinished(),
    }


def step_until(engine: Engine, done, limit: int = 64) -> None:
    for _ in range(limit):
        if done():
            return
        engine.step()
    raise AssertionError("the run never reached the phase the gate aborts in")


def assert_abort_leaves_nothing(
    pair: Pair, speculative: bool, pooled: bool, step_costs: StepCosts | None = None
) -> None:
    engine = make_engine(pair, speculative, pooled, step_costs)
    fresh = footprint(engine)
    prompts = {
        name: prompt(pair, n, seed) for seed, (name, n) in enumerate((("keep", 6), ("long", 40), ("wait", 5)))
    }
    prompts["late"] = prompt(pair, 7, 9)
    for name in ("keep", "long", "wait"):
        engine.add_request(name, prompts[name], PARAMS)
    engine.step()
    scheduler = engine.scheduler
    phases = {name: scheduler.get(name).phase for name in ("long", "wait")}
    assert phases == {"long": Phase.PREFILL, "wait": Phase.WAITING}, phases
    engine.abort("wait")
    engine.abort("long")  # between two of its prompt's chunks
    engine.add_request("late", prompts["late"], PARAMS)  # takes the slot "long" left
    step_until(engine, lambda: len(engine.get("late").output_ids) >= 2)
    assert engine.get("late").phase is Phase.RUNNING
    if step_costs is PLAIN_STEPS:  # it holds the draft context its plain steps deferred
        assert id(engine.get("late")) in engine.speculative_step.deferred, "no plain step deferred context"
    engine.abort("late")  # decoding, after a step (plain or DFlash)
    reused = {name: prompt(pair, 5 + i, 20 + i) for i, name in enumerate(("long", "wait", "late"))}
    for name, ids in reused.items():  # an aborted id is free for a new request
        try:
            engine.add_request(name, ids, PARAMS)
        except RequestError as exc:
            raise AssertionError(f"an aborted request left something behind: its id {name!r}: {exc}") from exc
    while engine.has_unfinished():
        engine.step()
    finished = engine.stats()["requests_finished"]
    outputs = {name: engine.collect(name).output_ids for name in ("keep", *reused)}
    left = footprint(engine)
    assert left == fresh, f"an aborted request left something behind: {left} != fresh {fresh}"
    assert finished == 4, f"requests_finished {finished}: 4 requests finished, 3 were aborted"
    for name, ids in {"keep": prompts["keep"], **reused}.items():
        want = generate_plain(pair.target, ids, PARAMS, numerics=pair.numerics).output_ids
        assert outputs[name] == want, f"{name}: output != plain greedy after an abort beside it"


@pytest.mark.parametrize("pooled", [False, True], ids=["slots", "pooled"])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_an_aborted_request_leaves_nothing_behind(pair: Pair, speculative: bool, pooled: bool) -> None:
    assert_abort_leaves_nothing(pair, speculative, pooled)


def test_the_gate_catches_an_abort_between_prompt_chunks_that_keeps_its_slot(pair: Pair) -> None:
    with (
        planted("abort_mid_prefill_keeps_slot"),
        pytest.raises(AssertionError, match="left something behind"),
    ):
        assert_abort_leaves_nothing(pair, speculative=True, pooled=False)


def test_the_gate_catches_a_release_that_forgets_an_aborted_requests_cells(pair: Pair) -> None:
    with planted("abort_keeps_cells"), pytest.raises(AssertionError, match="left something behind"):
        assert_abort_leaves_nothing(pair, speculative=True, pooled=True)


def test_an_abort_after_plain_steps_leaves_no_draft_context(pair: Pair) -> None:
    """Every step a plain one (verify width 0): the aborted request holds deferred draft
    context, and the drained engine holds none."""
    assert_abort_leaves_nothing(pair, speculative=True, pooled=False, step_costs=PLAIN_STEPS)


def test_the_gate_catches_an_abort_that_keeps_the_deferred_draft_context(pair: Pair) -> None:
    with planted("abort_keeps_draft_context"), pytest.raises(AssertionError, match="left something behind"):
        assert_abort_leaves_nothing(pair, speculative=True, pooled=False, step_costs=PLAIN_STEPS)
