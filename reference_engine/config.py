"""Frozen model configurations parsed from Hugging Face `config.json` files.

Only the fields the forward passes need are kept. Parsing validates ranges and raises
`ConfigError` with the field, the value and what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
SLIDING_ATTENTION = "sliding_attention"

QWEN3 = "qwen3"
QWEN3_5 = "qwen3_5"
SUPPORTED_TARGET_TYPES = ("qwen3", "qwen3_5", "qwen3_5_text")


def _require(raw: dict[str, Any], name: str, where: str) -> Any:
    if name not in raw or raw[name] is None:
        raise ConfigError(f"{where}: required field '{name}' is missing")
    return raw[name]


def _positive_int(raw: dict[str, Any], name: str, where: str, default: int | None = None) -> int:
    value = raw.get(name, default)
    if value is None:
        raise ConfigError(f"{where}: required field '{name}' is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}: '{name}' must be a positive integer, got {value!r}")
    return value


def _rope_theta(raw: dict[str, Any], where: str) -> float:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise ConfigError(f"{where}: rope type '{rope_type}' is not supported (only the default RoPE)")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{where}: 'rope_theta' must be a positive number, got {theta!r}")
    return float(theta)


def _eos_ids(raw: dict[str, Any], outer: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id", outer.get("eos_token_id"))
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)


@dataclass(frozen=True)
class TargetConfig:
    """A Qwen3 dense or Qwen3.5 hybrid text model, as the forward pass needs it."""

    family: str  # QWEN3 or QWEN3_5
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    sliding_window: int | None = None
    # Gated DeltaNet (Qwen3.5 linear-attention layers)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    eos_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        where = f"{self.family} config"
        if self.family not in (QWEN3, QWEN3_5):
            raise ConfigError(f"unknown model family '{self.family}', expected qwen3 or qwen3_5")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{where}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"{where}: layer_types has {len(self.layer_types)} entries, expected "
                f"num_hidden_layers = {self.num_hidden_layers}"
            )
        allowed = (
            (FULL_ATTENTION, LINEAR_ATTENTION)
            if self.family == QWEN3_5
            else (FULL_ATTENTION, SLIDING_ATTENTION)
        )
        for i, kind in enumerate(self.layer_types):
            if kind not in allowed:
                raise ConfigError(f"{where}: layer_types[{i}] = '{kind}' is not one of {list(allowed)}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError(
                f"{where}: partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}"
            )
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ConfigError(
                f"{where}: rotary dimension head_dim * partial_rotary_factor = {self.rotary_dim} "
                "must be a positive even number"
            )
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"{where}: rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ConfigError(f"{where}: sliding_attention layers need a positive sliding_window")
        if LINEAR_ATTENTION in self.layer_types:
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ConfigError(
                    f"{where}: linear_num_value_heads {self.linear_num_value_heads} is not a "
                    f"multiple of linear_num_key_heads {self.linear_num_key_heads}"
                )
        for eos in self.eos_token_ids:
            if not 0 <= eos < self.vocab_size:
                raise ConfigError(
                    f"{where}: eos_token_id {eos} outside the vocabulary [0, {self.vocab_size})"
                )

    # Derived sizes -------------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    @property
    def norm_offset(self) -> bool:
        """Qwen3.5 RMSNorm multiplies by (1 + w); Qwen3 by w."""
        return self.family == QWEN3_5

    @property
    def gated_attention(self) -> bool:
        return self.family == QWEN3_5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t != LINEAR_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    # Parsing -------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> TargetConfig:
        """Parse a Hugging Face config.json dict (qwen3, qwen3_5 wrapper, qwen3_5_text)."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_TARGET_TYPES:
            raise ConfigError(
                f"unknown model_type {model_type!r}; supported targets: {', '.join(SUPPORTED_TARGET_TYPES)}"
            )
        outer = raw
        if model_type == "qwen3_5":
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("qwen3_5 config: 'text_config' is missing or not an object")
            raw = text
        family = QWEN3 if model_type == QWEN3 else QWEN3_5
        where = f"{model_type} config"

        num_layers = _positive_int(raw, "num_hidden_layers", where)
        hidden = _positive_int(raw, "hidden_size", where)
        heads = _positive_int(raw, "num_attention_heads", where)
        head_dim = raw.get("head_dim") or hidden // heads
        kv_heads = _positive_int(raw, "num_key_value_heads", where, default=heads)
        params = raw.get("rope_parameters") or {}
        partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
        if partial is None:
            partial = 0.25 if family == QWEN3_5 else 1.0

        layer_types = raw.get("layer_types")
        sliding_window = None
        if family == QWEN3_5:
            if layer_types is None:
                interval = _positive_int(raw, "full_attention_interval", where, default=4)
                layer_types = [
                    FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)
                ]
            linear = dict(
                linear_num_key_heads=_positive_int(raw, "linear_num_key_heads", where),
                linear_num_value_heads=_positive_int(raw, "linear_num_value_heads", where),
                linear_key_head_dim=_positive_int(raw, "linear_key_head_dim", where),
                linear_value_head_dim=_positive_int(raw, "linear_value_head_dim", where),
                linear_conv_kernel_dim=_positive_int(raw, "linear_conv_kernel_dim", where),
            )
        else:
            linear = {}
            if raw.get("use_sliding_window"):
                sliding_window = raw.get("sliding_window")
            if layer_types is None:
                window_from = raw.get("max_window_layers", num_layers)
                layer_types = [
                    SLIDING_ATTENTION if sliding_window and i >= window_from else FULL_ATTENTION
                    for i in range(num_layers)
                ]
            elif SLIDING_ATTENTION in layer_types:
                sliding_window = raw.get("sliding_window")

        tie = raw.get("tie_word_embeddings", outer.get("tie_word_embeddings", False))
        return cls(
            family=family,
            vocab_size=_positive_int(raw, "vocab_size", where),
            hidden_size=hidden,
            intermediate_size=_positive_int(raw, "intermediate_size", where),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=_positive_int({"head_dim": head_dim}, "head_dim", where),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw, where),
            max_position_embeddings=_positive_int(raw, "max_position_embeddings", where, default=32768),
            tie_word_embeddings=bool(tie),
            layer_types=tuple(layer_types),
            partial_rotary_factor=float(partial),
            attention_bias=bool(raw.get("attention_bias", False)),
            sliding_window=sliding_window,
            eos_token_ids=_eos_ids(raw, outer),
            **linear,
        )


