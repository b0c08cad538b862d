"""Gate: paths of the engine that the other gates' workloads do not reach.

Turns of several steps (`steps_per_turn`) and a draft that runs only as many positions as its
step verifies (`draft_span="verify"`), on the demo pair (float32; its draft accepts several
tokens a step, so rows of one step move by different counts and a shorter row's block is
padded): a continuous batch of six requests, one joining every other call, with budgets that
end inside a turn and a stop token inside an accepted block. Checked:

- every request's output equals plain greedy's alone;
- the verify scores every position a request commits with plain decode's logits (1e-3, float32):
  a later step of a turn that reads one key short moves the logits without flipping a token;
- the step records add up: a request's output is its first token plus every step's acceptance
  length (plain steps, verify width 0, add tokens no step records); a step verifies at most
  the tokens the request had left, records one drafted token per verified one, accepts at
  most those (a shorter row's padding never counts) and commits accepted + 1, cut only at
  the request's last step; the engine's totals are the sum of the requests'.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.demo import DEMO_DRAFT, DEMO_TARGET, demo_prompts
from reference_engine.runtime.decode import decode_step, generate_plain, new_state, prefill
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams

from .checks import recorded_verifies, verify_gaps
from .faults import planted

CATCHES = (
    "turn_positions_one_behind",
    "turn_verify_one_key_short",
    "turn_context_one_short",
    "accepted_past_row_draft",
)

BLOCK = 8


# ------------------------------------------------------------------ step records
def assert_records_add_up(engine: Engine, seqs: dict, what: str) -> None:
    """The identities of the speculative step records (module docstring); `seqs` maps each
    request id to its collected Sequence and the tokens it had left before each recorded step
    are rebuilt from its output."""
    totals = Counter()
    lengths: Counter = Counter()
    plain_steps = engine.verify_widths.get(0, 0) > 0
    for rid, seq in seqs.items():
        steps = seq.steps
        committed = sum(s.acceptance_length for s in steps)
        # a plain step (verify width 0) commits a token and records no step
        exact = len(seq.output_ids) == 1 + committed or (plain_steps and len(seq.output_ids) > 1 + committed)
        assert exact, (
            f"{what}: request {rid} has {len(seq.output_ids)} output tokens, its steps "
            f"committed {committed}: not its first token plus every step's acceptance length"
        )
        left = seq.params.max_tokens - 1
        for k, s in enumerate(steps):
            where = f"{what}: request {rid}, step {k} ({s})"
            assert s.proposed <= left, f"{where}: verified more draft tokens than it had left ({left})"
            assert 0 <= s.accepted <= s.proposed, f"{where}: accepted more than it verified"
            assert len(s.drafted) == s.proposed, f"{where}: drafted tokens != proposed"
            assert 1 <= s.acceptance_length <= s.accepted + 1, f"{where}: committed more than accepted + 1"
            if k < len(steps) - 1:  # only a request's last step is cut (stop, max_tokens)
                assert s.acceptance_length == s.accepted + 1, f"{where}: a step before the last was cut"
            left -= s.acceptance_length
        totals.update(steps=len(steps), proposed=sum(s.proposed for s in steps))
        totals.update(accepted=sum(s.accepted for s in steps))
        lengths.update(s.acceptance_length for s in steps)
    spec = engine.spec_totals
    got = {"steps": spec.steps, "proposed": spec.proposed, "accepted": spec.accepted}
    assert got == {k: totals[k] for k in got}, f"{what}: engine totals {got} != the requests' {dict(totals)}"
    assert dict(spec.acceptance_lengths) == dict(lengths), f"{what}: acceptance-length histogram"


# ------------------------------------------------------------------ turns and the verify span
TURN_BUDGETS = [5, 40, 17, 33, 9, 26]
TURN_STOP = {3: 11}  # request -> index in its plain output of the token that stops it


@pytest.fixture(scope="module")
def demo_turns():
    """The demo pair, six prompts with their parameters and each one's plain greedy output alone."""
    target = load_target(DEMO_TARGET, dtype=torch.float32)
    draft = load_draft(DEMO_DRAFT, target)
    prompts = [row["prompt_ids"] for row in demo_prompts()][: len(TURN_BUDGETS)]
    params, plain = [], []
    for i, (prompt, budget) in enumerate(zip(prompts, TURN_BUDGETS)):
        p = SamplingParams(max_tokens=budget, ignore_eos=True)
        out = generate_plain(target, prompt, p).output_ids
        if i in TURN_STOP:
            p = SamplingParams(max_tokens=budget, ignore_eos=True, stop_token_ids=(out[TURN_STOP[i]],))
            out = generate_plain(target, prompt, p).output_ids
        params.append(p)
        plain.append(out)
    return target, draft, prompts, params, plain


