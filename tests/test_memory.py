"""Device memory of the engine's state (runtime/memory.py): the arithmetic of the budget on
made-up device sizes, the one-line refusal of a configuration that cannot fit, and the cost
of a token and a slot read off the states the engine really allocates."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from reference_engine.bench.shapes import TARGET_SHAPES, draft_raw
from reference_engine.checkpoint import load_draft, load_target
from reference_engine.config import DraftConfig, TargetConfig
from reference_engine.errors import ConfigError
from reference_engine.kernels import TORCH
from reference_engine.models.dflash import DraftState
from reference_engine.runtime.commit import verify_record
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.memory import (
    GiB,
    StateCost,
    largest_forwards,
    plan_memory,
    state_cost,
    tensor_bytes,
    weight_bytes,
)
from reference_engine.runtime.state import TargetState

TinyPair = Callable[..., tuple[Path, Path]]
H200 = int(139.8 * GiB)


def plan(**overrides):
    args = {
        "total": 100 * GiB,
        "utilization": 0.9,
        "weights": 16 * GiB,
        "activations": 2 * GiB,
        "cost": StateCost(per_token=128 * 1024, per_slot=0),
        "slots": 16,
        "room": 8192 + 16,
        "max_num_seqs": 16,
        "max_model_len": 8192,
    }
    return plan_memory(**{**args, **overrides})


def test_the_budget_is_the_share_of_the_device_less_the_weights_and_the_activations() -> None:
    p = plan()
    assert p.budget == int(0.9 * 100 * GiB) - 18 * GiB
    assert p.state == 16 * (8192 + 16) * 128 * 1024
    assert p.tokens_that_fit == p.budget // (128 * 1024)
    line = p.describe()
    assert "16 slots x 8208 tokens x 131072 B/token" in line and "0.9 x 100.00 GiB" in line, line
    assert "\n" not in line


def test_a_state_past_the_budget_is_refused_in_one_line_naming_the_numbers() -> None:
    with pytest.raises(ConfigError) as info:
        plan(slots=64, max_num_seqs=64, room=32768 + 16, max_model_len=32768)
    message = str(info.value)
    fit = (int(0.9 * 100 * GiB) - 18 * GiB) // (128 * 1024)
    assert "\n" not in message
    assert "131072 bytes per token" in message
    assert f"holds {fit} tokens" in message
    assert "max_num_seqs 64 x max_model_len 32768" in message and str(64 * (32768 + 16)) in message
    # the largest context that fits at these slots, with the block each slot holds beside it
    longest = fit // 64 - 16
    assert f"at most {longest} fits" in message
    plan(slots=64, max_num_seqs=64, room=longest + 16, max_model_len=longest)
    with pytest.raises(ConfigError):
        plan(slots=64, max_num_seqs=64, room=longest + 17, max_model_len=longest + 1)


def test_per_slot_state_counts_against_the_budget() -> None:
    cost = StateCost(per_token=1024, per_slot=GiB)
    assert plan(cost=cost, slots=8).tokens_that_fit == (int(0.9 * 100 * GiB) - 18 * GiB - 8 * GiB) // 1024
    with pytest.raises(ConfigError, match=r"\+ 1073741824 per slot"):
        plan(cost=cost, slots=80, max_num_seqs=80)


def test_weights_that_leave_nothing_are_refused_before_the_state_is_weighed() -> None:
    with pytest.raises(ConfigError, match=r"no memory left for the state: 0.15 x 100.00 GiB"):
        plan(utilization=0.15)


def test_weights_and_activations_that_take_the_whole_share_leave_no_memory() -> None:
    """A budget of exactly 0 bytes (weights and activations take all of F x total) is refused
    as leaving no memory, not weighed against the state."""
    with pytest.raises(ConfigError, match="no memory left for the state"):
        plan(utilization=1.0, weights=98 * GiB, activations=2 * GiB)


def test_slots_whose_own_state_passes_the_budget_hold_zero_tokens_not_a_negative_count() -> None:
    """When the per-slot state alone passes the budget, tokens_that_fit is 0 and the refusal
    says the budget holds 0 tokens."""
    cost = StateCost(per_token=1024, per_slot=GiB)
    with pytest.raises(ConfigError, match=r"holds 0 tokens over 80 slots"):
        plan(cost=cost, slots=80, max_num_seqs=80)


@pytest.mark.parametrize("utilization", [0.0, -0.5, 1.01])
def test_the_utilization_is_a_share_in_zero_to_one(utilization: float) -> None:
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be in"):
        plan(utilization=utilization)
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=utilization)


def test_the_whole_card_and_a_sliver_of_it_are_shares_in_range() -> None:
    """(0, 1] holds both ends' neighbours: all of the card, and a small share of it."""
    for utilization in (1.0, 0.01):
        assert EngineConfig(gpu_memory_utilization=utilization).gpu_memory_utilization == utilization
    assert plan(utilization=1.0).budget > plan(utilization=0.9).budget


