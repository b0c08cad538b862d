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
LLAMA = "llama"
QWEN3_MOE = "qwen3_moe"
QWEN3_5_MOE = "qwen3_5_moe"
FAMILIES = (QWEN3, QWEN3_5, LLAMA, QWEN3_MOE, QWEN3_5_MOE)
HYBRID_FAMILIES = (QWEN3_5, QWEN3_5_MOE)  # Gated DeltaNet + gated attention, (1 + w) norms
MOE_FAMILIES = (QWEN3_MOE, QWEN3_5_MOE)
# config.json model_type -> family; the multimodal wrappers nest the text model's config
MODEL_TYPES = {
    "qwen3": QWEN3,
    "qwen3_5": QWEN3_5,
    "qwen3_5_text": QWEN3_5,
    "llama": LLAMA,
    "qwen3_moe": QWEN3_MOE,
    "qwen3_5_moe": QWEN3_5_MOE,
    "qwen3_5_moe_text": QWEN3_5_MOE,
}
WRAPPER_TYPES = ("qwen3_5", "qwen3_5_moe")
SUPPORTED_TARGET_TYPES = tuple(MODEL_TYPES)

DFLASH = "DFlashDraftModel"
DFLASH2 = "DFlash2DraftModel"
DRAFT_ARCHITECTURES = (DFLASH, DFLASH2)


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


