"""Qwen3-MoE target (Qwen3-30B-A3B): Qwen3's attention (q_norm/k_norm, RoPE, GQA) and norms,
with a mixture of experts in place of the MLP (models/moe.py).

Layer i is MoE unless it is listed in `mlp_only_layers` or (i + 1) is not a multiple of
`decoder_sparse_step`; those layers keep a dense SwiGLU MLP of `intermediate_size`. Every
layer of the published models is MoE. The routing renormalises the top-k weights only when
`norm_topk_prob` (true in the published configs, false by default).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import TargetConfig
from .base import CausalLM
from .layers import MLP, ForwardContext, RMSNorm, SelfAttention
from .moe import SparseMoeBlock


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, config: TargetConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = SelfAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.rms_norm_eps,
            norm_offset=False,
            gated=False,
            bias=config.attention_bias,
        )
        if layer in config.moe_layers:
            self.mlp: nn.Module = SparseMoeBlock(
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                renormalise=config.norm_topk_prob,
            )
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x, ctx.ops), ctx, layer)
        normed, x = self.post_attention_layernorm.add(x, attended, ctx.ops)  # residual add + norm
        return x + self.mlp(normed, ctx.ops)


def build_qwen3_moe(config: TargetConfig) -> CausalLM:
    return CausalLM(config, [Qwen3MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
