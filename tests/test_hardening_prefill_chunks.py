"""Prompt prefill (prefill.py) and the scheduler's part in it (scheduler.py), checked from
outside on small CPU shapes:

- batched first chunks: requests admitted together run their first chunks in one captured
  prefill (stand-in graphs running the real body, as in test_graphs.py), each chunk its own
  prompt's first `prefill_chunk` tokens; a batch whose rows end their prompts and rows that do
  not, greedy and sampled rows, first tokens read at once or left on the device: every output
  is the one the eager engine gives (plain greedy decode's for a greedy request).
- a batched prefill that raises is retried row by row from reset slots (a Gated DeltaNet
  target's recurrent state included), and a batch no graph holds runs eagerly; a request whose
  own chunk raises fails alone.
- the token budget (`max_num_batched_tokens`): every prompt still makes progress, the chunks
  stay on the grid of `prefill_chunk`, and outputs are plain greedy decode's.
- admission: slots go to waiting requests in arrival order as they free, every free one at
  once.

Outputs are compared with plain greedy decode of each request alone (`generate_plain`) on the
tiny float64 targets of test_engine.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.models import CausalLM
from reference_engine.models.dflash import DFlashDraft
from reference_engine.runtime.engine import Engine
from reference_engine.runtime.request import SamplingParams
from tests.test_engine import LONG_PROMPT, PROMPTS, drain, greedy, make_engine, reference
from tests.test_graphs import prefill_graphs

TinyPair = Callable[..., tuple[Path, Path]]
CHUNK = 16
SLOTS = 4  # the last one holds the stand-in graphs' padding rows


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def pair(request: pytest.FixtureRequest, tiny_pair: TinyPair) -> tuple[CausalLM, DFlashDraft]:
    target_dir, draft_dir = tiny_pair(request.param, block_size=8)
    target = load_target(target_dir, dtype=torch.float64)
    return target, load_draft(draft_dir, target)


def batched_engine(target: CausalLM, draft: DFlashDraft | None, **config) -> Engine:
    """An engine whose first chunks run batched in stand-in captured prefills."""
    engine = make_engine(target, draft, max_num_seqs=SLOTS, prefill_chunk=CHUNK, **config)
    prefill_graphs(engine, CHUNK, pad_slot=SLOTS - 1)
    return engine


def record_batches(engine: Engine) -> list[list[tuple[list[int], int, int]]]:
    """The chunks (ids, start, slot) of every batched prefill the engine runs."""
    batches: list[list[tuple[list[int], int, int]]] = []
    runner = engine.runner
    batch = runner.prefill_batch

    def recorded(chunks):
        batches.append([(list(ids), start, slot) for ids, start, slot in chunks])
        return batch(chunks)

    runner.prefill_batch = recorded
    return batches


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    drain(engine, limit=200)
    return {rid: engine.collect(rid).output_ids for rid in requests}


# ----------------------------------------------------------------------------- batched prefill
MIXED = {  # a long prompt first: the batch's rows that end their prompts are not its first rows
    "long": (LONG_PROMPT, greedy(9)),
    "short": (PROMPTS[1], greedy(7)),
    "mid": (PROMPTS[2], greedy(8)),
}


@pytest.mark.parametrize("defer", [False, True], ids=["read", "deferred"])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_a_batch_of_first_chunks_some_ending_their_prompts_gives_plain_greedy_output(
    pair: tuple[CausalLM, DFlashDraft], speculative: bool, defer: bool
) -> None:
    """A prompt of three chunks, one of one short chunk and one of two chunks run their first
    chunks in one batch: each row is its own prompt's first CHUNK tokens from position 0, the
    later chunks run one a step on the chunk grid, and each output (its first token from the
    batch's own row for it, read at once or left on the device) is plain greedy decode's."""
    target, draft = pair
    engine = batched_engine(target, draft if speculative else None)
    engine.prefill.defer_first = defer
    batches = record_batches(engine)
    for rid, (prompt, params) in MIXED.items():
        engine.add_request(rid, prompt, params)
    engine.step()
    assert batches == [[(prompt[:CHUNK], 0, slot) for slot, (prompt, _) in enumerate(MIXED.values())]]
    assert {rid: engine.get(rid).prefilled for rid in MIXED} == {"long": 16, "short": 5, "mid": 16}
    engine.step()
    assert {rid: engine.get(rid).prefilled for rid in MIXED} == {"long": 32, "short": 5, "mid": 20}
    drain(engine, limit=200)
    for rid, (prompt, params) in MIXED.items():
        assert engine.collect(rid).output_ids == reference(target, prompt, params), rid
    assert len(batches) == 1  # later chunks never run as first chunks


def test_a_sampled_row_in_a_batch_with_greedy_rows_is_sampled_as_the_eager_engine_samples_it(
    pair: tuple[CausalLM, DFlashDraft],
) -> None:
    """A seeded sampling request batched with greedy ones, each prompt in one chunk: its first
    token is drawn from its own row's distribution with its own generator, not the greedy rows'
    argmax, so its whole output is the eager engine's; the greedy ones stay plain greedy
    decode's."""
    target, _ = pair
    requests = {
        "g": (PROMPTS[1], greedy(6)),
        "s": (PROMPTS[0], SamplingParams(max_tokens=6, temperature=1.5, seed=11, ignore_eos=True)),
        "h": (PROMPTS[3], greedy(6)),
    }
    eager = run(make_engine(target, None, max_num_seqs=SLOTS, prefill_chunk=CHUNK), requests)
    engine = batched_engine(target, None)
    engine.prefill.defer_first = True
    batches = record_batches(engine)
    assert run(engine, requests) == eager
    assert [len(b) for b in batches] == [3]
    assert eager["g"] == reference(target, PROMPTS[1], greedy(6))
    assert eager["s"][0] != reference(target, PROMPTS[0], greedy(1))[0]  # it does sample


@pytest.mark.parametrize("written", [False, True], ids=["before-forward", "after-forward"])
def test_a_batched_prefill_that_raises_is_retried_row_by_row_from_fresh_state(
    pair: tuple[CausalLM, DFlashDraft], written: bool
) -> None:
    """A batch that raises (before its forward, or after it wrote its rows' state): every one of
    its requests runs its chunks again, eagerly from position 0 on a reset slot, and finishes
    with plain greedy decode's output (a Gated DeltaNet target's recurrent state would carry
    the failed batch's tokens otherwise)."""
    target, draft = pair
    engine = batched_engine(target, draft)
    runner = engine.runner
    batch, raised = runner.prefill_batch, []

    def failing(chunks):
        if not raised:
            raised.append(len(chunks))
            if written:
                batch(chunks)
            raise RuntimeError("device fault")
        return batch(chunks)

    runner.prefill_batch = failing
    for rid, (prompt, params) in MIXED.items():
        engine.add_request(rid, prompt, params)
    engine.step()
    assert raised == [3]  # and each request ran its first chunk in that very step all the same
    assert {rid: engine.get(rid).prefilled for rid in MIXED} == {"long": 16, "short": 5, "mid": 16}
    drain(engine, limit=200)
    for rid, (prompt, params) in MIXED.items():
        assert engine.collect(rid).output_ids == reference(target, prompt, params), rid


def test_a_batch_no_captured_prefill_holds_runs_its_rows_eagerly(pair: tuple[CausalLM, DFlashDraft]) -> None:
    """When no graph holds a batch (prefill_batch gives None) its rows run eagerly in the same
    step: every request still gets its chunks and plain greedy decode's output."""
    target, draft = pair
    engine = batched_engine(target, draft)
    engine.runner.prefill_batch = lambda chunks: None
    for rid, (prompt, params) in MIXED.items():
        engine.add_request(rid, prompt, params)
    engine.step()
    assert {rid: engine.get(rid).prefilled for rid in MIXED} == {"long": 16, "short": 5, "mid": 16}
    drain(engine, limit=200)
    for rid, (prompt, params) in MIXED.items():
        assert engine.collect(rid).output_ids == reference(target, prompt, params), rid


def test_a_request_whose_prompt_chunk_raises_fails_alone(pair: tuple[CausalLM, DFlashDraft]) -> None:
    """An exception in one request's prefill chunk ends that request with "error" and no token;
    the requests prefilling in the same step finish with plain greedy decode's output."""
    target, draft = pair
    engine = make_engine(target, draft, max_num_seqs=3, prefill_chunk=CHUNK)
    prefill = engine.runner.prefill

    def broken(ids, start, slot, speculative):
        if slot == 1 and start == CHUNK:  # the second chunk of the second request
            raise RuntimeError("device fault")
        return prefill(ids, start, slot, speculative)

    engine.runner.prefill = broken
    requests = {
        "a": (LONG_PROMPT, greedy(6)),
        "b": (LONG_PROMPT[5:], greedy(6)),
        "c": (PROMPTS[2], greedy(6)),
    }
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs = drain(engine, limit=200)
    assert [(o.new_token_ids, o.finish_reason) for o in outputs if o.request_id == "b"] == [([], "error")]
    for rid in ("a", "c"):
        prompt, params = requests[rid]
        assert engine.collect(rid).output_ids == reference(target, prompt, params), rid
    assert engine.collect("b").finish_reason == "error"


# ----------------------------------------------------------------------------- the token budget
def test_prompts_under_a_token_budget_stay_on_the_chunk_grid_and_give_plain_greedy_output(
    pair: tuple[CausalLM, DFlashDraft],
) -> None:
    """Under a budget of one chunk and a verify block, a running request, an old long prompt and
    later shorter ones: each chunk runs from a multiple of `prefill_chunk` (the eager engine's
    chunk calls), the oldest prompt runs a chunk every step, and every output is plain greedy
    decode's."""
    target, draft = pair
    engine = make_engine(target, draft, max_num_seqs=4, prefill_chunk=8, max_num_batched_tokens=16)
    calls: list[tuple[int, int, int]] = []
    prefill = engine.runner.prefill

    def spied(ids, start, slot, speculative):
        calls.append((slot, start, len(ids)))
        return prefill(ids, start, slot, speculative)

    engine.runner.prefill = spied
    requests = {
        "run": (PROMPTS[3], greedy(30)),
        "long": (LONG_PROMPT, greedy(5)),
        "mid": (PROMPTS[2], greedy(5)),
        "short": (PROMPTS[1], greedy(5)),
    }
    engine.add_request("run", *requests["run"])
    engine.step()
    for rid in ("long", "mid", "short"):
        engine.add_request(rid, *requests[rid])
    steps = 0
    while engine.get("long").prefilled < len(LONG_PROMPT):
        before = engine.get("long").prefilled
        engine.step()
        steps += 1
        assert engine.get("long").prefilled == min(before + 8, len(LONG_PROMPT))
    assert steps == 5
    for slot, start, n in calls:
        assert start % 8 == 0 and 0 < n <= 8, (slot, start, n)
    drain(engine, limit=300)
    for rid, (prompt, params) in requests.items():
        assert engine.collect(rid).output_ids == reference(target, prompt, params), rid


# ----------------------------------------------------------------------------- admission
def test_every_free_slot_takes_a_waiting_request_at_the_next_step_in_arrival_order(
    pair: tuple[CausalLM, DFlashDraft],
) -> None:
    """Five requests on two slots: the first step admits two at once, and as slots free the
    waiting ones take them oldest first; every output is plain greedy decode's."""
    target, _ = pair
    engine = make_engine(target, None, max_num_seqs=2, prefill_chunk=CHUNK)
    lengths = {"a": 3, "b": 3, "c": 6, "d": 2, "e": 4}
    for rid, n in lengths.items():
        engine.add_request(rid, PROMPTS[0][:4], greedy(n))
    started: dict[str, int] = {}
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            started.setdefault(out.request_id, step)
        step += 1
        assert step < 100
    assert list(started) == ["a", "b", "c", "d", "e"]
    # a and b end at their second step (the prefill's token and a decode's each step)
    assert (started["a"], started["b"], started["c"], started["d"], started["e"]) == (0, 0, 2, 2, 3)
    for rid, n in lengths.items():
        assert engine.collect(rid).output_ids == reference(target, PROMPTS[0][:4], greedy(n)), rid
