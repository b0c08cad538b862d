"""A batch-invariant matmul: out = x @ w.T (+ bias), row i of the output a function of row i
of x alone, bitwise, for any number of rows M.

How: there is no split-K, and every output element accumulates its K products in ascending
order, 16 at a time (one tensor-core step of bfloat16/float16), into one float32
accumulator, whatever the tile. The tiles decide only which elements one program computes
and how far ahead it loads, not the order of any element's sum, so they may change with M:
few rows (a decode step, a small verify) take narrow tiles that give every SM several
programs and a deep load pipeline (the weight is streamed once), many rows take wider tiles
that reuse each weight tile across more rows and are loaded by the tensor memory
accelerator (`tiles_for`, which also looks at the weight's shape). The GPU tier checks the
claim bitwise: row 0 for M = 1 .. 1000 across every switch, and every tile configuration
against every other on full outputs (tests/test_kernels_gpu.py). float32 (IEEE products, no
tensor cores) keeps one configuration for every M. M is not a specialisation key of the compiled kernel
(`do_not_specialize`), so one binary per configuration serves every M. cuBLAS picks other
kernels (and split-K) as M changes, so its rows move.

The grid runs the row tiles of one column tile next to each other, so a weight tile read from
memory serves every row tile from L2.

Tiles loaded by the tensor memory accelerator (past 16 rows) need their descriptors encoded
on the host at each launch: 30-50 us more host time per launch than pointer loads when run
eagerly (docs/results/h200-prefill/eager-tma.log), nothing inside a CUDA graph, where the
engine runs them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .launch import LAUNCH


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    tma: bool = False  # tiles loaded and stored by the Hopper tensor memory accelerator


# By row count and the weight's shape, chosen by sweeps on the H200 over the Qwen3-8B and
# Qwen3.5-4B projections, timed in CUDA graphs (docs/results/h200-fast/matmul-tiles*.log;
# for the accelerator's tiles docs/results/h200-prefill/matmul-tma-sweep*.log and
# docs/results/h200-verify/matmul-sweep*.log): the first row bound that covers M. NARROW
# streams a weight at cuBLAS's speed for 1-16 rows (a decode step, a verify block of one
# request). Past 16 rows (a batch's verify and draft, a prefill chunk) the tiles are loaded
# by the tensor memory accelerator and follow the weight's class (`weight_class`) up to 512
# rows: a wave of 132 SMs fits some tile counts better than others, so the best tiles for
# the MLP's gate and up change four times between 16 and 512 rows. Rows 17-64 take the
# 64-row tiles: the 32-row pointer tiles these rows had before timed slower in the engine
# than 64 rows on the 64-row tiles (the 8B shape's verify of 32 rows: 5.35 ms of matmuls
# against 4.60 ms for 64 rows, docs/results/h200-draft-ahead), and the accelerator loads
# no memory for the rows past M. Past a class's last
# bound (past 512 rows at the latest, batched prefill) every projection takes LARGE. They
# run in 0.96-1.72x cuBLAS's time at 64 rows (the Qwen3.5-4B Gated DeltaNet's input
# projection excepted, which the sweep timed only as slower than its five best, >= 1.08x),
# 0.93-1.35x at 256 rows, 1.04-1.26x at 2048 rows (cuBLAS balances its waves by splitting
# K, which an invariant product may not).
NARROW = Tiles(16, 16, 256, 2, 5)
ROW_TILES = ((16, NARROW),)  # (row bound, tiles), in order
FEW_ROWS_DEEP = Tiles(64, 64, 128, 4, 4, tma=True)
MANY_ROWS = Tiles(64, 128, 64, 4, 4, tma=True)
MANY_ROWS_DEEP = Tiles(64, 128, 128, 4, 4, tma=True)
SQUARE_DEEP = Tiles(128, 128, 128, 8, 3, tma=True)
LARGE = Tiles(128, 128, 64, 4, 3, tma=True)
MANY_ROW_TILES = {  # past 16 rows, by weight class: (row bound, tiles), in order
    "narrow": ((64, FEW_ROWS_DEEP), (96, MANY_ROWS_DEEP), (512, MANY_ROWS)),  # attention
    "deep": ((64, FEW_ROWS_DEEP), (384, MANY_ROWS_DEEP), (512, SQUARE_DEEP)),  # MLP down
    "wide": ((64, MANY_ROWS), (128, LARGE), (192, MANY_ROWS), (256, SQUARE_DEEP)),  # gate, up
    "vocab": ((64, MANY_ROWS_DEEP),),  # an LM head
}
WIDE_N = 16384  # output columns from which a projection counts as wide
VOCAB_N = 65536  # output columns from which a projection counts as an LM head
DEEP_K = 8192  # input columns from which a narrower projection counts as deep
CONFIGURATIONS = (*(t for _, t in ROW_TILES), FEW_ROWS_DEEP, MANY_ROWS, MANY_ROWS_DEEP, SQUARE_DEEP, LARGE)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,  # K a multiple of BLOCK_K: loads need no mask along K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ((k0 + ks) < K) | EVEN_K
        a = tl.load(
            x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            w_ptr + cols[None, :] * stride_wn + (k0 + ks)[:, None],
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit(do_not_specialize=["M"])
def _matmul_tma_kernel(
    x_desc,
    w_desc,
    out_desc,
    bias_ptr,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # the same sums as _matmul_kernel: tiles past M, N or K arrive as zeros
    off_m = tl.program_id(0) * BLOCK_M
    off_n = tl.program_id(1) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = x_desc.load([off_m, k0])
        b = w_desc.load([off_n, k0])
        acc = tl.dot(a, b.T, acc)
    if HAS_BIAS:
        cols = off_n + tl.arange(0, BLOCK_N)
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether 2-D row-major tensors meet the accelerator's rules: 16-byte aligned starts
    and row strides (a tile configuration with `tma` falls back to pointer loads if not)."""
    return all(
        t.dim() == 2
        and t.stride(1) == 1
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * t.element_size()) % 16 == 0
        for t in tensors
    )


