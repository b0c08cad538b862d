"""The draft's span (EngineConfig.draft_span, `--draft-span`): with "verify" a drafted step's
draft runs the anchor and only as many mask tokens as the step verifies, so its forward is
smaller and its block attention sees fewer positions. Output is plain greedy's at every width
and turn length; the draft's blocks are as wide as the verify, not the block; its proposals
are those of a draft whose blocks are that wide (a block size of W + 1); the span is refused
where the captured drafts run whole blocks, and the commands carry it to the engine."""

from __future__ import annotations

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.demo import DEMO_DRAFT, DEMO_TARGET, demo_prompts
from reference_engine.engine_args import engine_config
from reference_engine.errors import ConfigError
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.model_runner import ModelRunner
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.verify_width import VerifyWidth
from reference_engine.serving.args import ServeArgs

BLOCK = 8
BUDGETS = [5, 40, 17, 33, 9, 26]  # ends at every point of a block and of a turn
# the widths the steps take in turn: plain steps, narrow ones, the full block (7), and widths
# past what a row has left
CYCLE = (3, 1, 7, 0, 2, 7, 5, 1, 4, 6)


@pytest.fixture(scope="module")
def demo():
    """The trained demo pair in float32: its draft accepts several tokens a step, so a span
    that changes the proposals changes how far each step moves."""
    target = load_target(DEMO_TARGET, dtype=torch.float32)
    draft = load_draft(DEMO_DRAFT, target)
    prompts = [row["prompt_ids"] for row in demo_prompts()][: len(BUDGETS)]
    return target, draft, prompts


@pytest.fixture(scope="module")
def plain(demo) -> list[list[int]]:
    target, _, prompts = demo
    return [
        generate_plain(target, p, SamplingParams(max_tokens=b, ignore_eos=True)).output_ids
        for p, b in zip(prompts, BUDGETS)
    ]


def widths_in_turn(monkeypatch, cycle=CYCLE) -> list:
    """Make every step take the next width of `cycle`; returns the widths taken."""
    chosen: list = []

    def choose(self, limits, counters, totals):
        chosen.append(cycle[len(chosen) % len(cycle)])
        return chosen[-1]

    monkeypatch.setattr(VerifyWidth, "choose", choose)
    return chosen


def blocks_drafted(monkeypatch) -> list[tuple[int, list[int]]]:
    """Record each draft forward's block width and the real tokens of each row (its valid
    length): (block width, valid lengths) per forward."""
    seen: list[tuple[int, list[int]]] = []
    original = ModelRunner.propose

    def propose(self, block, positions, slots, valid, kv_len, phase=None, width=None):
        seen.append((block.shape[1], [int(v) for v in valid]))
        kwargs = {} if phase is None else {"phase": phase}
        return original(self, block, positions, slots, valid, kv_len, width=width, **kwargs)

    monkeypatch.setattr(ModelRunner, "propose", propose)
    return seen


def run(demo, span: str, steps_per_turn: int = 1, block: int = BLOCK, verify_width: str = "auto"):
    """The requests through an engine of four slots, one joining every other step; each
    request's output and drafted blocks."""
    target, draft, prompts = demo
    config = EngineConfig(
        max_num_seqs=4,
        block_size=block,
        draft_span=span,
        steps_per_turn=steps_per_turn,
        verify_width=verify_width,
        measure_step_costs=False,
    )
    engine = Engine(target, draft, config)
    ids = [f"r{i}" for i in range(len(prompts))]
    step = 0
    while step < 2 * len(ids) or engine.has_unfinished():
        if step % 2 == 0 and step // 2 < len(ids):
            i = step // 2
            engine.add_request(ids[i], prompts[i], SamplingParams(max_tokens=BUDGETS[i], ignore_eos=True))
        engine.step()
        step += 1
        assert step < 2000
    done = [engine.collect(rid) for rid in ids]
    return [s.output_ids for s in done], [[r.drafted for r in s.steps] for s in done]


