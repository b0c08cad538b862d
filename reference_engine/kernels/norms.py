"""Row-wise kernels: RMSNorm (w or 1 + w), with the residual add before it, gated RMSNorm,
and the SwiGLU product. One program per row, the whole row in one block, so a row's sum of squares is
reduced in one fixed order whatever the number of rows or the batch around it.

Rounding follows kernels/reference.py step by step (float32 accumulation for half types, the
same casts back to the model dtype), so the two agree to the last bits on most rows; only
the Triton kernels promise invariance.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch import LAUNCH

PLAIN, OFFSET, GATED = 0, 1, 2  # normalisation kinds


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit(do_not_specialize=["stride_z"])
def _norm_kernel(
    x_ptr,
    w_ptr,
    z_ptr,
    out_ptr,
    res_ptr,
    sum_ptr,
    H,
    eps,
    stride_z,
    KIND: tl.constexpr,
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    out_ty = out_ptr.dtype.element_ty
    # rounded to the output dtype first (a float32 input of the gated norm is the model's value)
    x = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0).to(out_ty).to(tl.float32)
    if ADD:  # x + residual, rounded to the model dtype as PyTorch's add rounds, is normed and kept
        x = (x + tl.load(res_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)).to(out_ty)
        tl.store(sum_ptr + row * H + cols, x, mask=ok)
        x = x.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if KIND == 1:  # (normed * (1 + w)) in float32, then the model dtype
        y = normed * (1.0 + w)
    else:  # w * normed, normed first rounded to the model dtype
        y = w * normed.to(out_ty).to(tl.float32)
        if KIND == 2:  # then times silu(z) in float32
            y = y.to(out_ty).to(tl.float32)
            z = tl.load(z_ptr + row * stride_z + cols, mask=ok, other=0.0).to(tl.float32)
            y = y * (z * _sigmoid(z))
    tl.store(out_ptr + row * H + cols, y.to(out_ty), mask=ok)


@triton.jit(do_not_specialize=["stride_g", "stride_u"])
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, stride_g, stride_u, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(gate_ptr + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    silu = (g * _sigmoid(g)).to(out_ty).to(tl.float32)  # F.silu rounds to the dtype first
    tl.store(out_ptr + row * n + offs, (silu * u).to(out_ty), mask=ok)


def _row_view(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last] with contiguous rows, a view when x's rows are evenly strided (the
    column ranges of one fused projection are), else a copy."""
    n = x.shape[-1]
    rows = x.reshape(math.prod(x.shape[:-1]), n) if x.dim() > 1 else x.reshape(1, n)  # no -1: n may be 0
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _rows(
    x: torch.Tensor,
    kind: int,
    eps: float,
    weight: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
):
    H = x.shape[-1]
    x2 = x.reshape(-1, H).contiguous()
    dtype = z.dtype if z is not None else x.dtype  # the gated norm's output: z's dtype
    out = torch.empty(x2.shape, dtype=dtype, device=x.device)
    summed = torch.empty_like(x2) if residual is not None else None
    rows = x2.shape[0]
    if rows:
        z2 = _row_view(z) if z is not None else x2
        r2 = residual.reshape(-1, H).contiguous() if residual is not None else x2
        w = weight.contiguous() if weight is not None else x2
        block = triton.next_power_of_2(H)
        _norm_kernel[(rows,)](
            x2,
            w,
            z2,
            out,
            r2,
            summed if summed is not None else out,
            H,
            eps,
            z2.stride(0),
            KIND=kind,
            ADD=residual is not None,
            BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
            **LAUNCH,
        )
    if summed is not None:
        return out.reshape(x.shape), summed.reshape(x.shape)
    return out.reshape(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    return _rows(x, OFFSET if offset else PLAIN, eps, weight)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rows(x, OFFSET if offset else PLAIN, eps, weight, residual=residual)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rows(x, GATED, eps, weight, z)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; gate and up may be column views of one [..., 2 * n] product."""
    g, u = _row_view(gate), _row_view(up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows, n = g.shape
    if rows and n:
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](
            g, u, out, n, g.stride(0), u.stride(0), BLOCK=block, **LAUNCH
        )
    return out
