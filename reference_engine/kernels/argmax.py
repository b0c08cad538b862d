"""Greedy argmax on the device, in two passes: the vocabulary of each row is cut into chunks,
one program per (row, chunk) finds the chunk's maximum, and one program per row picks among
the chunks in order. A decode step's one row thus reads its logits with many programs, not
one. On an exact tie the lowest token id wins: inside a block by `tie_break_left`, across
blocks and chunks because only a strictly greater maximum replaces the best so far, and the
chunks are visited in ascending order. A row whose maximum is not finite gives `vocab`, as
the reference's greedy (the step then fails that request, runtime/outputs.py): a chunk with a
NaN reports the id `vocab`, which the second pass keeps over any maximum, and the second pass
gives `vocab` where the row's maximum is +inf or -inf (a +inf entry, or -inf throughout)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import LAUNCH

BLOCK_V = 2048
CHUNK_V = 8 * BLOCK_V  # vocabulary entries per first-pass program


@triton.jit
def _chunk_max_kernel(x_ptr, best_ptr, id_ptr, V, chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 0, tl.int64)
    nans = tl.full((), 0, tl.int32)
    for v0 in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, V), BLOCK):
        ids = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * V + ids, mask=ids < V, other=float("-inf")).to(tl.float32)
        nans += tl.sum((x != x).to(tl.int32), axis=0)
        m = tl.max(x, axis=0)
        i = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + v0
        take = m > best
        best_id = tl.where(take, i, best_id)
        best = tl.where(take, m, best)
    tl.store(best_ptr + row * chunks + chunk, best)
    tl.store(id_ptr + row * chunks + chunk, tl.where(nans > 0, V, best_id))


@triton.jit
def _pick_kernel(best_ptr, id_ptr, out_ptr, V, chunks):
    row = tl.program_id(0).to(tl.int64)
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 0, tl.int64)
    nan = tl.full((), 0, tl.int1)
    for c in range(0, chunks):
        m = tl.load(best_ptr + row * chunks + c)
        i = tl.load(id_ptr + row * chunks + c)
        nan = nan | (i == V)
        take = m > best
        best_id = tl.where(take, i, best_id)
        best = tl.where(take, m, best)
    infinite = (best == float("inf")) | (best == float("-inf"))
    tl.store(out_ptr + row, tl.where(nan | infinite, V, best_id))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Same contract as kernels.reference.greedy: [..., vocab] -> [...] int64."""
    V = logits.shape[-1]
    x = logits.reshape(-1, V).contiguous()
    rows = x.shape[0]
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        block = min(BLOCK_V, triton.next_power_of_2(V))
        chunk = max(CHUNK_V, block)
        chunks = triton.cdiv(V, chunk)
        best = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
        ids = torch.empty((rows, chunks), dtype=torch.int64, device=logits.device)
        _chunk_max_kernel[(rows, chunks)](x, best, ids, V, chunks, CHUNK=chunk, BLOCK=block, **LAUNCH)
        _pick_kernel[(rows,)](best, ids, out, V, chunks, **LAUNCH)
    return out.reshape(logits.shape[:-1])
