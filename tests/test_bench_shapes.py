"""The real-model shapes of bench/shapes.py for the Llama and MoE targets: each config builds,
its draft fits it, and its tensors (counted on the meta device, nothing allocated) are the
published model's: tensor count, parameter count, and for MoE the active parameters."""

from __future__ import annotations

import math

import pytest

from reference_engine.bench.shapes import DRAFT_HEADS, TARGET_SHAPES, draft_raw
from reference_engine.config import DraftConfig, TargetConfig
from reference_engine.models import draft_expected_shapes, expected_shapes

# name -> (tensors, parameters and active parameters: ranges in billions) of the published
# model; Qwen3.5-35B-A3B's text model only (the checkpoint's vision tower and MTP layer are
# not loaded): 30 Gated DeltaNet and 10 attention layers
PUBLISHED = {
    "llama3.1-8b": (3 + 32 * 9, (8.0, 8.1), (8.0, 8.1)),
    "qwen3-30b-a3b": (3 + 48 * 11, (30.4, 30.6), (3.2, 3.4)),
    "qwen3.5-35b-a3b": (3 + 30 * 18 + 10 * 15, (34, 35), (3.0, 3.6)),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_shape_has_the_published_tensor_and_parameter_counts(name: str) -> None:
    config = TargetConfig.from_hf(TARGET_SHAPES[name])
    shapes = expected_shapes(config)
    tensors, (low, high), (active_low, active_high) = PUBLISHED[name]
    assert len(shapes) == tensors
    total = sum(math.prod(s) for s in shapes.values())
    assert low <= total / 1e9 <= high
    experts = sum(math.prod(s) for n, s in shapes.items() if ".mlp.experts." in n)
    unused = experts * (1 - config.num_experts_per_tok / config.num_experts) if config.is_moe else 0
    assert active_low <= (total - unused) / 1e9 <= active_high


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_shape_draft_fits_its_target(name: str) -> None:
    target = TargetConfig.from_hf(TARGET_SHAPES[name])
    draft = DraftConfig.from_hf(draft_raw(name, block_size=16, layers=5))
    draft.check_target(target)
    assert draft.target_layer_ids[0] == 1 and draft.target_layer_ids[-1] == target.num_hidden_layers - 3
    heads, kv_heads, head_dim, width = DRAFT_HEADS[name]
    shapes = draft_expected_shapes(draft)
    assert shapes["fc.weight"] == (target.hidden_size, 5 * target.hidden_size)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (heads * head_dim, target.hidden_size)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (kv_heads * head_dim, target.hidden_size)
    assert shapes["layers.0.mlp.gate_proj.weight"] == (width, target.hidden_size)


def test_llama_real_shape_scales_its_rope_as_llama_3_1() -> None:
    config = TargetConfig.from_hf(TARGET_SHAPES["llama3.1-8b"])
    scaling = config.rope_scaling
    assert scaling is not None
    assert (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor) == (8.0, 1.0, 4.0)
    assert scaling.original_max_position_embeddings == 8192


def test_qwen3_30b_a3b_real_shape_routes_every_layer_to_8_of_128_experts() -> None:
    config = TargetConfig.from_hf(TARGET_SHAPES["qwen3-30b-a3b"])
    shapes = expected_shapes(config)
    assert config.moe_layers == tuple(range(48)) and config.norm_topk_prob
    assert shapes["model.layers.47.mlp.experts.gate_up_proj"] == (128, 2 * 768, 2048)
    assert shapes["model.layers.47.mlp.experts.down_proj"] == (128, 2048, 768)
    assert shapes["model.layers.0.mlp.gate.weight"] == (128, 2048)


def test_qwen3_5_35b_a3b_real_shape_has_experts_and_a_shared_expert_on_every_hybrid_layer() -> None:
    config = TargetConfig.from_hf(TARGET_SHAPES["qwen3.5-35b-a3b"])
    shapes = expected_shapes(config)
    assert config.attention_layers == tuple(range(3, 40, 4)) and len(config.linear_layers) == 30
    assert config.moe_layers == tuple(range(40)) and config.norm_topk_prob
    assert config.rotary_dim == 64 and config.rope_theta == 1e7
    for i in (0, 3):
        assert shapes[f"model.layers.{i}.mlp.experts.gate_up_proj"] == (256, 2 * 512, 2048)
        assert shapes[f"model.layers.{i}.mlp.experts.down_proj"] == (256, 2048, 512)
        assert shapes[f"model.layers.{i}.mlp.shared_expert.down_proj.weight"] == (2048, 512)
        assert shapes[f"model.layers.{i}.mlp.shared_expert_gate.weight"] == (1, 2048)
    assert shapes["model.layers.0.linear_attn.conv1d.weight"] == (8192, 1, 4)
    assert shapes["model.layers.3.self_attn.q_proj.weight"] == (2 * 16 * 256, 2048)
