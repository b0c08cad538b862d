"""Qwen3 dense target: GQA attention with q_norm/k_norm and RoPE, SwiGLU MLP, RMSNorm."""

from __future__ import annotations

import torch
from torch import nn

from ..config import SLIDING_ATTENTION, TargetConfig
from .base import CausalLM
from .layers import MLP, ForwardContext, RMSNorm, SelfAttention


class Qwen3DecoderLayer(nn.Module):
    """A Qwen3 layer. `bidirectional`: full-attention layers see their whole input (the
    DFlash draft's block); sliding-window layers stay causal either way. The draft config
    carries the same fields as a Qwen3 target config. Llama's layer is this one without the
    per-head norms (`qk_norm` False), Qwen3-MoE's this one with its experts as `mlp`."""

    def __init__(
        self,
        config: TargetConfig,
        layer: int,
        causal: bool = True,
        qk_norm: bool = True,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        sliding = config.layer_types[layer] == SLIDING_ATTENTION
        self.self_attn = SelfAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.rms_norm_eps,
            norm_offset=False,
            gated=False,
            bias=config.attention_bias,
            sliding_window=config.sliding_window if sliding else None,
            causal=causal,
            qk_norm=qk_norm,
        )
        self.mlp = mlp if mlp is not None else MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x, ctx.ops), ctx, layer)
        normed, x = self.post_attention_layernorm.add(x, attended, ctx.ops)  # residual add + norm
        return self.mlp(normed, ctx.ops, residual=x)


def build_qwen3(config: TargetConfig) -> CausalLM:
    return CausalLM(config, [Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
