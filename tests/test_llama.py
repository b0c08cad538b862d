"""Llama 3.x (models/llama.py): its config (llama3 RoPE scaling in the v4 and v5 spellings,
biases, tied heads), the llama3 frequencies against transformers' own bit for bit, and the
checkpoint's tensor names. Logit parity with transformers: test_parity_transformers.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from reference_engine.checkpoint import load_target
from reference_engine.checkpoint.__main__ import main as checkpoint_main
from reference_engine.config import FULL_ATTENTION, LLAMA, Llama3RopeScaling, TargetConfig
from reference_engine.errors import ConfigError
from reference_engine.models import expected_shapes
from reference_engine.models.layers import RotaryEmbedding

# Llama-3.1-8B-Instruct's config.json, as published (transformers 4 spelling)
LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "attention_bias": False,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}
LLAMA_3_1_SCALING = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)


def llama(**changes: Any) -> dict[str, Any]:
    return {**copy.deepcopy(LLAMA_3_1_8B), **changes}


# ----------------------------------------------------------------------------- config
def test_llama_3_1_config_parses_every_field() -> None:
    c = TargetConfig.from_hf(llama())
    assert c.family == LLAMA
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (128256, 4096, 14336)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 32, 8, 128)
    assert c.rms_norm_eps == 1e-5 and c.rope_theta == 5e5 and c.max_position_embeddings == 131072
    assert c.rope_scaling == LLAMA_3_1_SCALING
    assert c.layer_types == (FULL_ATTENTION,) * 32 and c.rotary_dim == 128
    assert c.eos_token_ids == (128001, 128008, 128009)
    assert not c.tie_word_embeddings and not c.attention_bias and not c.mlp_bias
    assert not c.qk_norm and not c.norm_offset and not c.gated_attention and not c.is_moe


def test_llama3_scaling_reads_the_same_from_rope_parameters_and_the_legacy_type_key() -> None:
    v4 = TargetConfig.from_hf(llama())
    params = {"rope_theta": 500000.0, **LLAMA_3_1_8B["rope_scaling"]}
    v5 = llama(rope_parameters=params)
    del v5["rope_scaling"], v5["rope_theta"]
    legacy = llama(rope_scaling={**LLAMA_3_1_8B["rope_scaling"], "type": "llama3"})
    del legacy["rope_scaling"]["rope_type"]
    assert TargetConfig.from_hf(v5) == v4 == TargetConfig.from_hf(legacy)


def test_missing_original_max_position_embeddings_falls_back_to_max_position_embeddings() -> None:
    raw = llama(max_position_embeddings=16384)
    del raw["rope_scaling"]["original_max_position_embeddings"]
    assert TargetConfig.from_hf(raw).rope_scaling.original_max_position_embeddings == 16384


def test_llama_without_rope_scaling_uses_the_default_rope() -> None:
    c = TargetConfig.from_hf(llama(rope_scaling=None))
    assert c.rope_scaling is None
    plain = RotaryEmbedding(c.rotary_dim, c.rope_theta).inv_freq
    assert torch.equal(RotaryEmbedding(c.rotary_dim, c.rope_theta, c.rope_scaling).inv_freq, plain)


def test_llama_defaults_follow_transformers() -> None:
    raw = llama()
    for name in ("num_key_value_heads", "head_dim", "max_position_embeddings", "rope_scaling", "mlp_bias"):
        del raw[name]
    c = TargetConfig.from_hf(raw)
    assert c.num_key_value_heads == 32 and c.head_dim == 4096 // 32
    assert c.max_position_embeddings == 2048 and c.rope_scaling is None and not c.mlp_bias


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope type 'yarn' is not supported"),
        (
            {"rope_scaling": {**LLAMA_3_1_8B["rope_scaling"], "factor": 0.5}},
            r"'factor' must be >= 1, got 0.5",
        ),
        (
            {"rope_scaling": {**LLAMA_3_1_8B["rope_scaling"], "high_freq_factor": 1.0}},
            r"low_freq_factor < high_freq_factor, got low_freq_factor 1.0 and high_freq_factor 1.0",
        ),
        (
            {"rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
            r"llama3 rope scaling\): required field 'factor' is missing",
        ),
        (
            {"rope_scaling": {**LLAMA_3_1_8B["rope_scaling"], "original_max_position_embeddings": 0}},
            r"'original_max_position_embeddings' must be a positive integer, got 0",
        ),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported \(expected silu\)"),
        ({"intermediate_size": None}, r"required field 'intermediate_size' is missing"),
    ],
    ids=["yarn", "factor-below-one", "band-empty", "no-factor", "zero-original", "gelu", "no-intermediate"],
)
def test_bad_llama_field_is_rejected_with_its_value(change: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        TargetConfig.from_hf(llama(**change))


def test_llama3_scaling_is_rejected_for_other_families() -> None:
    raw = {**llama(), "model_type": "qwen3"}
    with pytest.raises(ConfigError, match=r"rope type 'llama3' is not supported \(expected default\)"):
        TargetConfig.from_hf(raw)


# ----------------------------------------------------------------------------- RoPE
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("original", [8192, 256])
def test_llama3_frequencies_are_the_bits_of_transformers(head_dim: int, original: int) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {**LLAMA_3_1_8B["rope_scaling"], "original_max_position_embeddings": original}
    hf_config = transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters={"rope_theta": 500000.0, **rope},
    )
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    c = TargetConfig.from_hf(llama(head_dim=head_dim, rope_scaling=rope))
    ours = RotaryEmbedding(c.rotary_dim, c.rope_theta, c.rope_scaling).inv_freq
    assert attention_factor == 1.0
    assert ours.dtype == expected.dtype == torch.float32
    assert torch.equal(ours, expected)
    plain = RotaryEmbedding(c.rotary_dim, c.rope_theta).inv_freq
    assert not torch.equal(ours, plain)


def test_llama3_scaling_keeps_short_divides_long_and_blends_the_band_between() -> None:
    inv = RotaryEmbedding(128, 5e5).inv_freq
    scaled = RotaryEmbedding(128, 5e5, LLAMA_3_1_SCALING).inv_freq
    wavelen = 2 * torch.pi / inv
    short, long = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert short.any() and long.any() and (~short & ~long).any()
    assert torch.equal(scaled[short], inv[short])
    assert torch.equal(scaled[long], inv[long] / 8)
    band = ~short & ~long
    assert ((scaled[band] < inv[band]) & (scaled[band] > inv[band] / 8)).all()


# ----------------------------------------------------------------------------- tensors
def test_llama_tensors_have_no_query_key_norms_and_biases_only_when_configured() -> None:
    raw = llama(num_hidden_layers=1)
    names = set(expected_shapes(TargetConfig.from_hf(raw)))
    assert not any("q_norm" in n or "k_norm" in n or n.endswith(".bias") for n in names)
    biased = expected_shapes(TargetConfig.from_hf({**raw, "attention_bias": True, "mlp_bias": True}))
    assert {n for n in biased if n.endswith(".bias")} == {
        f"model.layers.0.{part}.bias"
        for part in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    assert biased["model.layers.0.self_attn.k_proj.bias"] == (8 * 128,)
    assert biased["model.layers.0.mlp.down_proj.bias"] == (4096,)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_make_tiny_llama_writes_a_loadable_checkpoint(tmp_path: Path, tied: bool) -> None:
    out = tmp_path / "llama"
    argv = ["make-tiny", "--arch", "llama", "--out", str(out), "--layers", "2", "--bias"]
    assert checkpoint_main(argv + (["--tie-word-embeddings"] if tied else [])) == 0
    model = load_target(out, dtype=torch.float64)
    c = model.config
    assert c.family == LLAMA and c.rope_scaling is not None and c.attention_bias and c.mlp_bias
    assert ("lm_head.weight" in model.state_dict()) is not tied
    assert model.model.layers[0].mlp.down_proj.bias.abs().max() < 1.0  # biases, not norm weights
