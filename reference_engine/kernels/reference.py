"""The plain-PyTorch implementation of every kernel: the reference the Triton kernels are
tested against, the CPU path, and the `fast` numerics on CUDA (cuBLAS GEMMs, SDPA).

Precision policy: half-precision inputs accumulate norms, softmax and recurrent state in
float32; float32 and float64 stay in their own dtype (never downcast). Everything here is
differentiable (the demo-pair training runs through it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reductions run in: float32 for half types, else the dtype itself."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): [..., K] x [N, K] -> [..., N]."""
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w, or * (1 + w) when `offset` (Qwen3.5), over the last axis."""
    acc = accumulation_dtype(x.dtype)
    xf = x.to(acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (1.0 + weight.to(acc))).to(x.dtype)
    return weight * normed.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (no offset) times silu(z): the Gated DeltaNet output norm, over the last axis."""
    acc = accumulation_dtype(x.dtype)
    xf = x.to(acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return (out * F.silu(z.to(acc))).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last axis, in x's dtype."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU product silu(gate) * up."""
    return F.silu(gate) * up


def causal_conv(full: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv1d then SiLU. full: [batch, channels, kernel-1+T] (the previous
    kernel-1 inputs, then T new ones); weight: [channels, 1, kernel]. Returns [batch, channels, T]."""
    return F.silu(F.conv1d(full, weight, groups=full.shape[1]))


def attention(
    q: torch.Tensor,  # [batch, T, heads, head_dim], already rotated
    k_cache: torch.Tensor,  # [slots, max_len, kv_heads, head_dim], this step's keys written
    v_cache: torch.Tensor,  # [slots, max_len, kv_heads, head_dim]
    slots: torch.Tensor,  # [batch]
    positions: torch.Tensor,  # [batch, T]
    kv_len: int,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    valid_len: torch.Tensor | None = None,  # [batch] real tokens per row (rest: padding)
) -> torch.Tensor:
    """Softmax attention of each query over its slot's cache rows.

    A query at position p sees key rows 0..p (causal) or, non-causal (the DFlash draft's
    block), every row up to the last real token of its row; a sliding window also hides rows
    w or more positions away. Returns [batch, T, heads, head_dim].
    """
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
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=allowed[:, None],
        scale=scale,
        enable_gqa=q.shape[2] != keys.shape[2],
    )
    return out.transpose(1, 2)


def gated_delta(
    q: torch.Tensor,  # [batch, T, v_heads, k_dim], normalised and scaled, state dtype
    k: torch.Tensor,  # [batch, T, v_heads, k_dim], normalised, state dtype
    v: torch.Tensor,  # [batch, T, v_heads, v_dim], state dtype
    g: torch.Tensor,  # [batch, T, v_heads] log decay (<= 0)
    beta: torch.Tensor,  # [batch, T, v_heads] write strength in (0, 1)
    state: torch.Tensor,  # [batch, v_heads, k_dim, v_dim]
    valid_len: torch.Tensor | None = None,  # [batch]: rows stop updating after this many
    states_out: torch.Tensor | None = None,  # [batch, T, v_heads, k_dim, v_dim] or None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one token at a time, per value head:

        S <- S * exp(g_t);  delta = (v_t - S^T k_t) * beta_t;  S <- S + k_t (x) delta;  o_t = S^T q_t

    Returns (outputs [batch, T, v_heads, v_dim], final state). Tokens at t >= valid_len of
    their row leave the state unchanged (padding in a batch of unequal rows). When
    `states_out` is given, the state after every token is written into it (the `per_token`
    commit strategy).
    """
    outputs = []
    for t in range(q.shape[1]):
        decayed = state * g[:, t, :, None, None].exp()
        kv_mem = torch.einsum("bhkv,bhk->bhv", decayed, k[:, t])
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        updated = decayed + k[:, t, :, :, None] * delta[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", updated, q[:, t]))
        if valid_len is None:
            state = updated
        else:
            state = torch.where((t < valid_len)[:, None, None, None], updated, state)
        if states_out is not None:
            states_out[:, t] = state
    return torch.stack(outputs, dim=1), state


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last axis; on an exact tie the lowest token id wins, on every backend.

    logits: [..., vocab] -> [...] (int64). No host synchronisation.
    """
    vocab = logits.shape[-1]
    best = logits.max(dim=-1, keepdim=True).values
    ids = torch.arange(vocab, device=logits.device)
    return torch.where(logits == best, ids, vocab).min(dim=-1).values
