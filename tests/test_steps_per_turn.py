"""Turns of several speculative steps (EngineConfig.steps_per_turn, SpeculativeStep.turn): the
host queues each step from the one before it on the device and reads the results of the
whole turn at its end. Output is plain greedy's whatever the turn's length, eagerly and on the
GPU's path (the captured accept, commit and draft inputs run eagerly, `_as_if_captured`);
requests that end inside a turn (their max_tokens, a stop token) are cut where they end and
write nothing outside their cells; steps are counted one by one."""

from __future__ import annotations

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.demo import DEMO_DRAFT, DEMO_TARGET, demo_prompts
from reference_engine.engine_args import engine_config
from reference_engine.errors import ConfigError
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.speculative_step import SpeculativeStep
from reference_engine.serving.args import ServeArgs

from .test_engine import PROMPTS, _as_if_captured, hybrid  # noqa: F401 (a fixture)

BLOCK = 8
# six requests through four slots, joining every other turn: budgets that end at every
# point of a turn, one that stops on a token of its own output (STOP_AT)
BUDGETS = [5, 40, 17, 33, 9, 26]
STOP_AT = {3: 11}  # request -> index in its plain output of the token that stops it


@pytest.fixture(scope="module")
def demo():
    """The trained demo pair in float32: its draft accepts several tokens a step, so rows of
    one step move by different counts."""
    target = load_target(DEMO_TARGET, dtype=torch.float32)
    draft = load_draft(DEMO_DRAFT, target)
    prompts = [row["prompt_ids"] for row in demo_prompts()][: len(BUDGETS)]
    return target, draft, prompts


@pytest.fixture(scope="module")
def params(demo) -> list[SamplingParams]:
    """Each request's sampling parameters: greedy, ending on its budget or on a stop token."""
    target, _, prompts = demo
    out = []
    for i, (prompt, budget) in enumerate(zip(prompts, BUDGETS)):
        stop = ()
        if i in STOP_AT:
            tokens = generate_plain(
                target, prompt, SamplingParams(max_tokens=budget, ignore_eos=True)
            ).output_ids
            stop = (tokens[STOP_AT[i]],)
        out.append(SamplingParams(max_tokens=budget, ignore_eos=True, stop_token_ids=stop))
    return out


def run(target, draft, prompts, params, steps: int, captured: bool = False, every: int = 2):
    """The requests through one engine of four slots, one joining every `every` calls of
    `step`; each request's output, and the engine."""
    config = EngineConfig(
        max_num_seqs=4, block_size=BLOCK, commit_strategy="per_token", steps_per_turn=steps, max_model_len=160
    )
    engine = Engine(target, draft, config)
    if captured:
        _as_if_captured(engine)
    waiting, calls = list(range(len(prompts))), 0
    while waiting or engine.has_unfinished():
        if waiting and calls % every == 0:
            i = waiting.pop(0)
            engine.add_request(str(i), prompts[i], params[i])
        engine.step()
        calls += 1
        assert calls < 500, "the engine did not finish"
    return [engine.collect(str(i)).output_ids for i in range(len(prompts))], engine


@pytest.fixture(scope="module")
def plain(demo, params) -> list[list[int]]:
    target, _, prompts = demo
    outputs, _ = run(target, None, prompts, params, 1)
    return outputs


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "as-captured"])
@pytest.mark.parametrize("steps", [2, 4])
def test_turns_of_several_steps_give_plain_greedy_output(demo, params, plain, steps, captured) -> None:
    """Every request's output equals plain greedy decode's, with requests joining between
    turns and ending inside them (by max_tokens and by a stop token), eagerly and on the
    GPU's path; each step of a turn counts as a step, with the acceptance of one-step turns."""
    target, draft, prompts = demo
    outputs, engine = run(target, draft, prompts, params, steps, captured)
    assert outputs == plain
    assert len(outputs[0]) == BUDGETS[0]  # its budget ends it inside a turn
    assert len(outputs[3]) == STOP_AT[3] + 1  # cut at its stop token, inside a turn
    _, single = run(target, draft, prompts, params, 1, captured)
    assert engine.stats()["spec"] == single.stats()["spec"]  # a row's steps do not depend on turns
    turns = sum(engine.verify_widths.values())
    assert turns > sum(single.verify_widths.values())  # rows run to their turn's end
    assert engine.steps > single.steps


