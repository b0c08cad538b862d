"""Qwen3-MoE target (Qwen3-30B-A3B): Qwen3's attention (q_norm/k_norm, RoPE, GQA) and norms,
with a mixture of experts in place of the MLP (models/moe.py).

Layer i is MoE unless it is listed in `mlp_only_layers` or (i + 1) is not a multiple of
`decoder_sparse_step`; those layers keep a dense SwiGLU MLP of `intermediate_size`. Every
layer of the published models is MoE. The routing renormalises the top-k weights only when
`norm_topk_prob` (true in the published configs, false by default).
"""

from __future__ import annotations

from torch import nn

from ..config import TargetConfig
from .base import CausalLM
from .layers import MLP
from .moe import SparseMoeBlock
from .qwen3 import Qwen3DecoderLayer


def moe_mlp(config: TargetConfig, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: the routed experts, or the dense SwiGLU of a layer left dense."""
    if layer in config.moe_layers:
        return SparseMoeBlock(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            renormalise=config.norm_topk_prob,
        )
    return MLP(config.hidden_size, config.intermediate_size)


def build_qwen3_moe(config: TargetConfig) -> CausalLM:
    layers = [Qwen3DecoderLayer(config, i, mlp=moe_mlp(config, i)) for i in range(config.num_hidden_layers)]
    return CausalLM(config, layers)
