"""Attention over the position-indexed cache, invariant to how queries are grouped.

One program takes one (row, kv head) and a tile of query rows (the T tokens times the query
heads that share the kv head): BLOCK_M of them for a decode step or a verify block,
WIDE_ELEMENTS / head_dim (64 rows at head_dim 128) for a prefill chunk, which then reads
each key block once for four times as many queries. It reads the slot's cache in place (no
gather) in key blocks of BLOCK_N aligned to absolute positions 0, BLOCK_N, 2*BLOCK_N, ...,
with an online softmax in float32. A query at position p reduces over the same key blocks in
the same order whether it is decoded alone (T = 1), verified inside a block (T = B), or run
in a prefill chunk of any size, whatever the other rows of the batch hold: a block that
holds no key a query may see adds exactly nothing to it (its weights are exp(-inf) = 0 and
the running maximum does not move, so the rescale factor is exactly 1). The tile does not
move a row's bits either: each element of the two products sums its terms in the tensor
cores' order for any tile (the GPU tier checks it), the running maximum is exact in any
order, and the row sums of the weights are integer sums (`_fixed_point_sum`), which have no
order. A key block that every row of the tile sees whole runs without the mask, which there
is the identity, and the others with it; which blocks those are depends on the tile, so the
two must give the same bits. Both kernels are compiled without FP fusion (launch.UNFUSED):
with fusion on, the compiler may contract the scores' scale into the subtraction of the
maximum on one kind of block and not on the other (one rounding fewer there), and two
versions that left such blocks unmasked with fusion on failed the bit tests on an H200 (a
float32 query's bits across split paths; DFlash == plain greedy on the Qwen3-8B shape;
verify logits against decode's beside a 32K prompt). The mask is applied to the raw scores;
the weights are exp2(s * c - m * c) with c = scale * log2(e). Positions, lengths and the
non-causal limit come from device tensors; no host value bounds the loop.

Long contexts are split: the keys are cut at fixed absolute positions 0, SPLIT, 2*SPLIT, ...;
each split's key blocks go through their own online softmax (from m = -inf, l = 0), and the
splits' results are combined in ascending order by one rule (`_combine`). Few query rows (a
decode step, a verify block: at most SPLIT_ROWS tokens a row) run every split in its own
program, which keeps the SMs busy on one long cache, and a second kernel combines them;
more rows (prefill) run the splits one after the other in one program and combine as they
go. Both do the same operations on the same splits in the same order, so a query's bits do
not depend on which path ran it, on how many splits were launched (a split past a query's
keys combines as an exact no-op: its weights are exp(-inf) = 0), or on the batch. A context
within one split combines once from (m = -inf, l = 0), which returns that split's own
softmax exactly.

Masks: causal (keys 0..p), non-causal (the DFlash draft's block: every key up to the last
real token of the row, `valid_len`), and a sliding window (keys more than w-1 behind hidden).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import UNFUSED

BLOCK_M = 16  # query rows of a program for a decode step or a verify block
WIDE_ELEMENTS = 64 * 128  # a prefill chunk's tile (more than SPLIT_ROWS tokens): rows x BLOCK_D
BLOCK_N = 64
FIXED_BITS = 48  # resolution of the softmax's row sums (_fixed_point_sum)
FIXED_SCALE: tl.constexpr = tl.constexpr(float(2**FIXED_BITS))
SPLIT = 2048  # key positions of a split (a multiple of BLOCK_N), from absolute position 0
SPLIT_ROWS = 16  # tokens a row up to which each split runs in a program of its own
WIDE_WARPS = 4  # warps of a program of wide tiles
MASK_WHOLE_BLOCKS = False  # mask also the key blocks a tile sees whole (the same bits, slower)
LOG2_E = 1.4426950408889634


@triton.jit
def _fixed_point_sum(p):
    """The sum over axis 1 of weights in [0, 1], in any order the same bits: each weight as
    an integer count of 2**-FIXED_BITS (rounded down), summed exactly in int64, the total
    rounded once to float32. A float sum's order follows the tile's layout over the threads
    (wide prefill tiles lay rows out otherwise than narrow decode tiles); an integer sum has
    no order. Weights below 2**-FIXED_BITS count 0: the row's sum is at least 1 (its largest
    weight is exp(0)), so what they drop is below float32's resolution of it."""
    counts = (p * FIXED_SCALE).to(tl.int64)
    return tl.sum(counts, axis=1).to(tl.float32) * (1.0 / FIXED_SCALE)


