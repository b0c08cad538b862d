"""Llama 3.x target: GQA attention with RoPE (llama3 frequency scaling when configured) and
no per-head query/key norms, SwiGLU MLP, RMSNorm (w * normed, no offset).

`attention_bias` puts biases on q, k, v and o; `mlp_bias` on gate, up and down.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import TargetConfig
from .base import CausalLM
from .layers import MLP, ForwardContext, RMSNorm, SelfAttention


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: TargetConfig) -> None:
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
            qk_norm=False,
        )
        self.mlp = MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x, ctx.ops), ctx, layer)
        normed, x = self.post_attention_layernorm.add(x, attended, ctx.ops)  # residual add + norm
        return x + self.mlp(normed, ctx.ops)


def build_llama(config: TargetConfig) -> CausalLM:
    return CausalLM(config, [LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