def run_turns(demo_turns, steps: int, span: str, block: int = BLOCK) -> dict[str, list[tuple]]:
    target, draft, prompts, params, plain = demo_turns
    config = EngineConfig(
        max_num_seqs=4,
        block_size=block,
        commit_strategy="per_token",
        steps_per_turn=steps,
        draft_span=span,
        max_model_len=160,
    )
    engine = Engine(target, draft, config)
    waiting, calls, seqs = list(range(len(prompts))), 0, {}
    with recorded_verifies(engine) as seen:
        while waiting or engine.has_unfinished():
            if waiting and calls % 2 == 0:  # one joins every other call: rows join between turns
                i = waiting.pop(0)
                engine.add_request(str(i), prompts[i], params[i])
            engine.step()
            for rid in list(engine.scheduler.finished):
                seqs[rid] = engine.collect(rid)
            calls += 1
            assert calls < 500, "the engine did not finish"
    what = f"demo pair, block {block}, {steps} steps a turn, draft span {span}"
    for i, expected in enumerate(plain):
        got = seqs[str(i)].output_ids
        assert got == expected, (
            f"{what}: request {i} differs from plain greedy alone: expected {expected}, got {got}"
        )
    # blocks really accepted, some whole
    assert max(s.accepted for seq in seqs.values() for s in seq.steps) == block - 1, f"{what}: no whole block"
    if steps > 1:  # turns of several steps really ran (each step of a turn counts as a step)
        assert engine.steps > calls, f"{what}: no turn ran more than one step"
    assert_records_add_up(engine, seqs, what)
    assert_verify_logits_are_plain(target, prompts, plain, seen, what)
    return {rid: [(s.proposed, s.accepted, s.drafted) for s in seq.steps] for rid, seq in seqs.items()}


def assert_verify_logits_are_plain(target, prompts, plain, seen, what: str) -> None:
    """At every block slot whose tokens are the request's own (its accepted prefix and the slot
    that chose the bonus), the verify's logits equal plain decode's there (1e-3: float32)."""
    sequences = {str(i): list(prompt) + out for i, (prompt, out) in enumerate(zip(prompts, plain))}
    reference = {}
    for name, ids in sequences.items():
        state = new_state(target, len(ids) + 1)
        n = len(prompts[int(name)])
        logits, _ = prefill(target, state, 0, ids[:n])
        reference[name] = {n - 1: logits}
        for position in range(n, len(ids) - 1):
            reference[name][position] = decode_step(target, state, 0, ids[position])
    compared, worst = verify_gaps(seen, sequences, reference, 1e-3)
    assert compared > 50, f"{what}: only {compared} verified positions compared"
    assert not worst, f"{what}: verify logits != plain decode's at {len(worst)} positions: " + "; ".join(
        worst[:4]
    )


@pytest.mark.parametrize(("steps", "span"), [(3, "block"), (1, "verify"), (3, "verify")])
def test_turns_and_the_verify_span_give_plain_greedy_output(demo_turns, steps: int, span: str) -> None:
    run_turns(demo_turns, steps, span)


def test_the_turn_gate_catches_positions_one_behind(demo_turns) -> None:
    with (
        planted("turn_positions_one_behind"),
        pytest.raises(AssertionError, match="differs from plain greedy"),
    ):
        run_turns(demo_turns, 3, "block")


def test_the_records_gate_catches_padding_slots_accepted(demo_turns) -> None:
    with (
        planted("accepted_past_row_draft"),
        pytest.raises(AssertionError, match="accepted more than it verified"),
    ):
        run_turns(demo_turns, 3, "block")


def test_the_turn_gate_catches_a_later_step_one_key_short(demo_turns) -> None:
    with planted("turn_verify_one_key_short"), pytest.raises(AssertionError, match="verify logits != plain"):
        run_turns(demo_turns, 3, "block")


def assert_steps_do_not_depend_on_turns(demo_turns) -> None:
    """A request's steps (what each drafted, verified and accepted) are the same whatever the
    turn's length: a turn changes when the host reads the results, not what a row drafts (the
    draft is batch-invariant)."""
    # at block 4 whole blocks are often accepted inside a turn
    single, turns = run_turns(demo_turns, 1, "block", 4), run_turns(demo_turns, 3, "block", 4)
    for rid, steps in single.items():
        k = next((k for k, (a, b) in enumerate(zip(steps, turns[rid])) if a != b), None)
        assert steps == turns[rid], (
            f"request {rid}: its steps differ with 3 steps a turn from one step a turn, first at "
            f"step {k}: {steps[k : k + 1] if k is not None else steps[len(turns[rid]) :][:1]} != "
            f"{turns[rid][k : k + 1] if k is not None else turns[rid][len(steps) :][:1]}"
        )


def test_a_requests_steps_do_not_depend_on_the_turns(demo_turns) -> None:
    assert_steps_do_not_depend_on_turns(demo_turns)


def test_the_turn_gate_catches_a_context_one_short(demo_turns) -> None:
    with planted("turn_context_one_short"), pytest.raises(AssertionError, match="its steps differ"):
        assert_steps_do_not_depend_on_turns(demo_turns)
