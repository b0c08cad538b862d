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

CATCHES = ("decodes_wait_for_prefill", "prefill_past_token_budget")
BLOCK = 8
CHUNK = 16
SHORT = (3, 11)  # prompt lengths: one chunk each
LONG = (70, 100)  # 5 and 7 chunks
# the short requests outlast the long prefills even at a full block a step
SHORT_PARAMS = SamplingParams(max_tokens=BLOCK * sum(-(-n // CHUNK) for n in LONG) + 8, ignore_eos=True)
LONG_PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
# room for the short requests' verify blocks and one chunk: a second chunk never fits
BUDGET = len(SHORT) * BLOCK + CHUNK


@dataclass
class Mix:
    outputs: dict[str, list[int]]
    stalls: list[str] = field(default_factory=list)  # "step N: request X got no token"
    checked: int = 0  # (step, decoding request) pairs of a step that ran a long prompt's chunk
    over_budget: list[str] = field(default_factory=list)  # steps past the budget, with their tokens


def prompts(pair: Pair) -> dict[str, tuple[int, ...]]:
    rng = random.Random(29)
    vocab = pair.target.config.vocab_size - 16
    lengths = {f"short{i}": n for i, n in enumerate(SHORT)} | {f"long{i}": n for i, n in enumerate(LONG)}
    return {rid: tuple(rng.randrange(vocab) for _ in range(n)) for rid, n in lengths.items()}


def run_mix(pair: Pair, speculative: bool, budget: int | None) -> Mix:
    """The short requests first; once they decode, both long prompts at once. Records what
    each step gave each request and how many target tokens its forwards ran."""
    config = EngineConfig(
        max_num_seqs=4,
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
    all_prompts = prompts(pair)
    longs = [rid for rid in all_prompts if rid.startswith("long")]
    mix = Mix({rid: [] for rid in all_prompts})
    added: list[str] = []
    with hooked(*hooks):
        for rid in all_prompts:
            if rid not in longs:
                engine.add_request(rid, list(all_prompts[rid]), SHORT_PARAMS)
                added.append(rid)
        step = 0
        while engine.has_unfinished():
            if step == 2:  # the short requests decode by now
                for rid in longs:
                    engine.add_request(rid, list(all_prompts[rid]), LONG_PARAMS)
                    added.append(rid)
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


_plain: dict[str, dict[str, list[int]]] = {}


def plain_outputs(pair: Pair) -> dict[str, list[int]]:
    if pair.name in _plain:
        return _plain[pair.name]
    _plain[pair.name] = {
        rid: generate_plain(
            pair.target, list(ids), SHORT_PARAMS if rid.startswith("short") else LONG_PARAMS
        ).output_ids
        for rid, ids in prompts(pair).items()
    }
    return _plain[pair.name]


def assert_shares_steps(pair: Pair, speculative: bool, budget: int | None) -> Mix:
    mix = run_mix(pair, speculative, budget)
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
