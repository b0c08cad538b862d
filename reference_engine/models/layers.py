"""Parts shared by every model: RMSNorm, RoPE, the SwiGLU MLP and cached attention.

Precision policy: half-precision models accumulate norms, softmax and recurrent state in
float32; float32 and float64 models stay in their own dtype (never downcast).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reductions run in: float32 for half types, else the dtype itself."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * w, or * (1 + w) when `offset` (Qwen3.5)."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = accumulation_dtype(x.dtype)
        xf = x.to(acc)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (1.0 + self.weight.to(acc))).to(x.dtype)
        return self.weight * normed.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm (no offset) times silu(z): the Gated DeltaNet output norm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        acc = accumulation_dtype(x.dtype)
        xf = x.to(acc)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * normed.to(x.dtype)
        return (out * F.silu(z.to(acc))).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RotaryEmbedding(nn.Module):
    """RoPE over the first `rotary_dim` dims of each head (rotate-half layout).

    Angles are computed in float32 whatever the model dtype, as the published checkpoints
    were trained and as other engines compute them.
    """

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
        self.register_buffer("inv_freq", 1.0 / (theta**exponents), persistent=False)
        self.rotary_dim = rotary_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        # positions: [batch, T] -> cos, sin: [batch, T, 1, rotary_dim]
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [batch, T, heads, head_dim]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def cached_attention(
    q: torch.Tensor,  # [batch, T, heads, head_dim]
    k: torch.Tensor,  # [batch, T, kv_heads, head_dim]
    v: torch.Tensor,  # [batch, T, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [slots, max_len, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [slots, max_len, kv_heads, head_dim]
    slots: torch.Tensor,  # [batch]
    positions: torch.Tensor,  # [batch, T]
    kv_len: int,
    scale: float,
    sliding_window: int | None = None,
    causal: bool = True,
    valid_len: torch.Tensor | None = None,  # [batch] real tokens per row (rest: padding)
) -> torch.Tensor:
    """Write k/v at their positions, then attend over the first kv_len cache rows.

    The cache is indexed by position, so rolling a request back needs no copy: a later
    write overwrites the rejected rows, and the position mask never lets a query see a row
    past its own position (causal) or past the last position of its row (non-causal: the
    DFlash draft's block sees itself whole, up to its last real token when `valid_len`
    marks trailing padding). Returns [batch, T, heads, head_dim].
    """
    k_cache[slots[:, None], positions] = k
    v_cache[slots[:, None], positions] = v
    keys = k_cache[slots, :kv_len]  # [batch, kv_len, kv_heads, head_dim]
    values = v_cache[slots, :kv_len]
    key_pos = torch.arange(kv_len, device=q.device)[None, None, :]
    query_pos = positions[:, :, None]
    if causal:
        visible_to = query_pos
    elif valid_len is None:
        visible_to = positions[:, -1:, None]
    else:
        visible_to = (positions[:, 0] + valid_len - 1)[:, None, None]
    allowed = key_pos <= visible_to  # [batch, T, kv_len]
    if sliding_window is not None:
        allowed &= (query_pos - key_pos < sliding_window) & (key_pos - query_pos < sliding_window)
    return attend(q, keys, values, allowed, scale)


def attend(
    q: torch.Tensor,  # [batch, T, heads, head_dim]
    keys: torch.Tensor,  # [batch, S, kv_heads, head_dim]
    values: torch.Tensor,  # [batch, S, kv_heads, head_dim]
    allowed: torch.Tensor,  # [batch, T, S] bool
    scale: float,
) -> torch.Tensor:
    """Grouped-query softmax attention under a boolean mask. Returns [batch, T, heads, head_dim]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=allowed[:, None],
        scale=scale,
        enable_gqa=q.shape[2] != keys.shape[2],
    )
    return out.transpose(1, 2)


class SelfAttention(nn.Module):
    """Causal GQA attention with q_norm/k_norm and RoPE over a position-indexed cache.

    `gated` is the Qwen3.5 variant: q_proj emits query and gate interleaved per head
    ([heads, 2 * head_dim], query first), and the output is multiplied by sigmoid(gate).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        norm_offset: bool,
        gated: bool,
        bias: bool = False,
        sliding_window: int | None = None,
        causal: bool = True,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.gated = gated
        self.sliding_window = sliding_window
        self.causal = causal
        q_out = num_heads * head_dim * (2 if gated else 1)
        self.q_proj = nn.Linear(hidden_size, q_out, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps, offset=norm_offset)
        self.k_norm = RMSNorm(head_dim, eps, offset=norm_offset)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        batch, T, _ = x.shape
        q = self.q_proj(x).view(batch, T, self.num_heads, -1)
        gate = None
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
            gate = gate.reshape(batch, T, -1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(batch, T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, T, self.num_kv_heads, self.head_dim)
        q = ctx.rotary.apply(q, ctx.cos, ctx.sin)
        k = ctx.rotary.apply(k, ctx.cos, ctx.sin)
        out = cached_attention(
            q,
            k,
            v,
            ctx.state.k_cache[layer],
            ctx.state.v_cache[layer],
            ctx.slots,
            ctx.positions,
            ctx.kv_len,
            self.head_dim**-0.5,
            self.sliding_window,
            self.causal,
            ctx.valid_len,
        ).reshape(batch, T, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def write_kv(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> None:
        """Write this layer's keys and values for x at ctx.positions, attending to nothing
        (the DFlash draft's context rows, computed from target features)."""
        batch, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(batch, T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, T, self.num_kv_heads, self.head_dim)
        rows = ctx.slots[:, None]
        ctx.state.k_cache[layer][rows, ctx.positions] = ctx.rotary.apply(k, ctx.cos, ctx.sin)
        ctx.state.v_cache[layer][rows, ctx.positions] = v


class ForwardContext:
    """What every layer of one forward pass needs besides its input."""

    def __init__(
        self,
        state,  # TargetState (typed loosely to keep this module free of state imports)
        slots: torch.Tensor,  # [batch]
        positions: torch.Tensor,  # [batch, T]
        kv_len: int,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        valid_len: torch.Tensor | None = None,  # [batch] real tokens per row, None: all T
        record: str | None = None,  # keep verify inputs/states for a commit strategy
        chunked: bool = False,  # Gated DeltaNet a chunk at a time (training; full rows only)
    ) -> None:
        if chunked and (valid_len is not None or record is not None):
            raise ValueError("a chunked forward takes full rows and records nothing")
        self.chunked = chunked
        self.state = state
        self.valid_len = valid_len
        self.record = record
        self.slots = slots
        self.positions = positions
        self.kv_len = kv_len
        self.rotary = rotary
        self.cos, self.sin = rotary.cos_sin(positions, dtype)
