"""Qwen3.5-MoE target (Qwen3.5-35B-A3B): Qwen3.5's hybrid layers (Gated DeltaNet or gated
full attention as `layer_types` says, (1 + w) norms, partial RoPE) with a mixture of experts
in place of every MLP: routed experts (the top-k weights always renormalised) plus a shared
expert behind a sigmoid gate (models/moe.py).

The token mixers are Qwen3.5's own, unchanged (transformers' two modeling files hold the
same code for them); only the MLP differs.
"""

from __future__ import annotations

from ..config import TargetConfig
from .base import CausalLM
from .moe import SparseMoeBlock
from .qwen3_5 import Qwen3_5DecoderLayer


class Qwen3_5MoeDecoderLayer(Qwen3_5DecoderLayer):
    """Qwen3.5's decoder layer with the routed experts and the gated shared expert as its MLP."""

    def __init__(self, config: TargetConfig, layer: int) -> None:
        moe = SparseMoeBlock(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            renormalise=True,
            shared_intermediate_size=config.shared_expert_intermediate_size,
        )
        super().__init__(config, layer, mlp=moe)


def build_qwen3_5_moe(config: TargetConfig) -> CausalLM:
    layers = [Qwen3_5MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
    return CausalLM(config, layers)