def test_each_step_of_a_turn_is_counted(demo, params) -> None:
    """A turn of k steps counts k speculative steps in the verify widths and k engine steps,
    and a row's steps in a turn are recorded one by one (its acceptance per step)."""
    target, draft, prompts = demo
    config = EngineConfig(max_num_seqs=2, block_size=BLOCK, commit_strategy="per_token", steps_per_turn=3)
    engine = Engine(target, draft, config)
    engine.add_request("a", prompts[1], SamplingParams(max_tokens=60, ignore_eos=True))
    engine.add_request("b", prompts[2], SamplingParams(max_tokens=60, ignore_eos=True))
    engine.step()  # prefill, then a turn of three steps
    assert sum(engine.verify_widths.values()) == 3 and engine.steps == 3
    for rid in ("a", "b"):
        seq = engine.get(rid)
        assert len(seq.steps) == 3
        assert len(seq.output_ids) == 1 + sum(s.acceptance_length for s in seq.steps)
        assert all(s.acceptance_length == s.accepted + 1 for s in seq.steps)
    engine.step()
    assert sum(engine.verify_widths.values()) == 6 and engine.steps == 6


def written_positions(engine: Engine, cells_end: dict[str, int]) -> list[tuple[str, int, int]]:
    """Watch every draft and verify forward of `engine`: (request, furthest position written,
    the end of its cells, `cells_end`) for each row of a request that wrote at or past that
    end, as a list that the forwards fill."""
    over: list[tuple[str, int, int]] = []
    runner = engine.runner

    def watched(forward):
        def call(block, positions, slots, valid, *args, **kwargs):
            at = {engine.get(rid).slot: rid for rid in cells_end}
            for slot, row in zip(slots.tolist(), positions.tolist()):
                rid = at.get(slot)
                if rid is not None and max(row) >= cells_end[rid]:
                    over.append((rid, max(row), cells_end[rid]))
            return forward(block, positions, slots, valid, *args, **kwargs)

        return call

    runner.verify, runner.propose = watched(runner.verify), watched(runner.propose)
    return over


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "as-captured"])
def test_a_row_that_used_up_its_max_tokens_mid_turn_writes_inside_its_cells(demo, captured) -> None:
    """A request whose max_tokens run out in the first step of a long turn runs on to the
    turn's end where it stands: no forward of the turn writes its slot at or past its prompt
    + max_tokens + one block (the cells a pooled cache gives it), while a longer request in
    the same rows goes on."""
    target, draft, prompts = demo
    config = EngineConfig(max_num_seqs=2, block_size=BLOCK, commit_strategy="per_token", steps_per_turn=6)
    engine = Engine(target, draft, config)
    if captured:
        _as_if_captured(engine)
    short, long = prompts[0], prompts[1]
    engine.add_request("short", short, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request("long", long, SamplingParams(max_tokens=50, ignore_eos=True))
    over = written_positions(engine, {"short": len(short) + 2 + BLOCK, "long": len(long) + 50 + BLOCK})
    while engine.has_unfinished():
        engine.step()
    assert over == []
    assert len(engine.collect("short").output_ids) == 2 and len(engine.collect("long").output_ids) == 50


def test_a_row_that_moves_on_past_its_max_tokens_is_seen(demo, monkeypatch) -> None:
    """The check above fails on rows that keep moving after their max_tokens ran out."""
    target, draft, prompts = demo

    def moving(self, processed, anchors_at, N, n):
        return original(self, processed, anchors_at, N, torch.ones_like(n))

    original = SpeculativeStep.next_positions
    monkeypatch.setattr(SpeculativeStep, "next_positions", moving)
    config = EngineConfig(max_num_seqs=2, block_size=BLOCK, commit_strategy="per_token", steps_per_turn=6)
    engine = Engine(target, draft, config)
    engine.add_request("short", prompts[0], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request("long", prompts[1], SamplingParams(max_tokens=50, ignore_eos=True))
    over = written_positions(engine, {"short": len(prompts[0]) + 2 + BLOCK})
    while engine.has_unfinished():
        engine.step()
    assert over


def test_rows_a_turn_cannot_run_take_one_step(demo) -> None:
    """Sampled rows and rows whose proposals come from an oracle (the host's) run one step a
    turn; so do greedy rows beside a plain-decode request, beside a prompt still prefilling in
    chunks, and in an engine whose observer sees the state after each step's commit."""
    target, draft, prompts = demo
    config = EngineConfig(max_num_seqs=2, block_size=BLOCK, commit_strategy="per_token", steps_per_turn=4)
    engine = Engine(target, draft, config)
    engine.add_request("sampled", prompts[0], SamplingParams(max_tokens=30, temperature=0.8, seed=1))
    engine.add_request("greedy", prompts[1], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    assert sum(engine.verify_widths.values()) == 1
    step = engine.speculative_step
    assert not step.turn_fits([engine.get("sampled")], None)
    assert step.turn_fits([engine.get("greedy")], None) and not step.turn_fits([engine.get("greedy")], 0)

    for watched in (False, True):
        engine = Engine(target, draft, config)
        engine.add_request("greedy", prompts[1], SamplingParams(max_tokens=30, ignore_eos=True))
        if watched:
            engine.commit_observer = lambda seq, state, length: None
        else:  # logprobs are plain decode's: this request does not speculate
            engine.add_request("plain", prompts[0], SamplingParams(max_tokens=30, logprobs=1))
        engine.step()
        assert sum(engine.verify_widths.values()) == 1, watched

    chunked = Engine(target, draft, EngineConfig(**{**config.__dict__, "prefill_chunk": 16}))
    chunked.add_request("greedy", prompts[1], SamplingParams(max_tokens=60, ignore_eos=True))
    while chunked.get("greedy").pending is None and not chunked.get("greedy").output_ids:
        chunked.step()  # its prompt in chunks of 16
    chunked.add_request("long", prompts[2], SamplingParams(max_tokens=5, ignore_eos=True))
    before = sum(chunked.verify_widths.values())
    for _ in range(3):  # the long prompt's first three chunks: a step of the greedy row each
        chunked.step()
    assert sum(chunked.verify_widths.values()) == before + 3


def test_the_setting_and_its_default() -> None:
    """`--steps-per-turn` reaches the engine's config from `serve` and the engine benchmark;
    without it a turn is one step; below 1 is refused."""
    args = ServeArgs.parse(["--model", "m", "--steps-per-turn", "3"])
    assert engine_config(args).steps_per_turn == 3
    assert engine_config(ServeArgs.parse(["--model", "m"])).steps_per_turn == 1
    from reference_engine.bench import BenchArgs

    bench = BenchArgs.parser().parse_args(["--model", "m", "--steps-per-turn", "2"])
    assert engine_config(bench).steps_per_turn == 2
    with pytest.raises(ConfigError, match="steps_per_turn"):
        EngineConfig(steps_per_turn=0)
    assert EngineConfig().steps_per_turn == 1


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "as-captured"])
def test_every_step_of_a_turn_verifies_with_plain_decodes_logits(request, captured) -> None:
    """The gates' check of verify logits against plain decode's finds every step of a turn
    where it sits, the steps laid out on the device included: each position whose block
    follows the plain output is compared, with plain decode's logits for that very position
    (float64 on the CPU, whose references agree to rounding; the GPU's exact kernels to the
    bit)."""
    from gates.exact import VerifyLogitCheck, model_ops, plain_with_logits

    target, draft = request.getfixturevalue("hybrid")
    chosen = {"p1": PROMPTS[0], "p2": PROMPTS[2]}
    plain = {rid: plain_with_logits(target, p, 30, model_ops(target, None)) for rid, p in chosen.items()}
    config = EngineConfig(max_num_seqs=2, block_size=BLOCK, commit_strategy="per_token", steps_per_turn=4)
    engine = Engine(target, draft, config)
    if captured:
        _as_if_captured(engine)
    check = VerifyLogitCheck(
        engine, chosen, {r: out for r, (out, _) in plain.items()}, {r: lg for r, (_, lg) in plain.items()}
    )
    for rid, prompt in chosen.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert {rid: engine.collect(rid).output_ids for rid in chosen} == {r: o for r, (o, _) in plain.items()}
    assert check.compared >= 2 * 29
    diffs = [float(m.rsplit(" ", 1)[1]) for m in check.mismatches]
    assert max(diffs, default=0.0) < 1e-12, check.mismatches[:3]


def test_a_turns_draft_inputs_cost_acceptance_only(demo, params, plain, monkeypatch) -> None:
    """On the GPU's path a turn's later steps draft from inputs a captured graph writes
    (SpeculativeStep.ahead_body); the verify lays its rows out apart from them, so inputs that
    hold another row's anchors propose other blocks, and output stays plain greedy's."""
    from dataclasses import replace

    target, draft, prompts = demo
    _, fresh = run(target, draft, prompts, params, 4, captured=True)
    ahead_body = SpeculativeStep.ahead_body

    def swapped(self, x, table, remaining):
        nxt = ahead_body(self, x, table, remaining)
        return replace(nxt, ids=nxt.ids.roll(1, dims=0))

    monkeypatch.setattr(SpeculativeStep, "ahead_body", swapped)
    outputs, faulty = run(target, draft, prompts, params, 4, captured=True)
    assert outputs == plain
    assert faulty.stats()["spec"] != fresh.stats()["spec"]  # other proposals, other acceptance