@triton.jit
def _key_block(
    q,
    k_ptr,
    v_ptr,
    cache,
    k0,
    lo,
    hi,
    max_len,
    c,
    stride_cl,
    d,
    d_ok,
    m_i,
    l_i,
    acc,
    MASKED: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One key block of the online softmax, in the scores' raw units (m is a raw score; c =
    scale * log2(e)). MASKED: some row of the tile may not see some key of the block, or the
    block runs past the cache. On a block that every row sees whole the mask is the identity,
    and the weights' arithmetic from the raw scores on is the same in both, so either gives
    the same bits."""
    kpos = k0 + tl.arange(0, BLOCK_N)
    offs = cache + kpos[:, None].to(tl.int64) * stride_cl + d[None, :]
    if MASKED:
        kv_ok = (kpos < max_len)[:, None] & d_ok[None, :]
        # a key past every row's last is read as 0: its weight is 0 in every row, and a value
        # there (a slot's rows past its request's length, left by an earlier request, NaN from
        # one that failed included) must not reach the rows as 0 * NaN
        v_ok = kv_ok & (kpos <= tl.max(hi, axis=0))[:, None]
    else:
        kv_ok = d_ok[None, :]
        v_ok = kv_ok
    k = tl.load(k_ptr + offs, mask=kv_ok, other=0.0)
    v = tl.load(v_ptr + offs, mask=v_ok, other=0.0)
    if IEEE:  # float32 models: no tf32 rounding of the operands
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if MASKED:
        seen = (kpos[None, :] <= hi[:, None]) & (kpos[None, :] >= lo[:, None])
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * c - (m_safe * c)[:, None])
    alpha = tl.exp2(m_i * c - m_safe * c)
    l_i = l_i * alpha + _fixed_point_sum(p)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _split_softmax(
    q,
    k_ptr,
    v_ptr,
    cache,
    lo,
    hi,
    begin,
    end,
    whole_lo,
    whole_hi,
    max_len,
    c,
    stride_cl,
    d,
    d_ok,
    MASK_WHOLE: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The online softmax of one split: (running max, sum of weights, weighted values) over
    the key blocks from `begin` to `end` in ascending order, each query row seeing keys
    lo..hi. The blocks from `whole_lo` to `whole_hi` (block-aligned) are seen whole by every
    row of the tile and run unmasked (masked too with MASK_WHOLE, the same bits, for the
    kernel benchmark's comparison); those before and after, masked."""
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    first = tl.minimum(tl.maximum(whole_lo, begin), end)
    last = tl.maximum(tl.minimum(whole_hi, end), first)
    for k0 in range(begin, first, BLOCK_N):
        m_i, l_i, acc = _key_block(
            q, k_ptr, v_ptr, cache, k0, lo, hi, max_len, c, stride_cl, d, d_ok, m_i, l_i, acc,
            True, IEEE, BLOCK_N,
        )  # fmt: skip
    for k0 in range(first, last, BLOCK_N):
        m_i, l_i, acc = _key_block(
            q, k_ptr, v_ptr, cache, k0, lo, hi, max_len, c, stride_cl, d, d_ok, m_i, l_i, acc,
            MASK_WHOLE, IEEE, BLOCK_N,
        )  # fmt: skip
    for k0 in range(last, end, BLOCK_N):
        m_i, l_i, acc = _key_block(
            q, k_ptr, v_ptr, cache, k0, lo, hi, max_len, c, stride_cl, d, d_ok, m_i, l_i, acc,
            True, IEEE, BLOCK_N,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _combine(m_run, l_run, acc_run, m_s, l_s, acc_s, c):
    """The running result with one more split's added: every split in ascending order (m in
    raw score units, c = scale * log2(e))."""
    m_new = tl.maximum(m_run, m_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    old = tl.exp2(m_run * c - m_safe * c)
    new = tl.exp2(m_s * c - m_safe * c)
    return m_new, l_run * old + l_s * new, acc_run * old[:, None] + acc_s * new[:, None]


# T, the row strides and the rest vary between a decode step and a verify block: keep them out
# of the specialisation keys so that one compiled kernel serves both
@triton.jit(
    do_not_specialize=["T", "G", "n_splits", "max_len", "window", "stride_qb", "stride_ob", "stride_pb"]
)
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    slots_ptr,
    pos_ptr,
    valid_ptr,
    m_part,
    l_part,
    acc_part,
    T,
    G,
    n_splits,
    max_len,
    scale_log2e,
    window,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_cs,
    stride_cl,
    stride_ch,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_pb,
    CAUSAL: tl.constexpr,
    SLIDING: tl.constexpr,
    HAS_VALID: tl.constexpr,
    IEEE: tl.constexpr,
    SPLITS_APART: tl.constexpr,
    SPLIT_LEN: tl.constexpr,
    MASK_WHOLE: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    if SPLITS_APART:  # one split of one row: its partial result, combined by _merge_kernel
        b = tl.program_id(2) // n_splits
        split = tl.program_id(2) % n_splits
    else:
        b = tl.program_id(2)
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows of this tile: r = t * G + g
    row_ok = r < T * G
    t = r // G
    head = kv_head * G + r % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    q = tl.load(
        q_ptr + b * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    pos = tl.load(pos_ptr + b * stride_pb + t, mask=row_ok, other=0)
    if CAUSAL:
        hi = pos
    else:
        if HAS_VALID:
            last = tl.load(pos_ptr + b * stride_pb) + tl.load(valid_ptr + b) - 1
        else:
            last = tl.load(pos_ptr + b * stride_pb + T - 1)
        hi = tl.zeros_like(pos) + last
    if SLIDING:
        lo = pos - window + 1
        hi = tl.minimum(hi, pos + window - 1)
    else:
        lo = tl.zeros_like(pos)
    hi = tl.where(row_ok, hi, -1)  # padding rows see nothing
    lo = tl.where(row_ok, lo, 2147483647)

    slot = tl.load(slots_ptr + b)
    cache = slot.to(tl.int64) * stride_cs + kv_head * stride_ch
    start = (tl.maximum(tl.min(lo, axis=0), 0) // BLOCK_N) * BLOCK_N
    stop = tl.max(hi, axis=0) + 1
    # the key blocks every row of the tile sees whole (padding rows see none and bound none)
    whole_lo = tl.cdiv(tl.max(tl.where(row_ok, lo, 0), axis=0), BLOCK_N) * BLOCK_N
    whole_hi = tl.min(tl.where(row_ok, hi, 2147483646), axis=0) + 1
    whole_hi = (tl.minimum(whole_hi, max_len) // BLOCK_N) * BLOCK_N
    if SPLITS_APART:
        m_s, l_s, acc_s = _split_softmax(
            q,
            k_ptr,
            v_ptr,
            cache,
            lo,
            hi,
            tl.maximum(split * SPLIT_LEN, start),
            tl.minimum((split + 1) * SPLIT_LEN, stop),
            whole_lo,
            whole_hi,
            max_len,
            scale_log2e,
            stride_cl,
            d,
            d_ok,
            MASK_WHOLE,
            IEEE,
            BLOCK_M,
            BLOCK_D,
            BLOCK_N,
        )
        at = ((b * n_splits + split) * tl.num_programs(1) + kv_head) * tl.num_programs(0) * BLOCK_M + r
        tl.store(m_part + at, m_s)
        tl.store(l_part + at, l_s)
        tl.store(acc_part + at[:, None] * BLOCK_D + d[None, :], acc_s)
    else:
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for s0 in range((start // SPLIT_LEN) * SPLIT_LEN, stop, SPLIT_LEN):
            m_s, l_s, acc_s = _split_softmax(
                q,
                k_ptr,
                v_ptr,
                cache,
                lo,
                hi,
                tl.maximum(s0, start),
                tl.minimum(s0 + SPLIT_LEN, stop),
                whole_lo,
                whole_hi,
                max_len,
                scale_log2e,
                stride_cl,
                d,
                d_ok,
                MASK_WHOLE,
                IEEE,
                BLOCK_M,
                BLOCK_D,
                BLOCK_N,
            )
            m_i, l_i, acc = _combine(m_i, l_i, acc, m_s, l_s, acc_s, scale_log2e)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + b * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit(do_not_specialize=["T", "G", "stride_ob"])
def _merge_kernel(
    m_part,
    l_part,
    acc_part,
    out_ptr,
    T,
    G,
    n_splits,
    scale_log2e,
    stride_ob,
    stride_ot,
    stride_oh,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Each split's partial result of _attention_kernel (SPLITS_APART), combined in
    ascending order: what the one-program path computes as it goes."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.program_id(2)
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < T * G
    t = r // G
    head = kv_head * G + r % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for split in range(0, n_splits):
        at = ((b * n_splits + split) * tl.num_programs(1) + kv_head) * tl.num_programs(0) * BLOCK_M + r
        m_s = tl.load(m_part + at)
        l_s = tl.load(l_part + at)
        acc_s = tl.load(acc_part + at[:, None] * BLOCK_D + d[None, :])
        m_i, l_i, acc = _combine(m_i, l_i, acc, m_s, l_s, acc_s, scale_log2e)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + b * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def attention(
    q: torch.Tensor,  # [batch, T, heads, head_dim]
    k_cache: torch.Tensor,  # [slots, max_len, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [batch]
    positions: torch.Tensor,  # [batch, T]
    kv_len: int,  # unused: each query's own position bounds its keys
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    valid_len: torch.Tensor | None = None,  # [batch]
    split: int = SPLIT,
) -> torch.Tensor:
    """Same contract as kernels.reference.attention. Returns [batch, T, heads, head_dim].
    `split` overrides SPLIT (a multiple of BLOCK_N), for tests on short caches: a query's bits
    depend on it, on nothing else of the call."""
    batch, T, heads, D = q.shape
    kv_heads = k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"attention: {heads} query heads do not group over {kv_heads} kv heads")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("attention: k and v caches must share a layout with contiguous head_dim")
    if split % BLOCK_N:
        raise ValueError(f"attention: a split of {split} positions is not a multiple of {BLOCK_N}")
    G = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    if batch == 0 or T == 0:
        return out
    positions = positions.contiguous()
    slots = slots.contiguous()
    valid = valid_len.contiguous() if valid_len is not None else positions
    max_len = k_cache.shape[1]
    block_d = max(16, triton.next_power_of_2(D))
    block_m, warps = (BLOCK_M, 4) if T <= SPLIT_ROWS else (max(BLOCK_M, WIDE_ELEMENTS // block_d), WIDE_WARPS)
    tiles = triton.cdiv(T * G, block_m)
    n_splits = triton.cdiv(max_len, split)
    apart = n_splits > 1 and T <= SPLIT_ROWS
    rows = batch * n_splits * kv_heads * tiles * block_m if apart else 1
    m_part = torch.empty(rows, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(rows * block_d if apart else 1, dtype=torch.float32, device=q.device)
    _attention_kernel[(tiles, kv_heads, batch * n_splits if apart else batch)](
        q,
        k_cache,
        v_cache,
        out,
        slots,
        positions,
        valid,
        m_part,
        l_part,
        acc_part,
        T,
        G,
        n_splits,
        max_len,
        scale * LOG2_E,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        positions.stride(0),
        CAUSAL=causal,
        SLIDING=sliding_window is not None,
        HAS_VALID=valid_len is not None,
        IEEE=q.dtype == torch.float32,
        SPLITS_APART=apart,
        SPLIT_LEN=split,
        MASK_WHOLE=MASK_WHOLE_BLOCKS,
        D=D,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        num_warps=warps,
        **UNFUSED,
    )
    if apart:
        _merge_kernel[(tiles, kv_heads, batch)](
            m_part,
            l_part,
            acc_part,
            out,
            T,
            G,
            n_splits,
            scale * LOG2_E,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            D=D,
            BLOCK_D=block_d,
            BLOCK_M=BLOCK_M,
            num_warps=4,
            **UNFUSED,
        )
    return out
