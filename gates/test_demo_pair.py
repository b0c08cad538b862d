"""Gate on the shipped demo pair (reference_engine/assets/demo): on held-out prompts,
DFlash output is byte-identical to plain greedy decode (float32 on the CPU; a divergence
is reported with the target's logit margin there), and the mean acceptance length stays
above a floor set just under the value measured for this configuration, which guards
against draft-side regressions that keep the output correct but draft badly.

Each check is also run on an engine with a deliberate fault, and must catch it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.demo import DEMO_DRAFT, DEMO_DRAFT2, DEMO_TARGET, demo_prompts
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams

from .checks import divergence
from .faults import planted

MAX_TOKENS = 128
# Measured with this file's settings (all 32 held-out prompts x 128 tokens, float32, CPU):
# 3.642 at B=8 and 4.190 at B=16, the figures of the model card (training.json), which were
# measured on an H200 in float32; each floor sits 0.12-0.14 under its measurement.
ACCEPTANCE_FLOOR = {8: 3.52, 16: 4.05}
# the DFlash2 draft (draft-dflash2/, training-dflash2.json), measured the same way: 4.867 at
# B=8 and 5.700 at B=16; each floor 0.13-0.14 under
DFLASH2_ACCEPTANCE_FLOOR = {8: 4.74, 16: 5.56}
FEW = 8  # prompts for the fault that breaks the output (any one divergence shows)


@pytest.fixture(scope="module")
def demo():
    if not (DEMO_TARGET / "model.safetensors").is_file():
        pytest.fail(f"the demo pair is missing from {DEMO_TARGET.parent}")
    target = load_target(DEMO_TARGET, dtype=torch.float32)
    draft = load_draft(DEMO_DRAFT, target)
    prompts = [row["prompt_ids"] for row in demo_prompts()]
    return target, draft, prompts


def run(target, draft, prompts, block_size=None, fault=None) -> tuple[list[list[int]], float]:
    """All prompts through one engine (a continuous batch); outputs and mean acceptance."""
    engine = Engine(
        target,
        draft,
        EngineConfig(
            max_num_seqs=len(prompts),
            block_size=block_size,
            commit_strategy="per_token",
            max_model_len=max(map(len, prompts)) + MAX_TOKENS,
        ),
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    with planted(fault):
        while engine.has_unfinished():
            engine.step()
    outputs = [engine.collect(str(i)).output_ids for i in range(len(prompts))]
    return outputs, engine.stats()["spec"]["mean_acceptance_length"] if draft else 1.0


@pytest.fixture(scope="module")
def plain(demo) -> list[list[int]]:
    target, _, prompts = demo
    return run(target, None, prompts)[0]


def assert_identical(demo, plain: list[list[int]], outputs: list[list[int]], what: str) -> None:
    target, _, prompts = demo
    problems = []
    assert len(outputs) <= len(plain)
    for prompt, expected, got in zip(prompts, plain, outputs):
        if got != expected:  # equal ids decode to equal bytes
            problems.append(divergence(target, prompt, expected, got))
    if problems:
        raise AssertionError(
            f"{what}: {len(problems)} of {len(prompts)} held-out prompts: DFlash "
            "output != plain greedy; " + "; ".join(problems)
        )


def assert_acceptance(mean: float, block_size: int, floors: dict[int, float] = ACCEPTANCE_FLOOR) -> None:
    floor = floors[block_size]
    if mean < floor:
        raise AssertionError(
            f"B={block_size}: mean acceptance length {mean:.3f} fell below "
            f"the floor {floor} (the draft drafts worse than when measured)"
        )


@pytest.mark.parametrize("block_size", sorted(ACCEPTANCE_FLOOR))
def test_demo_dflash_is_byte_identical_and_keeps_its_acceptance(demo, plain, block_size) -> None:
    target, draft, prompts = demo
    outputs, mean = run(target, draft, prompts, block_size)
    print(f"demo pair, B={block_size}: mean acceptance length {mean:.3f}")
    assert_identical(demo, plain, outputs, f"B={block_size}")
    assert_acceptance(mean, block_size)


def test_identity_check_catches_a_skipped_recurrent_state_rollback(demo, plain) -> None:
    target, draft, prompts = demo
    outputs, _ = run(target, draft, prompts[:FEW], 8, fault="skip_state_rollback")
    with pytest.raises(AssertionError, match="first divergence at output position"):
        assert_identical(demo, plain[:FEW], outputs, "B=8")


def test_acceptance_floor_catches_context_features_shifted_by_one_position(demo, plain) -> None:
    """A draft-side fault that keeps the output lossless: only the floor can see it."""
    target, draft, prompts = demo
    outputs, mean = run(target, draft, prompts, 8, fault="feature_off_by_one")
    assert_identical(demo, plain, outputs, "B=8")
    with pytest.raises(AssertionError, match="fell below the floor"):
        assert_acceptance(mean, 8)


def test_acceptance_floor_catches_the_last_layer_read_after_the_final_norm(demo, plain) -> None:
    """The draft lists the target's last layer and was trained on its raw output (its config
    says so); an engine that hands it the final-normed output stays lossless, and only the
    floor sees the draft drafting worse."""
    target, _, prompts = demo
    misread = load_draft(DEMO_DRAFT, target)
    assert misread.config.raw_last_layer
    misread.config = dataclasses.replace(misread.config, last_layer_feature="final_norm")
    outputs, mean = run(target, misread, prompts, 8)
    assert_identical(demo, plain, outputs, "B=8")
    with pytest.raises(AssertionError, match="fell below the floor"):
        assert_acceptance(mean, 8)


@pytest.fixture(scope="module")
def dflash2_draft(demo):
    target = demo[0]
    if not (DEMO_DRAFT2 / "model.safetensors").is_file():
        pytest.fail(f"the demo DFlash2 draft is missing from {DEMO_DRAFT2}")
    return load_draft(DEMO_DRAFT2, target)


@pytest.mark.parametrize("block_size", sorted(DFLASH2_ACCEPTANCE_FLOOR))
def test_demo_dflash2_is_byte_identical_and_keeps_its_acceptance(
    demo, plain, dflash2_draft, block_size
) -> None:
    target, _, prompts = demo
    outputs, mean = run(target, dflash2_draft, prompts, block_size)
    print(f"demo pair, DFlash2 draft, B={block_size}: mean acceptance length {mean:.3f}")
    assert_identical(demo, plain, outputs, f"DFlash2, B={block_size}")
    assert_acceptance(mean, block_size, DFLASH2_ACCEPTANCE_FLOOR)
    assert mean > ACCEPTANCE_FLOOR[block_size] + 1.0  # and it drafts well ahead of DFlash


def test_dflash2_acceptance_floor_catches_context_features_shifted_by_one_position(
    demo, plain, dflash2_draft
) -> None:
    target, _, prompts = demo
    outputs, mean = run(target, dflash2_draft, prompts, 8, fault="feature_off_by_one")
    assert_identical(demo, plain, outputs, "DFlash2, B=8")
    with pytest.raises(AssertionError, match="fell below the floor"):
        assert_acceptance(mean, 8, DFLASH2_ACCEPTANCE_FLOOR)
