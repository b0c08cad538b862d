"""Qwen3.5 hybrid text model: Gated DeltaNet layers and gated full-attention layers.

Layer i is a Gated DeltaNet ("linear_attention") or a gated attention layer
("full_attention") as `layer_types` says. Norms multiply by (1 + w). For text, MRoPE's three
position rows are equal, so the attention layers use plain RoPE on the rotary part.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import LINEAR_ATTENTION, TargetConfig
from ..kernels.reference import gated_delta_chunked
from .base import CausalLM
from .layers import MLP, ForwardContext, FusedLinears, GatedRMSNorm, RMSNorm, SelfAttention, run_linears


class GatedDeltaNet(nn.Module):
    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.k_dim = config.linear_key_head_dim
        self.v_dim = config.linear_value_head_dim
        self.key_dim, self.value_dim = config.linear_key_dim, config.linear_value_dim
        self.conv_dim = config.conv_dim
        self.kernel = config.linear_conv_kernel_dim
        h = config.hidden_size
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)
        self.fused: FusedLinears | None = None

    def fuse(self) -> None:
        """Compute the four input projections by one matmul from now on (FusedLinears)."""
        self.fused = FusedLinears(self._inputs())

    def _inputs(self) -> list[nn.Linear]:
        return [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        batch, T, _ = x.shape
        state, ops = ctx.state, ctx.ops
        # Depthwise causal conv1d + SiLU, continuing from the slot's conv state (the last
        # kernel-1 inputs; zeros for a fresh slot, which equals left zero-padding).
        projected, z, b, a = run_linears(self._inputs(), self.fused, x, ops)
        # the conv state of each row's slot read and moved on in place; a verify's conv also
        # keeps its input (the old state followed by the block's inputs) for the commit
        record = state.verify_conv_of(layer) if ctx.record is not None else None
        mixed = ops.causal_conv_step(
            projected, state.conv[layer], ctx.slots, self.conv1d.weight, ctx.valid_len, record=record
        )

        per_token = ctx.record == "per_token"
        # the per_token commit reads the recurrence inputs where they are written
        kept = state.verify_inputs_of(layer, batch, T) if per_token else None
        q, k, v, g, beta = ops.gated_delta_inputs(
            mixed, a, b, self.A_log, self.dt_bias, self.num_k_heads, self.k_dim, self.v_dim, out=kept
        )

        states_out = written_out = None
        if ctx.record is not None:
            state.record_verify_inputs(layer, ctx.slots, q, k, v, g, beta)
            if per_token and state.keeps_written_rows:  # the references: no state kept
                written_out = state.verify_written_of(layer, batch, T)
            elif per_token:
                states_out = state.verify_states_of(layer, batch, T)
        recurrent = state.recurrent[layer]
        if ctx.chunked:
            out, final = gated_delta_chunked(q, k, v, g, beta, recurrent.index_select(0, ctx.slots))
            recurrent.index_copy_(0, ctx.slots, final)
        elif written_out is not None:  # the references' per_token verify: the rows each token wrote
            out, _ = ops.gated_delta(
                q,
                k,
                v,
                g,
                beta,
                recurrent,
                ctx.valid_len,
                slots=ctx.slots,
                keep_final=False,
                written_out=written_out,
            )
        else:  # the rows' states read and written in place; a per_token verify's commit
            # writes them from the checkpoints, so the verify leaves them alone
            out, _ = ops.gated_delta(
                q,
                k,
                v,
                g,
                beta,
                recurrent,
                ctx.valid_len,
                states_out,
                slots=ctx.slots,
                every=state.every,  # read with states_out alone (NO_CHECKPOINTS is 0)
                keep_final=not per_token,
            )

        z = z.reshape(batch, T, self.num_v_heads, self.v_dim)
        out = self.norm(out, z, ops)  # rounds the float32 output to the model dtype first
        return ops.linear(out.reshape(batch, T, self.value_dim), self.out_proj.weight)


class Qwen3_5DecoderLayer(nn.Module):
    """A Gated DeltaNet or gated attention mixer, then the MLP (the dense SwiGLU unless
    `mlp` is given: Qwen3.5-MoE passes its expert block)."""

    def __init__(self, config: TargetConfig, layer: int, mlp: nn.Module | None = None) -> None:
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
        self.mlp = mlp if mlp is not None else MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=True)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        mixer = self.linear_attn if self.is_linear else self.self_attn
        mixed = mixer(self.input_layernorm(x, ctx.ops), ctx, layer)
        normed, x = self.post_attention_layernorm.add(x, mixed, ctx.ops)  # residual add + norm
        return self.mlp(normed, ctx.ops, residual=x)


def build_qwen3_5(config: TargetConfig) -> CausalLM:
    layers = [Qwen3_5DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
    return CausalLM(config, layers)