def test_the_qwen3_5_4b_shape_at_its_default_context_is_refused_on_one_h200() -> None:
    """The issue's case: 16 slots of the Qwen3.5-4B shape at its 262144-token context (block
    16, per_token commit) ask for more than the card; the refusal says what would fit."""
    tconfig = TargetConfig.from_hf(TARGET_SHAPES["qwen3.5-4b"])
    dconfig = DraftConfig.from_hf(draft_raw("qwen3.5-4b", 16, 5))

    def build(slots: int, room: int, device: torch.device) -> list:
        state = TargetState(tconfig, slots, room, torch.bfloat16, device, 16, "per_token")
        return [state, DraftState(dconfig, slots, room, torch.bfloat16, device)]

    cost = state_cost(build)
    # keys and values in bfloat16: 8 attention layers of 4 x 256, 5 draft layers of 8 x 128
    assert cost.per_token == 2 * 2 * (8 * 4 * 256 + 5 * 8 * 128)
    with pytest.raises(ConfigError) as info:
        plan_memory(H200, 0.9, int(9.3 * GiB), 3 * GiB, cost, 17, 262144 + 16, 16, 262144)
    assert "max_num_seqs 16 x max_model_len 262144" in str(info.value)
    plan_memory(H200, 0.9, int(9.3 * GiB), 3 * GiB, cost, 17, 32768 + 16, 16, 32768)


@pytest.mark.parametrize(
    ("arch", "strategy", "every"),
    [
        ("qwen3", "replay", 1),
        ("qwen3_5", "per_token", 0),  # the references' default: the rows written, no state
        ("qwen3_5", "per_token", 1),
        ("qwen3_5", "per_token", 3),
        ("qwen3_5", "recompute", 1),
    ],
)
def test_the_cost_is_what_the_engine_allocates(
    tiny_pair: TinyPair, monkeypatch, arch: str, strategy: str, every: int
) -> None:
    """Measured on the meta device, the state costs what the engine allocates, per_token
    checkpoints every few tokens (as on the GPU) included."""
    from reference_engine.runtime import engine as engine_module
    from reference_engine.runtime import state as state_module

    def by_device(device: torch.device | str, dtype: torch.dtype) -> int:  # as on the GPU: by device
        return every if torch.device(device).type == "cpu" else 1

    monkeypatch.setattr(state_module, "checkpoint_every", by_device)
    monkeypatch.setattr(engine_module, "checkpoint_every", by_device)
    target_dir, draft_dir = tiny_pair(arch, block_size=8)
    target = load_target(target_dir, dtype=torch.float64)
    draft = load_draft(draft_dir, target)
    engine = Engine(target, draft, EngineConfig(max_num_seqs=3, max_model_len=40, commit_strategy=strategy))
    cost = state_cost(engine.build_states)
    allocated = tensor_bytes(engine.state) + tensor_bytes(engine.draft_state)
    assert cost.bytes_for(3, 40 + 8) == allocated
    assert cost.per_token > 0 and (cost.per_slot > 0) == target.config.is_hybrid


def test_weights_shared_with_the_draft_are_counted_once(tiny_pair: TinyPair) -> None:
    target_dir, draft_dir = tiny_pair("qwen3", block_size=8)
    target = load_target(target_dir, dtype=torch.float64)
    draft = load_draft(draft_dir, target)
    own = sum(t.numel() * t.element_size() for t in (*draft.parameters(), *draft.buffers()))
    assert weight_bytes(target, draft) == weight_bytes(target) + own
    assert weight_bytes(target, target) == weight_bytes(target)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_fused_projections_count_their_stacked_storage_once(tiny_checkpoint, arch: str) -> None:
    """Fusing makes each projection's weight a view of one stacked matrix: the bytes are the
    unfused model's, not a whole stack per view."""
    from reference_engine.models.layers import fuse_projections

    unfused = load_target(tiny_checkpoint(arch), dtype=torch.float64)
    fused = load_target(tiny_checkpoint(arch), dtype=torch.float64)
    fuse_projections(fused)
    views = [p for p in fused.parameters() if p.data_ptr() != p.untyped_storage().data_ptr()]
    assert views, "nothing was fused: the test checks nothing"
    assert weight_bytes(fused) == weight_bytes(unfused)


@pytest.mark.parametrize(
    ("arch", "draft_arch"), [("qwen3", "dflash"), ("qwen3_5", "dflash2"), ("qwen3", "dflash2")]
)
def test_the_forwards_the_activation_peak_runs_work_for_every_draft(
    tiny_pair: TinyPair, arch: str, draft_arch: str
) -> None:
    """The start-up measure of the activations (CUDA only) runs these forwards: on the CPU
    they must run too, for every draft kind (a DFlash2 draft's selector needs the anchors)."""
    target_dir, draft_dir = tiny_pair(arch, block_size=8, draft_arch=draft_arch)
    target = load_target(target_dir, dtype=torch.float64)
    draft = load_draft(draft_dir, target)
    engine = Engine(
        target, draft, EngineConfig(max_num_seqs=3, max_model_len=40, commit_strategy="per_token")
    )
    state, draft_state = engine.build_states(3, 24 + 8, torch.device("cpu"))
    record = verify_record("per_token", target)
    largest_forwards(target, draft, TORCH, state, draft_state, 3, 8, 24, record)
    largest_forwards(target, None, TORCH, state, None, 3, 8, 24, None)
