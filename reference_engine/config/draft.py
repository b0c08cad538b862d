"""A DFlash or DFlash2 draft's configuration (z-lab's `DFlashDraftModel` and
`DFlash2DraftModel` layouts), parsed from its `config.json`, and the check that it fits its
target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .fields import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    Llama3RopeScaling,
    _is_positive_int,
    _list,
    _number,
    _positive_int,
    _qwen3_window,
    _rope,
    _token_id,
)
from .target import TargetConfig

FINAL_NORM, RAW = "final_norm", "raw"
LAST_LAYER_FEATURES = (FINAL_NORM, RAW)

DFLASH = "DFlashDraftModel"
DFLASH2 = "DFlash2DraftModel"
DRAFT_ARCHITECTURES = (DFLASH, DFLASH2)


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
    # whether the block attends causally in every layer (`is_causal`); None: the legacy rule
    # (sliding layers causal, full layers not). DFlash2 checkpoints say `is_causal: false`.
    causal: bool | None = None
    conv_kernel_size: int = 0  # DFlash2: taps of the dynamic convolution
    conv_group_size: int = 0  # DFlash2: channels that share one dynamic tap weight
    selector_rank: int = 0  # DFlash2: rank of the selector's transition codebooks
    selector_top_k: int = 0  # DFlash2: candidates kept per block slot
    # a Llama target's draft rotates as its target does (z-lab's Llama 3.1 drafts say so)
    rope_scaling: Llama3RopeScaling | None = None
    # the feature of the target's last layer, when listed: after the final norm, as Hugging
    # Face's hidden_states[N] that z-lab's training reads ("final_norm", the default), or the
    # layer's raw output ("raw": `dflash_config.last_layer_feature`, for drafts trained so)
    last_layer_feature: str = FINAL_NORM

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
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"{where}: rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{where}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not self.target_layer_ids:
            raise ConfigError(f"{where}: target_layer_ids is empty")
        if self.last_layer_feature not in LAST_LAYER_FEATURES:
            raise ConfigError(
                f"{where}: last_layer_feature must be one of {', '.join(LAST_LAYER_FEATURES)}, "
                f"got {self.last_layer_feature!r}"
            )
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
        if self.sliding_window is not None and not _is_positive_int(self.sliding_window):
            raise ConfigError(
                f"{where}: sliding_window must be a positive integer (or null: no window), "
                f"got {self.sliding_window!r}"
            )
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

    @property
    def raw_last_layer(self) -> bool:
        """Whether the target's last layer, if listed, gives its output before the final norm."""
        return self.last_layer_feature == RAW

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
        ids = _list(
            dflash if "target_layer_ids" in dflash else raw, "target_layer_ids", where, int, "layer indices"
        )
        ids = tuple(ids) if ids else published_target_layer_ids(num_target, num_layers)
        mask = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if mask is None:
            raise ConfigError(f"{where}: no mask_token_id (in dflash_config or top level)")
        if not _token_id(mask):
            raise ConfigError(f"{where}: 'mask_token_id' must be a token id, got {mask!r}")
        # as transformers' Qwen3Config reads them (z-lab's DFlash drafts are read so), except
        # that a DFlash2 draft's explicit sliding layers take its sliding_window whatever
        # use_sliding_window says (the published one names none)
        listed = _list(raw, "layer_types", where, str, "attention kinds") or None
        layer_types, sliding_window = _qwen3_window(raw, listed, num_layers, where)
        if listed and architecture == DFLASH2 and SLIDING_ATTENTION in listed and sliding_window is None:
            sliding_window = raw.get("sliding_window")
        softcap = raw.get("final_logit_softcapping")
        if softcap is not None and not 0 <= _number(raw, "final_logit_softcapping", where) < float("inf"):
            raise ConfigError(
                f"{where}: 'final_logit_softcapping' must be a finite number >= 0 (0 or null: no cap), "
                f"got {softcap!r}"
            )
        max_positions = _positive_int(raw, "max_position_embeddings", where, default=32768)
        theta, scaling = _rope(raw, where, llama3=True, max_positions=max_positions)
        last_feature = dflash.get("last_layer_feature")  # null: the default
        return cls(
            vocab_size=_positive_int(raw, "vocab_size", where),
            hidden_size=hidden,
            intermediate_size=_positive_int(raw, "intermediate_size", where),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=_positive_int(raw, "num_key_value_heads", where, default=heads),
            head_dim=_positive_int(raw, "head_dim", where, default=hidden // heads),
            rms_norm_eps=_number(raw, "rms_norm_eps", where, 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
            block_size=_positive_int(dflash, "block_size", where, default=raw.get("block_size", 16)),
            num_target_layers=num_target,
            target_layer_ids=ids,
            mask_token_id=mask,
            layer_types=tuple(layer_types),
            sliding_window=sliding_window,
            attention_bias=bool(raw.get("attention_bias", False)),
            input_embedding_scale=_number({**raw, **dflash}, "input_embedding_scale", where, 1.0),
            output_multiplier=_number({**raw, **dflash}, "output_multiplier", where, 1.0),
            final_logit_softcapping=float(softcap) if softcap else None,
            architecture=architecture,
            causal=_causal(raw, dflash, where),
            last_layer_feature=FINAL_NORM if last_feature is None else last_feature,
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


def _causal(raw: dict[str, Any], dflash: dict[str, Any], where: str) -> bool | None:
    """Whether the block attends causally in every layer, from `dflash_config.causal` or
    `is_causal` (z-lab's DFlashDraftModel takes it for either architecture); None when the
    config says neither (the legacy rule, DraftConfig.layer_causal)."""
    causal = dflash.get("causal", raw.get("is_causal"))
    if causal is not None and not isinstance(causal, bool):
        raise ConfigError(f"{where}: 'is_causal' must be true or false, got {causal!r}")
    return causal


def _dflash2_fields(raw: dict[str, Any], dflash: dict[str, Any], where: str) -> dict[str, Any]:
    """The DFlash2 fields: `dflash_config` first, then the top level (as the published
    implementations read them)."""
    merged = {**raw, **dflash}
    return dict(
        conv_kernel_size=_positive_int(merged, "conv_kernel_size", where),
        conv_group_size=_positive_int(merged, "conv_group_size", where),
        selector_rank=_positive_int(merged, "selector_rank", where),
        selector_top_k=_positive_int(merged, "selector_top_k", where),
    )
