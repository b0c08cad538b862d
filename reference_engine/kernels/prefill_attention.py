"""The fast numerics' attention: the vendor's fused causal attention (torch's
scaled_dot_product_attention, flash attention on an H100 or H200) for one request's prefill
chunk, the Triton kernel (kernels/attention.py) for everything else.

A prefill chunk of T tokens at positions kv_len-T .. kv_len-1 sees the slot's cache rows
0..kv_len-1 under a causal mask aligned to the last key (lower right): the contract's answer,
computed in the vendor's order, so its bits move with the chunking, as a serving engine's do.
It is taken only where that holds: one row, causal without a window, more than SPLIT_ROWS
tokens (no decode step or verify block of the usual sizes), outside a CUDA graph capture (the
captured prefills run the Triton kernel), and the chunk's positions exactly the T before
kv_len, which the host checks (one synchronisation a layer, against the milliseconds a long
chunk's attention takes). Any other call runs the Triton kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from .attention import SPLIT_ROWS
from .attention import attention as triton_attention


def attention(
    q: torch.Tensor,  # [batch, T, heads, head_dim]
    k_cache: torch.Tensor,  # [slots, max_len, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [batch]
    positions: torch.Tensor,  # [batch, T]
    kv_len: int,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    valid_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as kernels.reference.attention. Returns [batch, T, heads, head_dim]."""
    batch, T, heads, _ = q.shape
    args = (q, k_cache, v_cache, slots, positions, kv_len, scale, causal, sliding_window, valid_len)
    if (
        batch != 1
        or not causal
        or sliding_window is not None
        or T <= SPLIT_ROWS
        or T > kv_len
        or kv_len > k_cache.shape[1]
        or (q.is_cuda and torch.cuda.is_current_stream_capturing())
    ):
        return triton_attention(*args)
    tail = torch.arange(kv_len - T, kv_len, device=positions.device)
    slot, contiguous = torch.stack([slots[0], (positions[0] == tail).all().to(slots.dtype)]).tolist()
    if not contiguous:
        return triton_attention(*args)
    keys = k_cache[slot, :kv_len].transpose(0, 1)[None]  # [1, kv_heads, kv_len, head_dim]
    values = v_cache[slot, :kv_len].transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys,
        values,
        attn_mask=causal_lower_right(T, kv_len),
        scale=scale,
        enable_gqa=heads != keys.shape[1],
    )
    return out.transpose(1, 2)
