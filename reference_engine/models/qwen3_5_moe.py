"""Qwen3.5-MoE target (Qwen3.5-35B-A3B): Qwen3.5's hybrid layers (Gated DeltaNet or gated
full attention as `layer_types` says, (1 + w) norms, partial RoPE) with a mixture of experts
in place of every MLP: routed experts (the top-k weights always renormalised) plus a shared
expert behind a sigmoid gate (models/moe.py).

The token mixers are Qwen3.5's own, unchanged (transformers' two modeling files hold the
same code for them); only the MLP differs.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import LINEAR_ATTENTION, TargetConfig
from .base import CausalLM
from .layers import ForwardContext, RMSNorm, SelfAttention
from .moe import SparseMoeBlock
from .qwen3_5 import GatedDeltaNet


class Qwen3_5MoeDecoderLayer(nn.Module):
    def __init__(self, config: TargetConfig, layer: int) -> None:
        super().__init__()
        self.is_linear = config.layer_types[layer] == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = SelfAttention(
                config.hidden_size,
                config.num_attention_heads,
                config.num_key_value_heads,
                config.head_dim,
                config.rms_norm_eps,
                norm_offset=True,
                gated=True,
                bias=config.attention_bias,
            )
        self.mlp = SparseMoeBlock(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            renormalise=True,
            shared_intermediate_size=config.shared_expert_intermediate_size,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=True)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        mixer = self.linear_attn if self.is_linear else self.self_attn
        mixed = mixer(self.input_layernorm(x, ctx.ops), ctx, layer)
        normed, x = self.post_attention_layernorm.add(x, mixed, ctx.ops)  # residual add + norm
        return x + self.mlp(normed, ctx.ops)


def build_qwen3_5_moe(config: TargetConfig) -> CausalLM:
    layers = [Qwen3_5MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
    return CausalLM(config, layers)
