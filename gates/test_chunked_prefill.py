"""Gate: chunked prefill shares steps with the requests that are decoding. Long prompts arrive
while short requests decode, prefilling one chunk a step; every request already decoding gets
tokens in every step of that prefill, and every request's output equals plain greedy decode
alone. With a token budget (`max_num_batched_tokens`) no step runs more target tokens than the
budget, except the oldest prompt's one chunk, which always runs. Planted faults: a
prefill-first scheduler (decodes wait while a prompt prefills; lossless, so only the
every-step check can see it) and a scheduler that runs every prompt's chunk past the budget."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.model_runner import ModelRunner
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.sequence import Phase

from .checks import Pair, require_block
from .faults import planted
from .hooks import hooked

CATCHES = ("decodes_wait_for_prefill", "prefill_past_token_budget", "last_chunk_budgeted_without_its_block")
BLOCK = 8
CHUNK = 16
SHORT = (3, 11)  # prompt lengths: one chunk each
LONG = (70, 100)  # 5 and 7 chunks
# the short requests outlast the long prefills even at a full block a step
SHORT_PARAMS = SamplingParams(max_tokens=BLOCK * sum(-(-n // CHUNK) for n in LONG) + 8, ignore_eos=True)
LONG_PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
# room for the short requests' verify blocks and one chunk: a second chunk never fits
BUDGET = len(SHORT) * BLOCK + CHUNK
# room for the verify blocks, one chunk and 6 tokens more: a LATE-token prompt arriving while a
# long one prefills fits only if its first verify block, which runs in the same step, is left out
LATE = 4
TIGHT = BUDGET + 6


@dataclass
class Mix:
    outputs: dict[str, list[int]]
    stalls: list[str] = field(default_factory=list)  # "step N: request X got no token"
    checked: int = 0  # (step, decoding request) pairs of a step that ran a long prompt's chunk
    over_budget: list[str] = field(default_factory=list)  # steps past the budget, with their tokens


def prompts(pair: Pair, late: bool = False) -> dict[str, tuple[int, ...]]:
    rng = random.Random(29)
    vocab = pair.target.config.vocab_size - 16
    lengths = {f"short{i}": n for i, n in enumerate(SHORT)} | {f"long{i}": n for i, n in enumerate(LONG)}
    if late:
        lengths["late"] = LATE
    return {rid: tuple(rng.randrange(vocab) for _ in range(n)) for rid, n in lengths.items()}


def run_mix(pair: Pair, speculative: bool, budget: int | None, late: bool = False) -> Mix:
    """The short requests first; once they decode, both long prompts at once (with `late`, a
    short prompt a step later). Records what each step gave each request and how many target
    tokens its forwards ran."""
    config = EngineConfig(
        max_num_seqs=4 + late,
        block_size=BLOCK if speculative else None,
        prefill_chunk=CHUNK,
        max_num_batched_tokens=budget,
        numerics=pair.numerics,
    )
    engine = Engine(pair.target, pair.draft if speculative else None, config)
    tokens: list[int] = []  # target tokens the current step's forwards ran
    chunks: list[int] = []

    def counted(rows, into: list[int]):
        def wrap(correct):
            def forward(self, *args, **kwargs):
                into.append(rows(*args))
                return correct(self, *args, **kwargs)

            return forward

        return wrap

    hooks = (
        (ModelRunner, "prefill", counted(lambda ids, *_: len(ids), chunks)),
        (ModelRunner, "prefill_batch", counted(lambda batch: sum(len(ids) for ids, _, _ in batch), chunks)),
        (ModelRunner, "decode", counted(lambda ids, *_: ids.shape[0], tokens)),
        (ModelRunner, "verify", counted(lambda block, *_: block.numel(), tokens)),
    )
    all_prompts = prompts(pair, late)
    longs = [rid for rid in all_prompts if rid.startswith("long")]
    mix = Mix({rid: [] for rid in all_prompts})
    added: list[str] = []
    with hooked(*hooks):
        for rid in all_prompts:
            if rid.startswith("short"):
                engine.add_request(rid, list(all_prompts[rid]), SHORT_PARAMS)
                added.append(rid)
        step = 0
        while engine.has_unfinished():
            if step == 2:  # the short requests decode by now
                for rid in longs:
                    engine.add_request(rid, list(all_prompts[rid]), LONG_PARAMS)
                    added.append(rid)
            if step == 3 and late:  # while both long prompts prefill
                engine.add_request("late", list(all_prompts["late"]), LONG_PARAMS)
                added.append("late")
            seqs = [engine.get(rid) for rid in added]
            decoding = [s.request_id for s in seqs if s.phase is Phase.RUNNING and s.finish_reason is None]
            before = {s.request_id: s.prefilled for s in seqs}
            tokens.clear()
            chunks.clear()
            got = dict.fromkeys(all_prompts, 0)
            for out in engine.step():
                mix.outputs[out.request_id].extend(out.new_token_ids)
                got[out.request_id] += len(out.new_token_ids)
            long_prefilled = any(
                engine.get(rid).prefilled > before.get(rid, 0) for rid in longs if rid in added
            )
            if long_prefilled:
                mix.checked += len(decoding)
                mix.stalls += [f"step {step}: {rid} got no token" for rid in decoding if not got[rid]]
            ran = sum(tokens) + sum(chunks)
            if budget is not None and len(chunks) > 1 and ran > budget:
                mix.over_budget.append(f"step {step}: {ran} tokens ({len(chunks)} chunks)")
            step += 1
    return mix


_plain: dict[tuple[str, bool], dict[str, list[int]]] = {}


def plain_outputs(pair: Pair, late: bool = False) -> dict[str, list[int]]:
    if (pair.name, late) in _plain:
        return _plain[pair.name, late]
    _plain[pair.name, late] = {
        rid: generate_plain(
            pair.target, list(ids), SHORT_PARAMS if rid.startswith("short") else LONG_PARAMS
        ).output_ids
        for rid, ids in prompts(pair, late).items()
    }
    return _plain[pair.name, late]


def assert_shares_steps(pair: Pair, speculative: bool, budget: int | None, late: bool = False) -> Mix:
    mix = run_mix(pair, speculative, budget, late)
    assert not mix.stalls, (
        f"{pair.name}: decoding requests stalled while a long prompt prefilled: {mix.stalls}"
    )
    # both long prompts' chunks, one step each at least, with both short requests decoding
    assert mix.checked >= len(SHORT) * max(-(-n // CHUNK) for n in LONG)
    assert not mix.over_budget, f"{pair.name}: steps past the budget of {budget} tokens: {mix.over_budget}"
    return mix


@pytest.mark.parametrize("budget", [None, BUDGET])
@pytest.mark.parametrize("mode", ["plain", "dflash"])
def test_decoding_requests_get_tokens_every_step_of_a_long_prefill(pair: Pair, mode: str, budget) -> None:
    require_block(pair, BLOCK)
    mix = assert_shares_steps(pair, mode == "dflash", budget)
    assert mix.outputs == plain_outputs(pair), f"{pair.name}: output != plain greedy beside a long prefill"


def test_a_prefill_first_scheduler_is_caught(pair: Pair) -> None:
    require_block(pair, BLOCK)
    with planted("decodes_wait_for_prefill"), pytest.raises(AssertionError, match="stalled"):
        assert_shares_steps(pair, False, None)


def test_prefill_past_the_token_budget_is_caught(pair: Pair) -> None:
    require_block(pair, BLOCK)
    with planted("prefill_past_token_budget"), pytest.raises(AssertionError, match="past the budget"):
        assert_shares_steps(pair, False, BUDGET)


def test_a_last_chunk_is_budgeted_with_the_block_it_runs(pair: Pair) -> None:
    """A short prompt arriving while the long ones prefill: its chunk runs in a step only with
    room for the verify block its request runs in that same step."""
    require_block(pair, BLOCK)
    mix = assert_shares_steps(pair, True, TIGHT, late=True)
    assert mix.outputs == plain_outputs(pair, late=True), f"{pair.name}: output != plain greedy"


def test_a_last_chunk_budgeted_without_its_block_is_caught(pair: Pair) -> None:
    require_block(pair, BLOCK)
    with (
        planted("last_chunk_budgeted_without_its_block"),
        pytest.raises(AssertionError, match="past the budget"),
    ):
        assert_shares_steps(pair, True, TIGHT, late=True)
