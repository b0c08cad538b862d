"""Parsing Hugging Face config.json dicts into TargetConfig: the three layouts, derived
defaults, and range checks. The dicts below follow the published Qwen3 / Qwen3.5 configs."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from reference_engine.config import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    QWEN3,
    QWEN3_5,
    SLIDING_ATTENTION,
    TargetConfig,
)
from reference_engine.errors import ConfigError

F, L, S = FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION

QWEN3_RAW: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "use_sliding_window": False,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

QWEN3_5_TEXT_RAW: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "layer_types": [L, L, L, F, L, L, L, F],
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "attention_bias": False,
    "eos_token_id": 248044,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
    },
}

QWEN3_5_WRAPPER_RAW: dict[str, Any] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": {k: v for k, v in QWEN3_5_TEXT_RAW.items() if k != "eos_token_id"},
    "vision_config": {"model_type": "qwen3_5_vision", "depth": 24, "hidden_size": 1024},
    "tie_word_embeddings": True,
    "eos_token_id": 248044,
    "image_token_id": 248056,
}


def qwen3(**changes: Any) -> dict[str, Any]:
    return {**copy.deepcopy(QWEN3_RAW), **changes}


def qwen3_5_text(**changes: Any) -> dict[str, Any]:
    return {**copy.deepcopy(QWEN3_5_TEXT_RAW), **changes}


# ----------------------------------------------------------------------------- layouts
def test_qwen3_config_parses_every_field() -> None:
    c = TargetConfig.from_hf(qwen3())
    assert c.family == QWEN3
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (151936, 1024, 3072)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (28, 16, 8)
    assert c.head_dim == 128
    assert c.rms_norm_eps == 1e-6
    assert c.rope_theta == 1e6
    assert c.max_position_embeddings == 40960
    assert c.tie_word_embeddings
    assert c.layer_types == (F,) * 28
    assert c.partial_rotary_factor == 1.0 and c.rotary_dim == 128
    assert c.sliding_window is None
    assert c.eos_token_ids == (151645,)
    assert not c.is_hybrid and not c.norm_offset and not c.gated_attention
    assert c.attention_layers == tuple(range(28)) and c.linear_layers == ()


def test_qwen3_5_wrapper_config_reads_text_config_and_outer_fields() -> None:
    c = TargetConfig.from_hf(copy.deepcopy(QWEN3_5_WRAPPER_RAW))
    assert c.family == QWEN3_5
    assert c.hidden_size == 2048 and c.num_hidden_layers == 8
    assert c.layer_types == (L, L, L, F, L, L, L, F)
    assert c.attention_layers == (3, 7) and c.linear_layers == (0, 1, 2, 4, 5, 6)
    # tie_word_embeddings and eos_token_id sit on the outer config in this layout
    assert c.tie_word_embeddings
    assert c.eos_token_ids == (248044,)
    assert c.rope_theta == 1e7
    assert c.partial_rotary_factor == 0.25 and c.rotary_dim == 64
    assert (c.linear_num_key_heads, c.linear_num_value_heads) == (16, 32)
    assert (c.linear_key_head_dim, c.linear_value_head_dim) == (128, 128)
    assert c.linear_conv_kernel_dim == 4
    assert c.conv_dim == 2 * 16 * 128 + 32 * 128
    assert c.is_hybrid and c.norm_offset and c.gated_attention


def test_qwen3_5_text_config_equals_the_wrapper_around_it() -> None:
    text = TargetConfig.from_hf(qwen3_5_text(tie_word_embeddings=True))
    wrapped = TargetConfig.from_hf(copy.deepcopy(QWEN3_5_WRAPPER_RAW))
    assert text == wrapped


def test_text_config_fields_take_precedence_over_the_wrapper() -> None:
    raw = copy.deepcopy(QWEN3_5_WRAPPER_RAW)
    raw["text_config"].update(tie_word_embeddings=False, eos_token_id=[1, 2])
    c = TargetConfig.from_hf(raw)
    assert not c.tie_word_embeddings
    assert c.eos_token_ids == (1, 2)


def test_config_is_frozen() -> None:
    c = TargetConfig.from_hf(qwen3())
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 8  # type: ignore[misc]


# ----------------------------------------------------------------------------- defaults
@pytest.mark.parametrize(
    ("layers", "interval", "expected"),
    [
        (8, 4, (L, L, L, F, L, L, L, F)),
        (6, 3, (L, L, F, L, L, F)),
        (5, 2, (L, F, L, F, L)),
        (3, 1, (F, F, F)),
    ],
)
def test_layer_types_follow_full_attention_interval_when_absent(
    layers: int, interval: int, expected: tuple[str, ...]
) -> None:
    raw = qwen3_5_text(num_hidden_layers=layers, full_attention_interval=interval)
    del raw["layer_types"]
    assert TargetConfig.from_hf(raw).layer_types == expected


def test_full_attention_interval_defaults_to_4() -> None:
    raw = qwen3_5_text()
    del raw["layer_types"], raw["full_attention_interval"]
    assert TargetConfig.from_hf(raw).layer_types == (L, L, L, F, L, L, L, F)


def test_explicit_layer_types_win_over_full_attention_interval() -> None:
    raw = qwen3_5_text(num_hidden_layers=4, layer_types=[F, L, L, L], full_attention_interval=2)
    assert TargetConfig.from_hf(raw).layer_types == (F, L, L, L)


def test_partial_rotary_factor_defaults_to_quarter_for_qwen3_5() -> None:
    raw = qwen3_5_text()
    del raw["rope_parameters"]["partial_rotary_factor"]
    c = TargetConfig.from_hf(raw)
    assert c.partial_rotary_factor == 0.25
    assert c.rotary_dim == 64


def test_partial_rotary_factor_is_read_from_top_level_without_rope_parameters_entry() -> None:
    raw = qwen3_5_text(partial_rotary_factor=0.5)
    del raw["rope_parameters"]["partial_rotary_factor"]
    assert TargetConfig.from_hf(raw).partial_rotary_factor == 0.5


def test_partial_rotary_factor_defaults_to_one_for_qwen3() -> None:
    c = TargetConfig.from_hf(qwen3())
    assert c.partial_rotary_factor == 1.0
    assert c.rotary_dim == c.head_dim


def test_rope_theta_is_read_from_rope_parameters() -> None:
    raw = qwen3(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    del raw["rope_theta"]
    assert TargetConfig.from_hf(raw).rope_theta == 5e5


def test_rope_theta_in_rope_parameters_wins_over_top_level() -> None:
    raw = qwen3(rope_theta=1234.0, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert TargetConfig.from_hf(raw).rope_theta == 5e5


def test_rope_theta_is_read_from_top_level() -> None:
    assert TargetConfig.from_hf(qwen3(rope_theta=75000)).rope_theta == 75000.0


def test_rope_theta_defaults_to_10000() -> None:
    raw = qwen3()
    del raw["rope_theta"]
    assert TargetConfig.from_hf(raw).rope_theta == 10000.0


def test_head_dim_defaults_to_hidden_over_heads() -> None:
    raw = qwen3()
    del raw["head_dim"]
    assert TargetConfig.from_hf(raw).head_dim == 1024 // 16


def test_num_key_value_heads_defaults_to_num_attention_heads() -> None:
    raw = qwen3()
    del raw["num_key_value_heads"]
    assert TargetConfig.from_hf(raw).num_key_value_heads == 16


def test_eos_token_id_list_and_absence() -> None:
    assert TargetConfig.from_hf(qwen3(eos_token_id=[151645, 151643])).eos_token_ids == (
        151645,
        151643,
    )
    raw = qwen3()
    del raw["eos_token_id"]
    assert TargetConfig.from_hf(raw).eos_token_ids == ()


def test_qwen3_sliding_window_applies_from_max_window_layers() -> None:
    raw = qwen3(num_hidden_layers=4, use_sliding_window=True, sliding_window=128, max_window_layers=2)
    c = TargetConfig.from_hf(raw)
    assert c.layer_types == (F, F, S, S)
    assert c.sliding_window == 128


def test_qwen3_sliding_window_is_off_unless_use_sliding_window() -> None:
    c = TargetConfig.from_hf(qwen3(sliding_window=128, max_window_layers=2))
    assert c.layer_types == (F,) * 28
    assert c.sliding_window is None


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("rope", "name"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}}, "linear"),
    ],
    ids=["rope_scaling-yarn", "legacy-type-key", "rope_parameters-linear"],
)
def test_unsupported_rope_type_is_rejected_by_name(rope: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError, match=rf"rope type '{name}' is not supported"):
        TargetConfig.from_hf(qwen3(**rope))


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", None])
def test_unknown_model_type_is_rejected_with_the_supported_list(model_type: str | None) -> None:
    with pytest.raises(ConfigError, match=r"unknown model_type .*supported targets: qwen3, "):
        TargetConfig.from_hf(qwen3(model_type=model_type))


def test_wrapper_without_text_config_is_rejected() -> None:
    raw = copy.deepcopy(QWEN3_5_WRAPPER_RAW)
    del raw["text_config"]
    with pytest.raises(ConfigError, match=r"'text_config' is missing"):
        TargetConfig.from_hf(raw)


@pytest.mark.parametrize(
    ("raw", "pattern"),
    [
        (
            qwen3(num_attention_heads=12, num_key_value_heads=8),
            r"num_attention_heads 12 is not a multiple of num_key_value_heads 8",
        ),
        (qwen3(hidden_size=-1024), r"'hidden_size' must be a positive integer, got -1024"),
        (qwen3(num_hidden_layers=0), r"'num_hidden_layers' must be a positive integer, got 0"),
        (qwen3(num_hidden_layers=True), r"'num_hidden_layers' must be a positive integer"),
        (qwen3(vocab_size=512.0), r"'vocab_size' must be a positive integer, got 512.0"),
        (qwen3(intermediate_size=None), r"required field 'intermediate_size' is missing"),
        (
            qwen3(num_hidden_layers=4, layer_types=[F, F, F]),
            r"layer_types has 3 entries, expected num_hidden_layers = 4",
        ),
        (qwen3(num_hidden_layers=2, layer_types=[F, L]), r"layer_types\[1\] = 'linear_attention'"),
        (
            qwen3(num_hidden_layers=2, layer_types=[F, S], use_sliding_window=True, sliding_window=0),
            r"sliding_window must be a positive integer \(or null: no window\), got 0",
        ),
        (qwen3(rope_theta=-1.0), r"'rope_theta' must be a positive number, got -1.0"),
        (qwen3(rms_norm_eps=0.0), r"rms_norm_eps must be > 0"),
        (qwen3(eos_token_id=151936), r"eos_token_id 151936 outside the vocabulary \[0, 151936\)"),
        (qwen3(partial_rotary_factor=1.5), r"partial_rotary_factor must be in \(0, 1\], got 1.5"),
        (qwen3(partial_rotary_factor=0.01), r"rotary dimension .* = 1 must be a positive even"),
        (
            qwen3_5_text(layer_types=[L, L, L, S, L, L, L, F]),
            r"layer_types\[3\] = 'sliding_attention'",
        ),
        (
            qwen3_5_text(linear_num_value_heads=24, linear_num_key_heads=16),
            r"linear_num_value_heads 24 is not a multiple of linear_num_key_heads 16",
        ),
        (qwen3_5_text(linear_conv_kernel_dim=None), r"'linear_conv_kernel_dim' is missing"),
    ],
    ids=[
        "heads-not-multiple",
        "negative-hidden",
        "zero-layers",
        "bool-layers",
        "float-vocab",
        "missing-intermediate",
        "layer-types-length",
        "linear-layer-in-qwen3",
        "zero-window",
        "negative-rope-theta",
        "zero-eps",
        "eos-outside-vocab",
        "partial-rotary-above-one",
        "odd-rotary-dim",
        "sliding-layer-in-qwen3_5",
        "linear-heads-not-multiple",
        "missing-linear-field",
    ],
)
def test_field_out_of_range_is_rejected_with_field_and_value(raw: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        TargetConfig.from_hf(raw)


@pytest.mark.parametrize("value", ["151645", 3.0, [1.7], True, [2, True], {"id": 2}])
def test_an_eos_token_id_that_is_not_token_ids_is_refused(value) -> None:
    """`eos_token_id` is a token id or a list of them: a string is not read digit by digit, a
    float is not truncated, a boolean is not id 1; each is a ConfigError naming the field."""
    with pytest.raises(ConfigError, match="'eos_token_id' must be a token id or a list of them"):
        TargetConfig.from_hf(qwen3(eos_token_id=value))
    assert TargetConfig.from_hf(qwen3(eos_token_id=7)).eos_token_ids == (7,)
    assert TargetConfig.from_hf(qwen3(eos_token_id=[7, 9])).eos_token_ids == (7, 9)
    assert TargetConfig.from_hf(qwen3(eos_token_id=None)).eos_token_ids == ()
