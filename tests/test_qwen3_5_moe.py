"""Qwen3.5-MoE (models/qwen3_5_moe.py): its config in the multimodal wrapper and text-only
spellings, the tensors of its hybrid MoE layers, and the wrapper checkpoint (language model
prefix; `mtp.*` experts and `model.visual.*` ignored) in both expert layouts. Logit parity
with transformers: test_parity_transformers.py; the MoE block itself: test_moe.py."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from reference_engine.checkpoint import SINGLE_FILE, load_target
from reference_engine.checkpoint.__main__ import main as checkpoint_main
from reference_engine.config import FULL_ATTENTION, LINEAR_ATTENTION, QWEN3_5_MOE, TargetConfig
from reference_engine.errors import ConfigError
from reference_engine.models import expected_shapes
from reference_engine.models.moe import SparseMoeBlock

TinyCheckpoint = Callable[..., Path]
F, L = FULL_ATTENTION, LINEAR_ATTENTION

# Qwen3.5-35B-A3B's text config (transformers' defaults are this model's)
TEXT: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_act": "silu",
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "full_attention_interval": 4,
    "attention_bias": False,
    "attn_output_gate": True,
    "mtp_num_hidden_layers": 1,
    "mamba_ssm_dtype": "float32",
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
    },
    "eos_token_id": 248044,
}
WRAPPER: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": {k: v for k, v in TEXT.items() if k != "eos_token_id"},
    "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 27, "hidden_size": 1152},
    "tie_word_embeddings": False,
    "eos_token_id": 248044,
    "image_token_id": 248056,
}


def text(**changes: Any) -> dict[str, Any]:
    return {**copy.deepcopy(TEXT), **changes}


# ----------------------------------------------------------------------------- config
def test_qwen3_5_35b_a3b_wrapper_config_parses_every_field() -> None:
    c = TargetConfig.from_hf(copy.deepcopy(WRAPPER))
    assert c.family == QWEN3_5_MOE and c.is_moe and c.is_hybrid
    assert c.layer_types == (L, L, L, F) * 10
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (256, 8, 512)
    assert c.shared_expert_intermediate_size == 512 and c.intermediate_size == 0
    assert c.norm_topk_prob and c.moe_layers == tuple(range(40)) and c.dense_layers == ()
    assert c.norm_offset and c.gated_attention and c.qk_norm
    assert c.rotary_dim == 64 and c.rope_theta == 1e7 and c.eos_token_ids == (248044,)
    assert c.conv_dim == 2 * 16 * 128 + 32 * 128


def test_text_only_config_equals_the_wrapper_around_it() -> None:
    assert TargetConfig.from_hf(text(tie_word_embeddings=False)) == TargetConfig.from_hf(
        copy.deepcopy(WRAPPER)
    )


def test_stray_dense_fields_are_ignored_and_routing_always_renormalises() -> None:
    """transformers deletes mlp_only_layers and has no norm_topk_prob, intermediate_size or
    decoder_sparse_step for Qwen3.5-MoE: every layer is MoE and renormalises."""
    stray = text(norm_topk_prob=False, mlp_only_layers=[0, 1], intermediate_size=6144, decoder_sparse_step=2)
    c = TargetConfig.from_hf(stray)
    assert c == TargetConfig.from_hf(text())
    assert c.norm_topk_prob and c.moe_layers == tuple(range(40))


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"shared_expert_intermediate_size": None}, r"required field 'shared_expert_intermediate_size'"),
        ({"num_experts_per_tok": 0}, r"'num_experts_per_tok' must be a positive integer, got 0"),
        ({"num_experts": 4}, r"num_experts_per_tok 8 must be between 1 and num_experts 4"),
        (
            {"linear_num_value_heads": 24},
            r"linear_num_value_heads 24 is not a multiple of linear_num_key_heads 16",
        ),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported \(expected silu\)"),
    ],
    ids=["no-shared-width", "zero-top-k", "top-k-above-experts", "linear-heads", "gelu"],
)
def test_bad_qwen3_5_moe_field_is_rejected_with_its_value(change: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        TargetConfig.from_hf(text(**change))


def test_wrapper_without_text_config_is_rejected_by_model_type() -> None:
    raw = copy.deepcopy(WRAPPER)
    del raw["text_config"]
    with pytest.raises(ConfigError, match=r"qwen3_5_moe config: 'text_config' is missing"):
        TargetConfig.from_hf(raw)


# ----------------------------------------------------------------------------- tensors
def test_every_layer_has_routed_experts_and_a_gated_shared_expert_and_no_dense_mlp() -> None:
    c = TargetConfig.from_hf(text(num_hidden_layers=4))
    shapes = expected_shapes(c)
    for i in range(4):
        assert shapes[f"model.layers.{i}.mlp.gate.weight"] == (256, 2048)
        assert shapes[f"model.layers.{i}.mlp.shared_expert.gate_proj.weight"] == (512, 2048)
        assert shapes[f"model.layers.{i}.mlp.shared_expert_gate.weight"] == (1, 2048)
        assert f"model.layers.{i}.mlp.gate_proj.weight" not in shapes
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in shapes
    assert "model.layers.3.self_attn.q_proj.weight" in shapes


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_wrapper_checkpoint_loads_to_the_text_only_model_in_either_expert_layout(
    tiny_checkpoint: TinyCheckpoint, layout: str
) -> None:
    wrapped = tiny_checkpoint("qwen3_5_moe", multimodal_wrapper=True, expert_layout=layout)
    stored = load_file(str(wrapped / SINGLE_FILE))
    assert (
        "mtp.layers.0.mlp.experts.gate_up_proj" in stored and "model.visual.patch_embed.proj.weight" in stored
    )
    fused_name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert (fused_name in stored) == (layout == "fused")
    ours = load_target(wrapped, dtype=torch.float64).state_dict()
    text_only = load_target(tiny_checkpoint("qwen3_5_moe"), dtype=torch.float64).state_dict()
    assert ours.keys() == text_only.keys()
    assert all(torch.equal(ours[n], text_only[n]) for n in ours)
    assert not any(n.startswith(("mtp.", "model.visual.")) for n in ours)


def test_tiny_shared_expert_is_wider_than_the_routed_ones(tiny_checkpoint: TinyCheckpoint) -> None:
    """Different widths, so that a swap of the two would not load."""
    model = load_target(tiny_checkpoint("qwen3_5_moe"))
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    assert block.experts.down_proj.shape == (8, 64, 32)
    assert block.shared_expert.down_proj.weight.shape == (64, 48)


def test_make_tiny_qwen3_5_moe_cli_writes_the_wrapper_with_fused_experts(tmp_path: Path) -> None:
    out = tmp_path / "q35moe"
    argv = ["make-tiny", "--arch", "qwen3_5_moe", "--out", str(out), "--multimodal-wrapper"]
    assert checkpoint_main([*argv, "--expert-layout", "fused"]) == 0
    names = set(load_file(str(out / SINGLE_FILE)))
    assert "model.language_model.layers.3.mlp.experts.down_proj" in names
    config = load_target(out).config
    assert config.family == QWEN3_5_MOE and config.layer_types == (L, F, L, F)


def test_multimodal_wrapper_is_refused_for_an_arch_without_one(tmp_path: Path, capsys) -> None:
    argv = ["make-tiny", "--arch", "qwen3_moe", "--out", str(tmp_path / "x"), "--multimodal-wrapper"]
    assert checkpoint_main(argv) == 2
    assert (
        "--multimodal-wrapper applies to --arch qwen3_5 or qwen3_5_moe only, got qwen3_moe"
        in capsys.readouterr().err
    )
