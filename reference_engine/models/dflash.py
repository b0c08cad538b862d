"""The DFlash block-diffusion draft (z-lab `DFlashDraftModel`).

Context: the target's outputs at `target_layer_ids` for every committed position,
concatenated ([n * hidden]), projected by `fc` and normed by `hidden_norm`. Each draft
layer turns that one projected context into its own keys/values at the context's true
positions; those rows are cached per slot and written once, when positions commit.

Block: the anchor (last committed token) followed by B-1 mask tokens, embedded with the
target's `embed_tokens` (times `input_embedding_scale`) at positions start..start+B-1.
Queries come from the block only; keys/values are [context ; block]; with `is_causal` in the
config every layer's block attention is causal (true) or not (false), as z-lab's draft reads
it; without it, full-attention layers are non-causal (the block sees itself whole) and sliding
layers causal inside a window.
Block slot j (1..B-1) proposes the token at position start+j, through the target's lm_head
(times `output_multiplier`, then optional tanh soft-capping).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..config import DraftConfig
from ..kernels import TORCH, Kernels
from .layers import ForwardContext, Phase, RMSNorm, RotaryEmbedding, untimed
from .qwen3 import Qwen3DecoderLayer


class DraftState:
    """Per-slot context keys/values of every draft layer, preallocated.

    Rows past a slot's committed length hold stale block keys; the block pass overwrites
    its own rows and never reads past its last position.
    """

    def __init__(
        self,
        config: DraftConfig,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        pool=None,  # runtime/kv_pool.PoolLayout: the target's pooled layout
        cell_of: torch.Tensor | None = None,  # with a pool: the target state's slot -> row map
    ) -> None:
        shape = (num_slots, max_len, config.num_key_value_heads, config.head_dim)
        self.device = torch.device(device)
        self.max_len = max_len
        heads = (config.num_key_value_heads, config.head_dim)

        def cache() -> torch.Tensor:
            if pool is None:
                return torch.zeros(shape, dtype=dtype, device=device)
            return pool.cache(*heads, dtype, self.device)

        self.k_cache = [cache() for _ in range(config.num_hidden_layers)]
        self.v_cache = [cache() for _ in range(config.num_hidden_layers)]
        self.cell_of = cell_of
        self.lengths = [0] * num_slots  # committed context rows per slot

    def cache_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The caches' rows of `slots` (runtime/state.TargetState.cache_rows)."""
        return slots if self.cell_of is None else self.cell_of.index_select(0, slots)


def draft_rotary(config: DraftConfig) -> RotaryEmbedding:
    """The draft's RoPE: its head dim, theta and scaling (Llama 3.x frequencies)."""
    return RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)


class DFlashDraft(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([self.build_layer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(config.num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = draft_rotary(config)
        # tensor parallelism: the target's LM head holds this rank's slice of the vocabulary,
        # and this gathers the slices' logits (runtime/tensor_parallel.py)
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor] | None = None

    def build_layer(self, config: DraftConfig, layer: int) -> nn.Module:
        """Draft layer `layer`: a Qwen3 layer whose block attends causally or not as the
        config says (DraftConfig.layer_causal: `is_causal`, else full-attention layers see the
        block whole and sliding ones causally)."""
        return Qwen3DecoderLayer(config, layer, causal=config.layer_causal(layer))

    def append_context(
        self,
        features: torch.Tensor,  # [batch, T, n * hidden] target features of committed positions
        positions: torch.Tensor,  # [batch, T]
        slots: torch.Tensor,  # [batch]
        state: DraftState,
        ops: Kernels = TORCH,
    ) -> None:
        """Write the context keys/values of newly committed positions for every layer."""
        context = self.hidden_norm(ops.linear(features, self.fc.weight), ops)
        ctx = ForwardContext(state, slots, positions, 0, self.rotary, context.dtype, ops=ops)
        for i, layer in enumerate(self.layers):
            layer.self_attn.write_kv(context, ctx, i)

    def forward(
        self,
        block_embeds: torch.Tensor,  # [batch, B, hidden] embedded anchor + mask tokens
        positions: torch.Tensor,  # [batch, B]
        slots: torch.Tensor,  # [batch]
        state: DraftState,
        kv_len: int,
        valid_len: torch.Tensor | None = None,  # [batch] real block tokens per row
        ops: Kernels = TORCH,
        phase: Phase = untimed,
    ) -> torch.Tensor:
        """Returns the final-normed hidden states of the block, [batch, B, hidden]. Rows
        with a shorter block (`valid_len`) never see their padding. `phase` times the parts
        a DFlash2 layer adds (its convolution)."""
        x = block_embeds
        ctx = ForwardContext(
            state, slots, positions, kv_len, self.rotary, x.dtype, valid_len, ops=ops, phase=phase
        )
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, i)
        return self.norm(x, ops)

    def proposals(
        self,
        hidden: torch.Tensor,
        lm_head_weight: torch.Tensor,
        ops: Kernels = TORCH,
        anchors: torch.Tensor | None = None,
        phase: Phase = untimed,
        width: int | None = None,
        hold: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The proposals' logits [batch, W, vocab] and greedy tokens [batch, W] from the
        block's hidden states [batch, B, hidden], for the draft slots 1..W (`width`; every
        slot, W = B-1, when None): a slot's logits read its own hidden state alone, so those
        of the first W slots do not depend on the slots after them (the block attention
        before them is already in the hidden states), and a verify that checks W proposals
        needs no other. Each slot's own argmax (the `anchors` [batch] and the `phase` timing
        the selector matter to DFlash2 only). `hold` puts the logits where the caller keeps
        them (a CUDA graph's shared buffer, graphs.SharedLogits). Both are taken over the
        anchor's position too, and sliced: the product then reads W + 1 contiguous rows per
        request, where the proposals' rows alone would need a copy and, in the fast numerics,
        lead cuBLAS to a kernel eleven times slower (Qwen3-8B's LM head on the H200: 4.8 ms
        for 240 rows against 0.42 ms for 256)."""
        logits = self.slot_logits(hidden, lm_head_weight, ops, width, hold)
        return logits[:, 1:], ops.greedy(logits)[:, 1:]

    def slot_logits(
        self,
        hidden: torch.Tensor,
        lm_head_weight: torch.Tensor,
        ops: Kernels,
        width: int | None,
        hold: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> torch.Tensor:
        """Logits [batch, W + 1, vocab] of the anchor's position and draft slots 1..W (every
        position when `width` is None), through `hold` when given."""
        if width is not None:
            if not 0 < width < hidden.shape[1]:
                blocks = hidden.shape[1]
                raise ValueError(f"draft width {width} outside 1..{blocks - 1} for a block of {blocks}")
            hidden = hidden[:, : width + 1]
        logits = self.logits(hidden, lm_head_weight, ops)
        return logits if hold is None else hold(logits)

    def logits(
        self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, ops: Kernels = TORCH
    ) -> torch.Tensor:
        """Draft logits through the target's lm_head: [..., hidden] -> [..., vocab]."""
        logits = ops.linear(hidden, lm_head_weight)
        if self.gather_logits is not None:
            logits = self.gather_logits(logits)
        if self.config.output_multiplier != 1.0:  # a pass over [..., vocab] saved otherwise
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
