"""Each gate is seen to fail: run the gates' own checks on an engine with a deliberate
fault planted (gates/faults.py, testing only) and assert that they catch it."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import EngineConfig
from reference_engine.runtime.request import SamplingParams

from .checks import (
    Pair,
    assert_forced_acceptance,
    assert_lossless,
    assert_states_close,
    plain_states,
    speculative_states,
)
from .faults import FAULTS, LIES, planted

MIXED = [7, 0, 3, 1, 5, 2]


def lossless_catches(pair: Pair, fault: str, strategy: str = "replay") -> str:
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    with planted(fault), pytest.raises(AssertionError, match="speculative output != plain greedy") as caught:
        for prompt in pair.prompts:
            for schedule in (None, MIXED):
                assert_lossless(
                    pair, prompt, params, EngineConfig(block_size=8, commit_strategy=strategy), schedule
                )
    return str(caught.value)


# the faults this module's tests plant and see caught; every gate module that plants faults
# names them in its own CATCHES
CATCHES = (
    "skip_state_rollback",
    "skip_length_rollback",
    "wrong_bonus_position",
    "never_accept_full_block",
    "feature_off_by_one",
    "bonus_ignores_residual",
)


def test_every_fault_is_caught_by_some_gate_test() -> None:
    caught: dict[str, list[str]] = {}
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        module = importlib.import_module(f"gates.{path.stem}")
        for name in getattr(module, "CATCHES", ()):
            caught.setdefault(name, []).append(path.stem)
            # a module that claims a fault plants it by name
            assert f'"{name}"' in path.read_text(), f"{path.name} claims {name} but never names it"
    assert sorted(caught) == sorted(FAULTS), (
        f"faults no gate catches: {sorted(set(FAULTS) - set(caught))}; "
        f"claimed but not planted anywhere: {sorted(set(caught) - set(FAULTS))}"
    )


def doc_table(heading: str) -> dict[str, list[str]]:
    """The rows of the first table under `heading` in docs/gates.md: first cell's name -> cells."""
    text = (Path(__file__).parents[1] / "docs" / "gates.md").read_text()
    section = text.split(heading, 1)[1]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0].strip("`")] = cells
        elif rows and not line.startswith("|"):
            break
    return rows


def test_docs_list_every_fault_with_the_gates_that_claim_it() -> None:
    """docs/gates.md's table of faults names exactly the registered faults, each with the gate
    modules that claim it."""
    claims: dict[str, set[str]] = {}
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        for name in getattr(importlib.import_module(f"gates.{path.stem}"), "CATCHES", ()):
            claims.setdefault(name, set()).add(f"`{path.name}`")
    rows = doc_table("## Planted faults")
    assert sorted(rows) == sorted(FAULTS), (
        f"not in the docs: {sorted(set(FAULTS) - set(rows))}; "
        f"in the docs, not registered: {sorted(set(rows) - set(FAULTS))}"
    )
    for name, cells in rows.items():
        assert set(cells[-1].split(", ")) == claims[name], (name, cells[-1])


def test_docs_list_every_lie() -> None:
    """docs/gates.md's table of lying candidates names exactly the registered lies."""
    rows = doc_table("### Lying candidates")
    assert sorted(rows) == sorted(LIES), (
        f"not in the docs: {sorted(set(LIES) - set(rows))}; "
        f"in the docs, not registered: {sorted(set(rows) - set(LIES))}"
    )


@pytest.mark.parametrize("strategy", ["replay", "per_token", "recompute"])
def test_lossless_gate_catches_a_skipped_recurrent_state_rollback(pair: Pair, strategy: str) -> None:
    if not pair.target.config.is_hybrid:
        pytest.skip("dense targets have no recurrent state")
    message = lossless_catches(pair, "skip_state_rollback", strategy)
    assert "first divergence at output position" in message


def test_lossless_gate_catches_a_skipped_length_rollback(pair: Pair) -> None:
    lossless_catches(pair, "skip_length_rollback")


def test_lossless_gate_catches_a_wrong_bonus_position(pair: Pair) -> None:
    lossless_catches(pair, "wrong_bonus_position")


def test_forced_acceptance_gate_catches_a_lossless_but_wrong_acceptance(pair: Pair) -> None:
    # output stays correct (the target supplies the token), only the acceptance is wrong
    with planted("never_accept_full_block"), pytest.raises(AssertionError, match="acceptance lengths"):
        assert_forced_acceptance(pair, pair.prompts[1], EngineConfig(block_size=8), list(range(8)))


def test_state_equality_gate_catches_a_skipped_recurrent_state_rollback(pair: Pair) -> None:
    if not pair.target.config.is_hybrid:
        pytest.skip("dense targets have no recurrent state")
    prompt = pair.prompts[1]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = generate_plain(pair.target, list(prompt), params)
    longer = generate_plain(
        pair.target, list(prompt), SamplingParams(max_tokens=40, ignore_eos=True)
    ).output_ids
    expected = plain_states(pair.target, prompt, longer)
    # a fault that corrupts the state also derails the output, so the first commits are
    # where the state check must already fire
    with planted("skip_state_rollback"):
        got = speculative_states(
            pair, prompt, params, EngineConfig(block_size=8, commit_strategy="per_token"), [0, 3, 1], ref
        )
    first = dict(sorted(got.items())[:1])
    with pytest.raises(AssertionError, match="recurrent|conv"):
        assert_states_close(expected, first, 1e-9, "faulty engine")


def test_zlab_gate_catches_context_features_off_by_one(tiny_pair_dirs) -> None:
    zlab = pytest.importorskip("gates.test_zlab_reference")
    target_dir, draft_dir = tiny_pair_dirs["dense"]
    prompt = [17, 3, 99, 250, 41, 8, 77, 120, 3, 64, 200, 13]
    with pytest.raises(AssertionError, match="drafted tokens differ"):
        zlab.assert_matches_zlab(target_dir, draft_dir, prompt, 8, fault="feature_off_by_one")


def test_sampling_gate_catches_a_replacement_drawn_without_the_residual(
    small_vocab_pair,
) -> None:
    from .test_sampling_distribution import assert_engine_sampling_lossless

    target, draft = small_vocab_pair
    with pytest.raises(AssertionError, match="joint distribution|no convergence"):
        assert_engine_sampling_lossless(target, draft, fault="bonus_ignores_residual")
