"""Gated DeltaNet kernels: the recurrent gated delta rule over T tokens in one launch, and the
depthwise causal conv (+ SiLU) in front of it.

The recurrence keeps each (row, value head, value block) state tile [k_dim, BLOCK_V] in
float32 registers and steps the T tokens in order with exactly the per-token arithmetic of a
one-token decode step (kernels/reference.py states the rule). One compiled kernel serves
every T (T, the flags and the row strides are not specialisation keys), so a token's output
and the state after it are the same bits in decode, in a verify block, and in a prefill
chunk of any size: prefill runs this same recurrence, so any prefill chunking gives the same
state. Tokens at t >= valid_len of their row leave the state alone; with `states_out`, the
state after every token is written out (the `per_token` commit strategy).

The conv sums its `kernel` taps in a fixed order in float32 per output element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 32


@triton.jit(do_not_specialize=["T", "store_states"])
def _gated_delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, valid_ptr, out_ptr, final_ptr, states_ptr,
    T, H, store_states,  # all contiguous: q, k [batch, T, H, DK]; v, out [batch, T, H, DV];
    # g, beta [batch, T, H]; state, final [batch, H, DK, DV]; states [batch, T, H, DK, DV]
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    ks = tl.arange(0, BLOCK_K)
    vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = ks < DK
    v_ok = vs < DV
    tile_ok = k_ok[:, None] & v_ok[None, :]
    tile = ks[:, None] * DV + vs[None, :]
    head_state = (b * H + h).to(tl.int64) * DK * DV
    S = tl.load(state_ptr + head_state + tile, mask=tile_ok, other=0.0).to(tl.float32)
    valid = tl.load(valid_ptr + b)
    for t in range(0, T):
        tok = (b * T + t).to(tl.int64) * H + h  # token (b, t) of head h
        q = tl.load(q_ptr + tok * DK + ks, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + tok * DK + ks, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + tok * DV + vs, mask=v_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + tok).to(tl.float32)
        beta = tl.load(beta_ptr + tok).to(tl.float32)
        decayed = S * tl.exp(g)
        kv_mem = tl.sum(decayed * k[:, None], axis=0)
        delta = (v - kv_mem) * beta
        updated = decayed + k[:, None] * delta[None, :]
        o = tl.sum(updated * q[:, None], axis=0)
        tl.store(out_ptr + tok * DV + vs, o.to(out_ptr.dtype.element_ty), mask=v_ok)
        S = tl.where(t < valid, updated, S)
        if store_states != 0:
            tl.store(states_ptr + tok * DK * DV + tile, S, mask=tile_ok)
    tl.store(final_ptr + head_state + tile, S, mask=tile_ok)


def gated_delta(
    q: torch.Tensor,  # [batch, T, v_heads, k_dim] float32
    k: torch.Tensor,  # [batch, T, v_heads, k_dim]
    v: torch.Tensor,  # [batch, T, v_heads, v_dim]
    g: torch.Tensor,  # [batch, T, v_heads]
    beta: torch.Tensor,  # [batch, T, v_heads]
    state: torch.Tensor,  # [batch, v_heads, k_dim, v_dim] float32
    valid_len: torch.Tensor | None = None,  # [batch]
    states_out: torch.Tensor | None = None,  # [batch, T, v_heads, k_dim, v_dim]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels.reference.gated_delta: (outputs [batch, T, v_heads, v_dim],
    final state)."""
    batch, T, H, DK = q.shape
    DV = v.shape[-1]
    if state.dtype != torch.float32:
        raise ValueError(f"gated_delta: the state is kept in float32, got {state.dtype}")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    state = state.contiguous()
    out = torch.empty((batch, T, H, DV), dtype=v.dtype, device=v.device)
    final = torch.empty_like(state)
    if valid_len is None:
        valid_len = torch.full((batch,), T, dtype=torch.int64, device=q.device)
    scratch = states_out if states_out is not None else final
    if states_out is not None and not states_out.is_contiguous():
        raise ValueError("gated_delta: states_out must be contiguous")
    if batch == 0:
        return out, final
    grid = (batch, H, triton.cdiv(DV, BLOCK_V))
    _gated_delta_kernel[grid](
        q, k, v, g, beta, state, valid_len.contiguous(), out, final, scratch,
        T, H, int(states_out is not None),
        DK=DK, DV=DV, BLOCK_K=max(16, triton.next_power_of_2(DK)), BLOCK_V=BLOCK_V,
        num_warps=4,
    )
    return out, final


@triton.jit(do_not_specialize=["T", "W"])
def _causal_conv_kernel(x_ptr, w_ptr, out_ptr, C, T, W,
                        KERNEL: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    b = tl.program_id(0)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ts = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = (cs[:, None] < C) & (ts[None, :] < T)
    row = (b * C + cs).to(tl.int64)[:, None]
    acc = tl.zeros((BLOCK_C, BLOCK_T), tl.float32)
    for j in tl.static_range(KERNEL):
        w = tl.load(w_ptr + cs * KERNEL + j, mask=cs < C, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * W + ts[None, :] + j, mask=ok, other=0.0).to(tl.float32)
        acc += w[:, None] * x
    out_ty = out_ptr.dtype.element_ty
    y = acc.to(out_ty).to(tl.float32)  # conv1d's output in the model dtype, then SiLU
    y = y / (1.0 + tl.exp(-y))
    tl.store(out_ptr + row * T + ts[None, :], y.to(out_ty), mask=ok)


def causal_conv(full: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same contract as kernels.reference.causal_conv: full [batch, C, kernel-1+T], weight
    [C, 1, kernel] -> silu(conv) [batch, C, T]."""
    batch, C, W = full.shape
    kernel = weight.shape[-1]
    T = W - kernel + 1
    x = full.contiguous()
    out = torch.empty((batch, C, T), dtype=full.dtype, device=full.device)
    if batch == 0 or T <= 0:
        return out
    block_c, block_t = 64, 16
    grid = (batch, triton.cdiv(C, block_c), triton.cdiv(T, block_t))
    _causal_conv_kernel[grid](x, weight.reshape(C, kernel).contiguous(), out, C, T, W,
                              KERNEL=kernel, BLOCK_C=block_c, BLOCK_T=block_t)
    return out
