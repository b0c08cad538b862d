"""A target text model's configuration (Qwen3 dense, Qwen3.5 hybrid, Llama 3.x, Qwen3-MoE,
Qwen3.5-MoE), parsed from its `config.json`, a multimodal wrapper's `text_config` included."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .fields import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    Llama3RopeScaling,
    _bool,
    _eos_ids,
    _is_positive_int,
    _list,
    _number,
    _positive_int,
    _qwen3_window,
    _rope,
)

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
        if self.sliding_window is not None and not _is_positive_int(self.sliding_window):
            raise ConfigError(
                f"{where}: sliding_window must be a positive integer (or null: no window), "
                f"got {self.sliding_window!r}"
            )
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
        tie = _bool(raw if "tie_word_embeddings" in raw else outer, "tie_word_embeddings", where, False)
        return cls(
            family=family,
            vocab_size=_positive_int(raw, "vocab_size", where),
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=_positive_int(raw, "num_key_value_heads", where, default=heads),
            head_dim=_positive_int({"head_dim": head_dim}, "head_dim", where),
            rms_norm_eps=_number(raw, "rms_norm_eps", where, 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=tie,
            partial_rotary_factor=float(partial),
            attention_bias=_bool(raw, "attention_bias", where, False),
            eos_token_ids=_eos_ids(raw, outer, where),
            **_mixer_fields(family, raw, num_layers, where),
            **_mlp_fields(family, raw, num_layers, where),
        )


def _mixer_fields(family: str, raw: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
    """layer_types and what the token mixers of those layers need."""
    layer_types = _list(raw, "layer_types", where, str, "attention kinds")
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
        if _bool(raw, "use_sliding_window", where, False):
            # qwen3_moe would slide every layer, which no published checkpoint does
            raise ConfigError(f"{where}: use_sliding_window true is not supported (expected false)")
        return dict(layer_types=tuple(layer_types or [FULL_ATTENTION] * num_layers))
    layer_types, sliding_window = _qwen3_window(raw, layer_types, num_layers, where)
    return dict(layer_types=tuple(layer_types), sliding_window=sliding_window)


def _mlp_fields(family: str, raw: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
    """The dense MLP's width, and the experts of a MoE family."""
    if family not in MOE_FAMILIES:
        return dict(
            intermediate_size=_positive_int(raw, "intermediate_size", where),
            mlp_bias=_bool(raw, "mlp_bias", where, False) if family == LLAMA else False,
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
    mlp_only = _list(raw, "mlp_only_layers", where, int, "layer indices") or []
    dense = any(i in mlp_only or (i + 1) % step for i in range(num_layers))
    # required once some layer is dense; real all-MoE configs carry an unused one anyway
    needed = dense or raw.get("intermediate_size") is not None
    intermediate = _positive_int(raw, "intermediate_size", where) if needed else 0
    return dict(
        intermediate_size=intermediate,
        norm_topk_prob=_bool(raw, "norm_topk_prob", where, False),
        decoder_sparse_step=step,
        mlp_only_layers=tuple(mlp_only),
        **experts,
    )
