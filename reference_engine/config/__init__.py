"""Frozen model configurations parsed from Hugging Face `config.json` files.

Only the fields the forward passes need are kept. Parsing validates ranges and raises
`ConfigError` with the field, the value and what was expected.

Three modules: `fields` (what both read: layer kinds, field parsers, RoPE), `target`
(TargetConfig and the families) and `draft` (DraftConfig)."""

from .draft import DFLASH, DFLASH2, DRAFT_ARCHITECTURES, DraftConfig, published_target_layer_ids
from .fields import FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION, Llama3RopeScaling
from .target import (
    FAMILIES,
    HYBRID_FAMILIES,
    LLAMA,
    MODEL_TYPES,
    MOE_FAMILIES,
    QWEN3,
    QWEN3_5,
    QWEN3_5_MOE,
    QWEN3_MOE,
    SUPPORTED_TARGET_TYPES,
    WRAPPER_TYPES,
    TargetConfig,
)

__all__ = [
    "DFLASH",
    "DFLASH2",
    "DRAFT_ARCHITECTURES",
    "FAMILIES",
    "FULL_ATTENTION",
    "HYBRID_FAMILIES",
    "LINEAR_ATTENTION",
    "LLAMA",
    "MODEL_TYPES",
    "MOE_FAMILIES",
    "QWEN3",
    "QWEN3_5",
    "QWEN3_5_MOE",
    "QWEN3_MOE",
    "SLIDING_ATTENTION",
    "SUPPORTED_TARGET_TYPES",
    "WRAPPER_TYPES",
    "DraftConfig",
    "Llama3RopeScaling",
    "TargetConfig",
    "published_target_layer_ids",
]