def published_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's fallback when a draft names no target layers: spread evenly over 1..N-3
    (one draft layer: the middle layer). Python's round() as published."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DraftConfig:
    """A z-lab DFlash draft (`architectures: ["DFlashDraftModel"]`): Qwen3-style layers that
    attend over projected target features plus the noise block."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    attention_bias: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        where = "DFlash draft config"
        if self.block_size < 2:
            raise ConfigError(f"{where}: block_size must be >= 2, got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{where}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not self.target_layer_ids:
            raise ConfigError(f"{where}: target_layer_ids is empty")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"{where}: layer_types has {len(self.layer_types)} entries, expected "
                f"num_hidden_layers = {self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in (FULL_ATTENTION, SLIDING_ATTENTION):
                raise ConfigError(
                    f"{where}: layer_types[{i}] = '{kind}' is not full_attention or sliding_attention"
                )
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ConfigError(f"{where}: sliding_attention layers need a positive sliding_window")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"{where}: mask_token_id {self.mask_token_id} outside the vocabulary [0, {self.vocab_size})"
            )

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> DraftConfig:
        where = "DFlash draft config"
        if "DFlashDraftModel" not in (raw.get("architectures") or []):
            raise ConfigError(
                f"not a DFlash draft: architectures {raw.get('architectures')!r} does not "
                "name DFlashDraftModel"
            )
        dflash = raw.get("dflash_config") or {}
        num_layers = _positive_int(raw, "num_hidden_layers", where)
        hidden = _positive_int(raw, "hidden_size", where)
        heads = _positive_int(raw, "num_attention_heads", where)
        num_target = _positive_int(raw, "num_target_layers", where)
        ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
        ids = tuple(ids) if ids else published_target_layer_ids(num_target, num_layers)
        mask = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if mask is None:
            raise ConfigError(f"{where}: no mask_token_id (in dflash_config or top level)")
        sliding_window = raw.get("sliding_window")
        layer_types = raw.get("layer_types") or [FULL_ATTENTION] * num_layers
        softcap = raw.get("final_logit_softcapping")
        return cls(
            vocab_size=_positive_int(raw, "vocab_size", where),
            hidden_size=hidden,
            intermediate_size=_positive_int(raw, "intermediate_size", where),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=_positive_int(raw, "num_key_value_heads", where, default=heads),
            head_dim=_positive_int(raw, "head_dim", where, default=hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw, where),
            max_position_embeddings=_positive_int(raw, "max_position_embeddings", where, default=32768),
            block_size=_positive_int(dflash, "block_size", where, default=raw.get("block_size", 16)),
            num_target_layers=num_target,
            target_layer_ids=ids,
            mask_token_id=int(mask),
            layer_types=tuple(layer_types),
            sliding_window=sliding_window if SLIDING_ATTENTION in layer_types else None,
            attention_bias=bool(raw.get("attention_bias", False)),
            input_embedding_scale=float(
                dflash.get("input_embedding_scale", raw.get("input_embedding_scale", 1.0))
            ),
            output_multiplier=float(dflash.get("output_multiplier", raw.get("output_multiplier", 1.0))),
            final_logit_softcapping=float(softcap) if softcap else None,
        )

    def check_target(self, target: TargetConfig) -> None:
        """Reject a draft/target pair that cannot work together."""
        if self.hidden_size != target.hidden_size:
            raise ConfigError(
                f"draft hidden_size {self.hidden_size} does not match the target's {target.hidden_size}"
            )
        if self.vocab_size != target.vocab_size:
            raise ConfigError(
                f"draft vocab_size {self.vocab_size} does not match the target's {target.vocab_size}"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ConfigError(
                f"draft target_layer_ids {list(self.target_layer_ids)} out of range for a "
                f"{target.num_hidden_layers}-layer target"
            )
        if self.num_target_layers != target.num_hidden_layers:
            raise ConfigError(
                f"draft was built for a {self.num_target_layers}-layer target (num_target_layers)"
                f", the target has {target.num_hidden_layers} layers"
            )