@pytest.mark.parametrize("steps", [1, 3])
def test_a_verify_span_gives_plain_greedy_output_at_every_width(demo, plain, monkeypatch, steps) -> None:
    widths_in_turn(monkeypatch)
    seen = blocks_drafted(monkeypatch)
    outputs, drafted = run(demo, "verify", steps_per_turn=steps)
    assert outputs == plain
    assert seen and any(width < BLOCK for width, _ in seen)


def test_each_draft_runs_as_many_positions_as_its_step_verifies(demo, monkeypatch) -> None:
    """With "verify" a step of width W drafts blocks of min(W, the rows' most) + 1 positions,
    each row's real tokens at most W + 1; with "block" every block is the rows' whole block."""
    chosen = widths_in_turn(monkeypatch)
    seen = blocks_drafted(monkeypatch)
    run(demo, "verify")
    drafted_widths = [w for w in chosen if w != 0]
    assert len(seen) == len(drafted_widths)
    for width, (block_width, valid) in zip(drafted_widths, seen):
        limit = width + 1
        assert block_width <= limit and max(valid) == block_width, (width, block_width, valid)
    assert {w for w, _ in seen} >= {2, 3, 4, BLOCK}

    chosen.clear()
    seen.clear()
    run(demo, "block")
    assert len(seen) == len([w for w in chosen if w != 0])
    assert all(block_width == max(valid) for block_width, valid in seen)
    assert any(
        block_width > width + 1
        for block_width, width in zip([b for b, _ in seen], [w for w in chosen if w != 0])
    )


def test_every_draft_of_a_turn_runs_as_many_positions_as_the_turn_verifies(demo, plain, monkeypatch) -> None:
    """Turns of three steps at width 2: each step after a turn's first drafts from the one
    before it, and under "verify" its blocks too hold the anchor and 2 mask tokens at most."""
    widths_in_turn(monkeypatch, cycle=(2,))
    seen = blocks_drafted(monkeypatch)
    outputs, _ = run(demo, "verify", steps_per_turn=3)
    assert outputs == plain
    assert seen and all(block_width <= 3 and max(valid) <= 3 for block_width, valid in seen)
    seen.clear()
    run(demo, "block", steps_per_turn=3)
    assert any(block_width > 3 for block_width, _ in seen)


@pytest.mark.parametrize("width", [1, 3, 5])
def test_a_verify_span_proposes_what_a_draft_of_that_block_size_proposes(
    demo, plain, monkeypatch, width
) -> None:
    """A step of width W under "verify" drafts the blocks a block size of W + 1 drafts: the
    same proposals step by step, so the same drafted blocks for every request. Under "block"
    the block attention sees the whole block, and the proposals differ."""
    widths_in_turn(monkeypatch, cycle=(width,))
    outputs, spanned = run(demo, "verify")
    assert outputs == plain
    _, sized = run(demo, "block", block=width + 1, verify_width="fixed")
    assert spanned == sized
    _, whole = run(demo, "block")
    assert whole != spanned


def test_the_setting_its_default_and_where_it_is_refused() -> None:
    assert EngineConfig().draft_span == "block"
    with pytest.raises(ConfigError, match="draft_span must be one of block, verify"):
        EngineConfig(draft_span="half")
    args = ServeArgs.parse(["--model", "m", "--draft-span", "verify"])
    assert engine_config(args).draft_span == "verify"
    assert ServeArgs.parse(["--model", "m"]).draft_span == "block"
    with pytest.raises(SystemExit):
        ServeArgs.parse(["--model", "m", "--draft-span", "half"])


def test_the_span_is_refused_where_the_drafts_are_captured(demo, monkeypatch) -> None:
    """Captured drafts run whole blocks: an engine that would capture its forwards refuses
    "verify" at start (the CPU stands in for a GPU here), one that would not builds."""
    import reference_engine.runtime.engine as engine_module

    target, draft, _ = demo
    Engine(target, draft, EngineConfig(max_num_seqs=2, draft_span="verify"))
    monkeypatch.setattr(engine_module, "graphs_possible", lambda *args: True)
    with pytest.raises(ConfigError, match="eager forwards only.*--enforce-eager"):
        Engine(target, draft, EngineConfig(max_num_seqs=2, draft_span="verify"))