@functools.cache
def _sm_count(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def tiles_for(M: int, N: int, K: int, dtype: torch.dtype, sm_count: int) -> Tiles:
    """The tile configuration for M rows of an [N, K] weight (module docstring: no
    configuration changes the bits of any element)."""
    if dtype == torch.float32:
        return Tiles(16, block_n(N, sm_count), 128, 4, 4)
    for bound, tiles in (*ROW_TILES, *MANY_ROW_TILES[weight_class(N, K)]):
        if M <= bound:
            return tiles
    return LARGE


def weight_class(N: int, K: int) -> str:
    """A [N, K] weight's class for the tiles past 16 rows (MANY_ROW_TILES)."""
    if N >= VOCAB_N:
        return "vocab"
    if N >= WIDE_N:
        return "wide"
    return "deep" if K >= DEEP_K else "narrow"


def block_n(n: int, sm_count: int) -> int:
    """Column tile for a weight with n output columns: the widest that still gives every SM a
    program (decode streams the weight once, so idle SMs are lost bandwidth). A function of
    the weight's shape only."""
    for width in (128, 64):
        if triton.cdiv(n, width) >= sm_count:
            return width
    return 32


def matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tiles: Tiles | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias): [..., K] x [N, K] -> [..., N], batch-invariant (module docstring).
    `tiles` overrides the configuration, for tile sweeps and the tests that compare them
    (the configurations past 16 rows are for half precision: in float32 the deepest would
    overflow an SM's shared memory)."""
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"matmul: x has {x.shape[-1]} columns, weight expects {K}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).contiguous()
    w = weight.contiguous()
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"matmul: bias has shape {tuple(bias.shape)}, weight expects ({N},)")
    # the kernels read the bias at column offsets: a strided view is made contiguous first
    b = bias.contiguous() if bias is not None else w
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*lead, N)
    device_index = x.device.index if x.device.type == "cuda" and x.device.index is not None else 0
    t = tiles or tiles_for(M, N, K, x.dtype, _sm_count(device_index))
    grid = (triton.cdiv(M, t.block_m), triton.cdiv(N, t.block_n))
    if t.tma and x.dtype != torch.float32 and tma_ready(x2, w, out):
        _matmul_tma_kernel[grid](
            TensorDescriptor.from_tensor(x2, [t.block_m, t.block_k]),
            TensorDescriptor.from_tensor(w, [t.block_n, t.block_k]),
            TensorDescriptor.from_tensor(out, [t.block_m, t.block_n]),
            b,
            M,
            N,
            K,
            HAS_BIAS=bias is not None,
            BLOCK_M=t.block_m,
            BLOCK_N=t.block_n,
            BLOCK_K=t.block_k,
            num_warps=t.warps,
            num_stages=t.stages,
            **LAUNCH,
        )
        return out.reshape(*lead, N)
    _matmul_kernel[grid](
        x2,
        w,
        b,
        out,
        M,
        N,
        K,
        x2.stride(0),
        w.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        EVEN_K=K % t.block_k == 0,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        num_warps=t.warps,
        num_stages=t.stages,
        **LAUNCH,
    )
    return out.reshape(*lead, N)
