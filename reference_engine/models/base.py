"""The decoder-only skeleton every target family shares: embed, layers, final norm, lm_head,
with optional capture of chosen layers' outputs (the DFlash context features)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..config import TargetConfig
from ..kernels import TORCH, Kernels
from .layers import ForwardContext, RMSNorm, RotaryEmbedding


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [batch, T, vocab] (T = 1 when only the last position was asked for)
    features: torch.Tensor | None  # [batch, T, len(capture_layers) * hidden] or None


def target_rotary(config: TargetConfig) -> RotaryEmbedding:
    """The target's RoPE (frequencies only: a buffer, not in checkpoints)."""
    return RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)


class Backbone(nn.Module):
    """Holds the parameters under the checkpoint's `model.` names."""

    def __init__(self, config: TargetConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=config.norm_offset)


class CausalLM(nn.Module):
    def __init__(self, config: TargetConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config, layers)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = target_rotary(config)
        # tensor parallelism: the LM head holds this rank's slice of the vocabulary, and this
        # gathers the slices' logits (runtime/tensor_parallel.py)
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def project_logits(self, hidden: torch.Tensor, ops: Kernels = TORCH) -> torch.Tensor:
        """Final-normed hidden states -> logits over the vocabulary."""
        logits = ops.linear(hidden, self.lm_head_weight)
        return logits if self.gather_logits is None else self.gather_logits(logits)

    def forward(
        self,
        input_ids: torch.Tensor,  # [batch, T]
        positions: torch.Tensor,  # [batch, T]
        slots: torch.Tensor,  # [batch]
        state,  # TargetState
        kv_len: int,
        capture_layers: tuple[int, ...] = (),
        raw_last_layer: bool = False,
        last_only: bool = False,
        valid_len: torch.Tensor | None = None,  # [batch]
        record: str | None = None,
        chunked: bool = False,
        ops: Kernels = TORCH,
    ) -> ForwardOutput:
        """Run T new tokens per row and update the rows' slot state in place.

        `kv_len` bounds the attention rows read (host int, at least max(positions) + 1);
        the caller knows it, so no value is read back from the device here. `valid_len`
        marks trailing padding per row: padded tokens leave the Gated DeltaNet state alone
        (their attention rows land past the committed length and are never read).
        `record` ("per_token" or "recompute") keeps what that commit strategy needs.
        `chunked` runs Gated DeltaNet layers through the PyTorch chunked form whatever `ops`
        says (training: differentiable, full rows). `ops`: the kernels (numerics).
        `capture_layers`: the layers whose outputs make the features, in that order; the
        last layer's is after the final norm (Hugging Face's hidden_states[N]), or its raw
        output with `raw_last_layer` (a draft trained on that says so in its config).
        """
        x = self.embed(input_ids)
        ctx = ForwardContext(
            state, slots, positions, kv_len, self.rotary, x.dtype, valid_len, record, chunked, ops
        )
        captured: dict[int, torch.Tensor] = {}
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x = layer(x, ctx, i)
            if i in capture_layers:
                captured[i] = self.model.norm(x, ops) if i == last and not raw_last_layer else x
        # in the order the draft lists them, repeats included (the published spread of
        # target layers repeats a layer when the target is shallow)
        features = torch.cat([captured[i] for i in capture_layers], -1) if captured else None
        if last_only:  # each row's last real token
            x = (
                x[:, -1:]
                if valid_len is None
                else x.gather(1, (valid_len - 1)[:, None, None].expand(-1, 1, x.shape[-1]))
            )
        return ForwardOutput(self.project_logits(self.model.norm(x, ops), ops), features)
