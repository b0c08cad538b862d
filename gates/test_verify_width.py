"""Gate: the load-adaptive verify width (reference_engine/runtime/verify_width.py) never
changes output. A cost table that makes narrow verifies pay forces the engine through every
width it may choose (1, 3 and 7 draft tokens of a block of 8, changing as the acceptance it
measures moves); every request's output equals plain greedy decode, the choice is the same on
a second run, and a planted fault that commits a draft token past the verified width is
caught."""

from __future__ import annotations

import pytest

from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.verify_width import StepCosts

from .checks import Pair, require_block
from .faults import planted

CATCHES = ("commit_past_verified_width", "plain_step_keeps_state_before_anchor")
BLOCK = 8
# seconds by (rows, verify width): a wide verify costs up to 3.5 narrow ones
NARROW_PAYS = StepCosts(
    {(rows, w): s for rows in (1, 2, 4) for w, s in ((0, 1.0), (1, 1.0), (3, 1.6), (7, 3.5))}, measured=True
)
MIXED = [7, 0, 3, 1, 5, 2]  # oracle rows: accepted counts that move the estimate both ways


def run(pair: Pair, strategy: str) -> tuple[dict[str, list[int]], dict, dict[str, list[int]]]:
    """Every prompt at once on one engine, half of them with an oracle that proposes the plain
    continuation up to MIXED counts: outputs, the widths the steps chose, and each request's
    verified draft tokens per step."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    config = EngineConfig(max_num_seqs=4, block_size=BLOCK, commit_strategy=strategy, numerics=pair.numerics)
    engine = Engine(pair.target, pair.draft, config, step_costs=NARROW_PAYS)
    for i, prompt in enumerate(pair.prompts[:4]):
        oracle = None
        if i % 2:
            plain = generate_plain(pair.target, list(prompt), params).output_ids
            oracle = OracleProposer(plain, MIXED, pair.target.config.vocab_size)
        engine.add_request(str(i), list(prompt), params, oracle=oracle)
    while engine.has_unfinished():
        engine.step()
    rids = [str(i) for i in range(min(4, len(pair.prompts)))]
    seqs = {rid: engine.collect(rid) for rid in rids}
    outputs = {rid: s.output_ids for rid, s in seqs.items()}
    return (
        outputs,
        engine.stats()["verify_widths"],
        {rid: [r.proposed for r in s.steps] for rid, s in seqs.items()},
    )


def plain_outputs(pair: Pair) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    return {
        str(i): generate_plain(pair.target, list(p), params).output_ids
        for i, p in enumerate(pair.prompts[:4])
    }


@pytest.mark.parametrize("strategy", ["replay", "per_token"])
def test_auto_verify_width_equals_plain_greedy_at_every_width(pair: Pair, strategy: str) -> None:
    require_block(pair, BLOCK)
    outputs, widths, proposed = run(pair, strategy)
    assert outputs == plain_outputs(pair), "speculative output != plain greedy under the auto verify width"
    assert {1, 3} <= set(widths), f"the cost table should have narrowed the verify, widths {widths}"
    assert max(max(p) for p in proposed.values()) <= BLOCK - 1


def test_the_width_choice_is_the_same_for_the_same_requests(pair: Pair) -> None:
    require_block(pair, BLOCK)
    assert run(pair, "replay") == run(pair, "replay")


def test_a_draft_token_committed_past_the_verified_width_is_caught(pair: Pair) -> None:
    require_block(pair, BLOCK)
    with planted("commit_past_verified_width"):
        outputs, _, _ = run(pair, "replay")
    assert outputs != plain_outputs(pair)


# a plain step (width 0) pays with 3 or 4 rows running (both read the 4-row costs), never
# with 1 or 2
PLAIN_PAYS_WIDE = StepCosts(
    {
        (rows, w): s
        for rows in (1, 2, 4)
        for w, s in ((0, 0.2 if rows == 4 else 10.0), (1, 1.0), (3, 1.6), (7, 3.5))
    },
    measured=True,
)


@pytest.mark.parametrize("strategy", ["replay", "per_token", "recompute"])
def test_plain_steps_among_speculative_ones_equal_plain_greedy(pair: Pair, strategy: str) -> None:
    """Four requests of different lengths: while three or four run, steps are plain ones
    (verify width 0: the anchor verified alone, no draft) but for the probes; as they finish,
    the rest draft again from the context the plain steps left. Each greedy output equals plain greedy; a
    sampled request beside them (its bonus drawn from the target at width 0) finishes."""
    require_block(pair, BLOCK)
    outputs, expected, sampled, widths = run_with_plain_steps(pair, strategy)
    assert outputs == expected, "speculative output != plain greedy with plain steps among speculative ones"
    assert len(sampled) == BUDGETS[3]
    assert widths.get(0, 0) >= BUDGETS[0] - 1 and any(w > 0 for w in widths), widths


BUDGETS = (6, 12, 20, 28)


def run_with_plain_steps(pair: Pair, strategy: str):
    """Three greedy requests of BUDGETS[:3] tokens and a sampled one beside them on
    PLAIN_PAYS_WIDE: (greedy outputs, their plain greedy references, the sampled output, the
    widths the steps chose)."""
    config = EngineConfig(max_num_seqs=4, block_size=BLOCK, commit_strategy=strategy, numerics=pair.numerics)
    engine = Engine(pair.target, pair.draft, config, step_costs=PLAIN_PAYS_WIDE)
    expected = {}
    for i, (prompt, budget) in enumerate(zip(pair.prompts[:3], BUDGETS)):
        params = SamplingParams(max_tokens=budget, ignore_eos=True)
        expected[str(i)] = generate_plain(pair.target, list(prompt), params).output_ids
        engine.add_request(str(i), list(prompt), params)
    sampled = SamplingParams(max_tokens=BUDGETS[3], ignore_eos=True, temperature=1.0, seed=3)
    engine.add_request("sampled", list(pair.prompts[0]), sampled)
    while engine.has_unfinished():
        engine.step()
    outputs = {rid: engine.collect(rid).output_ids for rid in expected}
    return outputs, expected, engine.collect("sampled").output_ids, engine.stats()["verify_widths"]


@pytest.mark.parametrize("strategy", ["replay", "per_token", "recompute"])
def test_a_plain_step_that_leaves_the_state_before_its_anchor_is_caught(pair: Pair, strategy: str) -> None:
    if not pair.target.config.is_hybrid:
        pytest.skip("dense targets have no recurrent state")
    require_block(pair, BLOCK)
    with planted("plain_step_keeps_state_before_anchor"):
        outputs, expected, _, _ = run_with_plain_steps(pair, strategy)
    assert outputs != expected
