"""Row copies of the commit, one launch each: a Gated DeltaNet layer's kept recurrent state
(`copy_rows`) and its conv state at the accepted boundary (`conv_state_at`), where PyTorch
takes a gather, an index_select and an index_copy_. Copies only: no arithmetic, so the bits
are the source's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import LAUNCH

BLOCK = 4096


@triton.jit
def _copy_rows_kernel(dst_ptr, dst_rows_ptr, src_ptr, src_rows_ptr, row_len, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < row_len
    src = tl.load(src_rows_ptr + i).to(tl.int64) * row_len
    dst = tl.load(dst_rows_ptr + i).to(tl.int64) * row_len
    tl.store(dst_ptr + dst + cols, tl.load(src_ptr + src + cols, mask=ok), mask=ok)


def copy_rows(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for every i (kernels/reference.py `copy_rows`)."""
    if not (dst.is_contiguous() and src.is_contiguous()) or dst.shape[1:] != src.shape[1:]:
        raise ValueError("copy_rows: contiguous tensors with the same row shape")
    n, row_len = dst_rows.shape[0], dst[0].numel() if dst.shape[0] else 0
    if n and row_len:
        _copy_rows_kernel[(n, triton.cdiv(row_len, BLOCK))](
            dst, dst_rows.contiguous(), src, src_rows.contiguous(), row_len, BLOCK=BLOCK, **LAUNCH
        )


@triton.jit
def _conv_state_at_kernel(
    conv_ptr,
    rec_ptr,
    slots_ptr,
    processed_ptr,
    C,
    s_rs,
    s_rc,
    W: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    i = tl.program_id(0)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ws = tl.arange(0, BLOCK_W)
    ok = (cs[:, None] < C) & (ws[None, :] < W)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    start = tl.load(processed_ptr + i)
    kept = tl.load(rec_ptr + slot * s_rs + cs[:, None] * s_rc + start + ws[None, :], mask=ok)
    tl.store(conv_ptr + (slot * C + cs[:, None]) * W + ws[None, :], kept, mask=ok)


def conv_state_at(
    conv: torch.Tensor, slots: torch.Tensor, recorded: torch.Tensor, processed: torch.Tensor
) -> None:
    """conv[s] = the kernel-1 inputs of recorded[s] from position processed[i] on, s =
    slots[i] (kernels/reference.py `conv_state_at`)."""
    n, (_, C, W) = slots.shape[0], conv.shape
    if not conv.is_contiguous() or recorded.stride(-1) != 1:
        raise ValueError("conv_state_at: a contiguous conv state, recorded inputs contiguous per channel")
    if n and W:
        block_c = 64
        _conv_state_at_kernel[(n, triton.cdiv(C, block_c))](
            conv,
            recorded,
            slots.contiguous(),
            processed.contiguous(),
            C,
            recorded.stride(0),
            recorded.stride(1),
            W=W,
            BLOCK_C=block_c,
            BLOCK_W=triton.next_power_of_2(W),
            **LAUNCH,
        )
