"""Greedy argmax on the device: one program per row, one pass over the vocabulary in blocks;
on an exact tie the lowest token id wins (inside a block by `tie_break_left`, across blocks
because only a strictly greater maximum replaces the best so far)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 0, tl.int64)
    for v0 in range(0, V, BLOCK):
        ids = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * V + ids, mask=ids < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        i = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + v0
        take = m > best
        best_id = tl.where(take, i, best_id)
        best = tl.where(take, m, best)
    tl.store(out_ptr + row, best_id)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Same contract as kernels.reference.greedy: [..., vocab] -> [...] int64."""
    V = logits.shape[-1]
    x = logits.reshape(-1, V).contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64, device=logits.device)
    if x.shape[0]:
        _argmax_kernel[(x.shape[0],)](x, out, V, BLOCK=min(BLOCK_V, triton.next_power_of_2(V)))
    return out.reshape(logits.shape[:-1])