def _number(raw: dict[str, Any], name: str, where: str) -> float:
    value = _require(raw, name, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: '{name}' must be a number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.x RoPE scaling (`rope_type: llama3`): frequencies whose wavelength exceeds
    original_max_position_embeddings / low_freq_factor are divided by `factor`, those under
    original_max_position_embeddings / high_freq_factor are kept, and the band between is
    interpolated (models/layers.py: `llama3_inv_freq`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        where = "llama3 rope scaling"
        if not self.factor >= 1.0:
            raise ConfigError(f"{where}: 'factor' must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(
                f"{where}: expected 0 < low_freq_factor < high_freq_factor, got low_freq_factor "
                f"{self.low_freq_factor} and high_freq_factor {self.high_freq_factor}"
            )


def _rope(
    raw: dict[str, Any], where: str, llama3: bool = False, max_positions: int | None = None
) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from a v5 `rope_parameters` or a v4 `rope_theta`
    plus `rope_scaling` (whose legacy key `type` is read too). `llama3`: whether the family
    takes llama3 scaling; `max_positions` stands in for a missing
    original_max_position_embeddings, as transformers does."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    supported = ("default", "llama3") if llama3 else ("default",)
    if rope_type not in (None, *supported):
        raise ConfigError(
            f"{where}: rope type '{rope_type}' is not supported (expected {' or '.join(supported)})"
        )
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{where}: 'rope_theta' must be a positive number, got {theta!r}")
    if rope_type != "llama3":
        return float(theta), None
    values = {"original_max_position_embeddings": max_positions, **scaling, **params}
    rope_where = f"{where} (llama3 rope scaling)"
    return float(theta), Llama3RopeScaling(
        factor=_number(values, "factor", rope_where),
        low_freq_factor=_number(values, "low_freq_factor", rope_where),
        high_freq_factor=_number(values, "high_freq_factor", rope_where),
        original_max_position_embeddings=_positive_int(
            values, "original_max_position_embeddings", rope_where
        ),
    )


def _eos_ids(raw: dict[str, Any], outer: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id", outer.get("eos_token_id"))
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)


@dataclass(frozen=True)
class TargetConfig:
    """A target text model (Qwen3 dense, Qwen3.5 hybrid, Llama 3.x, Qwen3-MoE, Qwen3.5-MoE),
    as the forward pass needs it."""

    family: str  # one of FAMILIES
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's width; 0 when every layer is MoE
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
    rope_scaling: Llama3RopeScaling | None = None  # llama only
    mlp_bias: bool = False  # llama: biases on gate, up and down
    # Mixture of experts (qwen3_moe, qwen3_5_moe)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k weights renormalised to sum to 1
    shared_expert_intermediate_size: int = 0  # qwen3_5_moe: the shared expert's width
    decoder_sparse_step: int = 1  # qwen3_moe: layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here

    def __post_init__(self) -> None:
        where = f"{self.family} config"
        if self.family not in FAMILIES:
            raise ConfigError(f"unknown model family '{self.family}', expected one of {', '.join(FAMILIES)}")
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
        if self.family in HYBRID_FAMILIES:
            allowed: tuple[str, ...] = (FULL_ATTENTION, LINEAR_ATTENTION)
        elif self.family == QWEN3:
            allowed = (FULL_ATTENTION, SLIDING_ATTENTION)
        else:
            allowed = (FULL_ATTENTION,)
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
        if self.rope_scaling is not None and self.family != LLAMA:
            raise ConfigError(f"{where}: llama3 rope scaling applies to llama only")
        if self.is_moe:
            self._check_experts(where)
        dense = self.dense_layers
        if dense and self.intermediate_size <= 0:
            raise ConfigError(
                f"{where}: layers {list(dense)} have a dense MLP and need a positive "
                f"intermediate_size, got {self.intermediate_size}"
            )
        for eos in self.eos_token_ids:
            if not 0 <= eos < self.vocab_size:
                raise ConfigError(
                    f"{where}: eos_token_id {eos} outside the vocabulary [0, {self.vocab_size})"
                )

    def _check_experts(self, where: str) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"{where}: num_experts_per_tok {self.num_experts_per_tok} must be between 1 and "
                f"num_experts {self.num_experts}"
            )
        if self.moe_intermediate_size <= 0:
            raise ConfigError(
                f"{where}: moe_intermediate_size must be positive, got {self.moe_intermediate_size}"
            )
        if self.family == QWEN3_5_MOE and self.shared_expert_intermediate_size <= 0:
            raise ConfigError(
                f"{where}: shared_expert_intermediate_size must be positive, got "
                f"{self.shared_expert_intermediate_size}"
            )
        if self.decoder_sparse_step <= 0:
            raise ConfigError(
                f"{where}: decoder_sparse_step must be positive, got {self.decoder_sparse_step}"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ConfigError(
                f"{where}: mlp_only_layers {list(self.mlp_only_layers)} out of range for "
                f"{self.num_hidden_layers} layers"
            )

    # Derived sizes -------------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    @property
    def norm_offset(self) -> bool:
        """Qwen3.5 RMSNorm multiplies by (1 + w); Qwen3 and Llama by w."""
        return self.family in HYBRID_FAMILIES

    @property
    def gated_attention(self) -> bool:
        return self.family in HYBRID_FAMILIES

    @property
    def qk_norm(self) -> bool:
        """Whether attention norms queries and keys per head (all but Llama)."""
        return self.family != LLAMA

    @property
    def is_moe(self) -> bool:
        return self.family in MOE_FAMILIES

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts (transformers' rule for qwen3_moe)."""
        if not self.is_moe:
            return ()
        return tuple(
            i
            for i in range(self.num_hidden_layers)
            if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def dense_layers(self) -> tuple[int, ...]:
        moe = set(self.moe_layers)
        return tuple(i for i in range(self.num_hidden_layers) if i not in moe)

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
        """Parse a Hugging Face config.json dict (any of SUPPORTED_TARGET_TYPES; a multimodal
        wrapper's text model is read from its `text_config`)."""
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(
                f"unknown model_type {model_type!r}; supported targets: {', '.join(SUPPORTED_TARGET_TYPES)}"
            )
        outer = raw
        if model_type in WRAPPER_TYPES:
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"{model_type} config: 'text_config' is missing or not an object")
            raw = text
        family = MODEL_TYPES[model_type]
        where = f"{model_type} config"
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act '{act}' is not supported (expected silu)")

        num_layers = _positive_int(raw, "num_hidden_layers", where)
        hidden = _positive_int(raw, "hidden_size", where)
        heads = _positive_int(raw, "num_attention_heads", where)
        head_dim = raw.get("head_dim") or hidden // heads
        max_positions = _positive_int(
            raw, "max_position_embeddings", where, default=2048 if family == LLAMA else 32768
        )
        theta, scaling = _rope(raw, where, llama3=family == LLAMA, max_positions=max_positions)
        params = raw.get("rope_parameters") or {}
        partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
        if partial is None:
            partial = 0.25 if family in HYBRID_FAMILIES else 1.0
        tie = raw.get("tie_word_embeddings", outer.get("tie_word_embeddings", False))
        return cls(
            family=family,
            vocab_size=_positive_int(raw, "vocab_size", where),
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=_positive_int(raw, "num_key_value_heads", where, default=heads),
            head_dim=_positive_int({"head_dim": head_dim}, "head_dim", where),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(tie),
            partial_rotary_factor=float(partial),
            attention_bias=bool(raw.get("attention_bias", False)),
            eos_token_ids=_eos_ids(raw, outer),
            **_mixer_fields(family, raw, num_layers, where),
            **_mlp_fields(family, raw, num_layers, where),
        )


def _mixer_fields(family: str, raw: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
    """layer_types and what the token mixers of those layers need."""
    layer_types = raw.get("layer_types")
    if family in HYBRID_FAMILIES:
        if layer_types is None:
            interval = _positive_int(raw, "full_attention_interval", where, default=4)
            layer_types = [
                FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)
            ]
        return dict(
            layer_types=tuple(layer_types),
            linear_num_key_heads=_positive_int(raw, "linear_num_key_heads", where),
            linear_num_value_heads=_positive_int(raw, "linear_num_value_heads", where),
            linear_key_head_dim=_positive_int(raw, "linear_key_head_dim", where),
            linear_value_head_dim=_positive_int(raw, "linear_value_head_dim", where),
            linear_conv_kernel_dim=_positive_int(raw, "linear_conv_kernel_dim", where),
        )
    if family != QWEN3:
        if raw.get("use_sliding_window"):
            # qwen3_moe would slide every layer, which no published checkpoint does
            raise ConfigError(f"{where}: use_sliding_window true is not supported (expected false)")
        return dict(layer_types=tuple(layer_types or [FULL_ATTENTION] * num_layers))
    sliding_window = None
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
    return dict(layer_types=tuple(layer_types), sliding_window=sliding_window)


def _mlp_fields(family: str, raw: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
    """The dense MLP's width, and the experts of a MoE family."""
    if family not in MOE_FAMILIES:
        return dict(
            intermediate_size=_positive_int(raw, "intermediate_size", where),
            mlp_bias=bool(raw.get("mlp_bias", False)) if family == LLAMA else False,
        )
    experts = dict(
        num_experts=_positive_int(raw, "num_experts", where),
        num_experts_per_tok=_positive_int(raw, "num_experts_per_tok", where),
        moe_intermediate_size=_positive_int(raw, "moe_intermediate_size", where),
    )
    if family == QWEN3_5_MOE:
        # every layer is MoE and always renormalises its top-k weights (transformers has no
        # norm_topk_prob, mlp_only_layers or intermediate_size for it; stray ones are ignored)
        shared = _positive_int(raw, "shared_expert_intermediate_size", where)
        return dict(
            intermediate_size=0, norm_topk_prob=True, shared_expert_intermediate_size=shared, **experts
        )
    step = _positive_int(raw, "decoder_sparse_step", where, default=1)
    mlp_only = raw.get("mlp_only_layers") or []
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
        raise ConfigError(f"{where}: 'mlp_only_layers' must be a list of layer indices, got {mlp_only!r}")
    dense = any(i in mlp_only or (i + 1) % step for i in range(num_layers))
    # required once some layer is dense; real all-MoE configs carry an unused one anyway
    needed = dense or raw.get("intermediate_size") is not None
    intermediate = _positive_int(raw, "intermediate_size", where) if needed else 0
    return dict(
        intermediate_size=intermediate,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        decoder_sparse_step=step,
        mlp_only_layers=tuple(mlp_only),
        **experts,
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
    attend over projected target features plus the noise block. A DFlash2 draft
    (`DFlash2DraftModel`, docs/dflash2.md) adds the grouped dynamic convolution around every
    sublayer and the candidate selector; its `dflash_config` fields are 0 for DFlash."""

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
    architecture: str = DFLASH  # one of DRAFT_ARCHITECTURES
    # whether the block attends causally; None: the legacy rule (sliding layers causal, full
    # layers not). DFlash2 checkpoints say `is_causal: false`.
    causal: bool | None = None
    conv_kernel_size: int = 0  # DFlash2: taps of the dynamic convolution
    conv_group_size: int = 0  # DFlash2: channels that share one dynamic tap weight
    selector_rank: int = 0  # DFlash2: rank of the selector's transition codebooks
    selector_top_k: int = 0  # DFlash2: candidates kept per block slot
    # a Llama target's draft rotates as its target does (z-lab's Llama 3.1 drafts say so)
    rope_scaling: Llama3RopeScaling | None = None

    def __post_init__(self) -> None:
        where = "DFlash2 draft config" if self.is_dflash2 else "DFlash draft config"
        if self.architecture not in DRAFT_ARCHITECTURES:
            raise ConfigError(
                f"unknown draft architecture '{self.architecture}', expected one of "
                f"{', '.join(DRAFT_ARCHITECTURES)}"
            )
        if self.is_dflash2:
            self._check_dflash2(where)
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

    def _check_dflash2(self, where: str) -> None:
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            value = getattr(self, name)
            if value <= 0:
                raise ConfigError(f"{where}: '{name}' must be a positive integer, got {value}")
        if self.hidden_size % self.conv_group_size:
            raise ConfigError(
                f"{where}: conv_group_size {self.conv_group_size} does not divide hidden_size "
                f"{self.hidden_size}"
            )
        if self.selector_top_k > self.vocab_size:
            raise ConfigError(
                f"{where}: selector_top_k {self.selector_top_k} exceeds the vocabulary {self.vocab_size}"
            )

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == DFLASH2

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def layer_causal(self, layer: int) -> bool:
        """Whether draft layer `layer` attends causally inside the block: `causal` when the
        checkpoint says, else the legacy rule (sliding layers causal, full layers not)."""
        if self.causal is not None:
            return self.causal
        return self.layer_types[layer] == SLIDING_ATTENTION

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> DraftConfig:
        named = [a for a in DRAFT_ARCHITECTURES if a in (raw.get("architectures") or [])]
        if not named:
            raise ConfigError(
                f"not a DFlash draft: architectures {raw.get('architectures')!r} does not "
                f"name {' or '.join(DRAFT_ARCHITECTURES)}"
            )
        architecture = named[-1]  # DFlash2 when both are named
        where = "DFlash draft config" if architecture == DFLASH else "DFlash2 draft config"
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
        max_positions = _positive_int(raw, "max_position_embeddings", where, default=32768)
        theta, scaling = _rope(raw, where, llama3=True, max_positions=max_positions)
        return cls(
            vocab_size=_positive_int(raw, "vocab_size", where),
            hidden_size=hidden,
            intermediate_size=_positive_int(raw, "intermediate_size", where),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=_positive_int(raw, "num_key_value_heads", where, default=heads),
            head_dim=_positive_int(raw, "head_dim", where, default=hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
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
            architecture=architecture,
            **(_dflash2_fields(raw, dflash, where) if architecture == DFLASH2 else {}),
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


def _dflash2_fields(raw: dict[str, Any], dflash: dict[str, Any], where: str) -> dict[str, Any]:
    """The DFlash2 fields: `dflash_config` first, then the top level (as the published
    implementations read them); causality from `dflash_config.causal` or `is_causal`."""
    merged = {**raw, **dflash}
    causal = dflash.get("causal", raw.get("is_causal"))
    if causal is not None and not isinstance(causal, bool):
        raise ConfigError(f"{where}: 'is_causal' must be true or false, got {causal!r}")
    return dict(
        causal=causal,
        conv_kernel_size=_positive_int(merged, "conv_kernel_size", where),
        conv_group_size=_positive_int(merged, "conv_group_size", where),
        selector_rank=_positive_int(merged, "selector_rank", where),
        selector_top_k=_positive_int(merged, "selector_top_k", where),
    )
