"""The inputs of attention in one launch per layer: per-head RMSNorm of queries and keys (none
for a family without per-head norms, Llama), RoPE
(rotate-half, over the first rotary_dim dims of each head), the normed, rotated queries
written out and the keys and values written into the position-indexed cache.

One program per (token, head), the head's whole row in one block. The rounding follows the
reference (kernels/reference.py: `rms_norm` then `rotate`, each product and sum rounded to
the model dtype as PyTorch's elementwise operations round), and a row's result depends on
that row alone, so a token gets the same bits alone, in a verify block or in a batch.
Compiled without FP fusion (launch.UNFUSED): with it, the assembler contracted the rotation's
products and sum past the roundings between them, and 18-23% of the rotated query elements
differed from the reference in float16 and bfloat16 on an H100; without it, none.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import UNFUSED


@triton.jit
def _norm_rope(
    src,
    w_ptr,
    cos,
    sin,
    d,
    partner,
    ok,
    in_rot,
    first_half,
    eps,
    NORM: tl.constexpr,
    OFFSET: tl.constexpr,
    D: tl.constexpr,
    out_ty: tl.constexpr,
):
    x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=ok & in_rot, other=0.0).to(tl.float32)
    if not NORM:  # no per-head norm (Llama): the inputs are rotated as they are
        y = x
        yp = xp
    elif OFFSET:  # (normed * (1 + w)) in float32, then the model dtype
        scale = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=ok & in_rot, other=0.0).to(tl.float32)
        y = (x * scale * (1.0 + w)).to(out_ty).to(tl.float32)
        yp = (xp * scale * (1.0 + wp)).to(out_ty).to(tl.float32)
    else:  # w * normed, normed first rounded to the model dtype
        scale = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=ok & in_rot, other=0.0).to(tl.float32)
        y = (w * (x * scale).to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)
        yp = (wp * (xp * scale).to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)
    rotated = tl.where(first_half, -yp, yp)
    a = (y * cos).to(out_ty).to(tl.float32)
    b = (rotated * sin).to(out_ty).to(tl.float32)
    return tl.where(in_rot, a + b, y).to(out_ty)


# T and the strides vary between decode, verify and prefill: one compiled kernel for all
@triton.jit(
    do_not_specialize=["T", "HQ", "s_qb", "s_qt", "s_kb", "s_kt", "s_vb", "s_vt", "s_ob", "s_ot", "s_pb"]
)
def _attention_inputs_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    kc_ptr,
    vc_ptr,
    slots_ptr,
    pos_ptr,
    T,
    HQ,
    eps,
    s_qb,
    s_qt,
    s_qh,
    s_kb,
    s_kt,
    s_kh,
    s_vb,
    s_vt,
    s_vh,
    s_ob,
    s_ot,
    s_oh,
    s_cs,
    s_cl,
    s_ch,
    s_pb,
    NORM: tl.constexpr,
    OFFSET: tl.constexpr,
    D: tl.constexpr,
    RD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)  # b * T + t
    head = tl.program_id(1)  # query heads first, then kv heads
    b = row // T
    t = row % T
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    half = RD // 2
    first_half = d < half
    in_rot = d < RD
    partner = tl.where(first_half, d + half, d - half)
    cos = tl.load(cos_ptr + row * RD + d, mask=in_rot, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * RD + d, mask=in_rot, other=0.0).to(tl.float32)
    out_ty = kc_ptr.dtype.element_ty
    if head < HQ:
        y = _norm_rope(
            q_ptr + b * s_qb + t * s_qt + head * s_qh,
            qw_ptr,
            cos,
            sin,
            d,
            partner,
            ok,
            in_rot,
            first_half,
            eps,
            NORM,
            OFFSET,
            D,
            out_ty,
        )
        tl.store(out_ptr + b * s_ob + t * s_ot + head * s_oh + d, y, mask=ok)
    else:
        kv = head - HQ
        slot = tl.load(slots_ptr + b)
        pos = tl.load(pos_ptr + b * s_pb + t)
        y = _norm_rope(
            k_ptr + b * s_kb + t * s_kt + kv * s_kh,
            kw_ptr,
            cos,
            sin,
            d,
            partner,
            ok,
            in_rot,
            first_half,
            eps,
            NORM,
            OFFSET,
            D,
            out_ty,
        )
        dest = slot * s_cs + pos * s_cl + kv * s_ch + d
        tl.store(kc_ptr + dest, y, mask=ok)
        v = tl.load(v_ptr + b * s_vb + t * s_vt + kv * s_vh + d, mask=ok, other=0.0)
        tl.store(vc_ptr + dest, v, mask=ok)


def attention_inputs(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    offset: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor | None:
    """kernels/reference.py `attention_inputs`, in one launch. q, k, v may be strided views
    (the column ranges of one fused projection); each head's dims must be contiguous."""
    batch, T, kv_heads, D = k.shape
    heads = q.shape[2] if q is not None else 0
    rd = cos.shape[-1]
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("attention_inputs: the key and value caches must share one layout")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"attention_inputs: {name}'s head dims must be contiguous")
    out = torch.empty((batch, T, heads, D), dtype=k.dtype, device=k.device) if q is not None else None
    if batch * T == 0:
        return out
    cos2, sin2 = cos.reshape(batch * T, rd).contiguous(), sin.reshape(batch * T, rd).contiguous()
    qq, oo = (q, out) if q is not None else (k, k)
    kw = k_weight if k_weight is not None else k  # no norms: a pointer the kernel never reads
    qw = q_weight if q_weight is not None else kw
    pos = positions if positions.stride(-1) == 1 else positions.contiguous()
    _attention_inputs_kernel[(batch * T, heads + kv_heads)](
        qq,
        k,
        v,
        qw.contiguous(),
        kw.contiguous(),
        cos2,
        sin2,
        oo,
        k_cache,
        v_cache,
        slots.contiguous(),
        pos,
        T,
        heads,
        eps,
        qq.stride(0),
        qq.stride(1),
        qq.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        oo.stride(0),
        oo.stride(1),
        oo.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        pos.stride(0),
        NORM=k_weight is not None,
        OFFSET=offset,
        D=D,
        RD=rd,
        BLOCK_D=triton.next_power_of_2(D),
        num_warps=4,
        **UNFUSED,
    )
    return out
