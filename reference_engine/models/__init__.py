"""Target model families, built from a TargetConfig; the drafts, built from a DraftConfig."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import LLAMA, QWEN3, QWEN3_5, QWEN3_5_MOE, QWEN3_MOE, DraftConfig, TargetConfig
from .base import CausalLM, ForwardOutput
from .dflash import DFlashDraft
from .dflash2 import DFlash2Draft
from .layers import fuse_projections
from .llama import build_llama
from .qwen3 import build_qwen3
from .qwen3_5 import build_qwen3_5
from .qwen3_5_moe import build_qwen3_5_moe
from .qwen3_moe import build_qwen3_moe

__all__ = [
    "CausalLM",
    "ForwardOutput",
    "build_draft",
    "build_target",
    "draft_expected_shapes",
    "expected_shapes",
    "fuse_projections",
]

# config.FAMILIES -> the family's model
BUILDERS: dict[str, Callable[[TargetConfig], CausalLM]] = {
    QWEN3: build_qwen3,
    QWEN3_5: build_qwen3_5,
    LLAMA: build_llama,
    QWEN3_MOE: build_qwen3_moe,
    QWEN3_5_MOE: build_qwen3_5_moe,
}


def build_target(config: TargetConfig) -> CausalLM:
    return BUILDERS[config.family](config)


def expected_shapes(config: TargetConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, without allocating any weights."""
    with torch.device("meta"):
        model = build_target(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def build_draft(config: DraftConfig) -> DFlashDraft:
    """The draft of the config's architecture (DFlash or DFlash2)."""
    return DFlash2Draft(config) if config.is_dflash2 else DFlashDraft(config)


def draft_expected_shapes(config: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape for a draft, without allocating any weights."""
    with torch.device("meta"):
        model = build_draft(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}
