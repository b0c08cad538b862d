"""Llama 3.x target: GQA attention with RoPE (llama3 frequency scaling when configured) and
no per-head query/key norms, SwiGLU MLP, RMSNorm (w * normed, no offset).

`attention_bias` puts biases on q, k, v and o; `mlp_bias` on gate, up and down. The layer is
Qwen3's without the per-head norms (models/qwen3.py).
"""

from __future__ import annotations

from ..config import TargetConfig
from .base import CausalLM
from .layers import MLP
from .qwen3 import Qwen3DecoderLayer


def build_llama(config: TargetConfig) -> CausalLM:
    def mlp() -> MLP:
        return MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)

    layers = [Qwen3DecoderLayer(config, i, qk_norm=False, mlp=mlp()) for i in range(config.num_hidden_layers)]
    return CausalLM(config, layers)
