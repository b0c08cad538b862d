"""Target model families, built from a TargetConfig."""

from __future__ import annotations

import torch

from ..config import QWEN3, TargetConfig
from .base import CausalLM, ForwardOutput
from .layers import fuse_projections
from .qwen3 import build_qwen3
from .qwen3_5 import build_qwen3_5

__all__ = ["CausalLM", "ForwardOutput", "build_target", "expected_shapes", "fuse_projections"]


def build_target(config: TargetConfig) -> CausalLM:
    return build_qwen3(config) if config.family == QWEN3 else build_qwen3_5(config)


def expected_shapes(config: TargetConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, without allocating any weights."""
    with torch.device("meta"):
        model = build_target(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}
