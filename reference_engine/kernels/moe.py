"""A mixture of experts in four kernels that never ask the host anything, so that a step can be
captured in a CUDA graph, with every token's bits independent of the other tokens in the step.

- `route_experts`: per token, the float32 softmax of the router logits, the top k (k rounds
  of an argmax; an exact tie goes to the lower expert id), the optional renormalisation, the
  weights cast to the model dtype, written in ascending expert id order. A program holds a fixed
  number of tokens in a fixed layout, so a token's sums run in one order whatever the token count.
- `experts`: the (token, slot) pairs grouped by expert, then two grouped matrix products over
  the groups and the per-token sum over slots:
  1. the grouping (`group_pairs`): each expert's pair count, the groups' starts, the pairs in
     expert order (stable: a group keeps pair order) and the list of experts the products'
     programs take. Fewer pairs than experts (a decode or a short verify): `_group_kernel`,
     one program, which lists the experts with pairs first, so only as many product programs
     as experts with pairs work. As many or more (a prefill, a wide verify): `_expert_group_kernel`,
     a program per expert, each reading every pair id for its own group's start, size and
     places (one program reading 1024 pairs took about 60 us on the H200, 40 times a prefill
     of 128 tokens on Qwen3.5-35B-A3B); the product grid has a row per expert then anyway,
     and row e takes expert e. Either adds the number of distinct experts to a census when one
     is given (the benchmark's floor counts them).
  2. `_grouped_kernel` with SWIGLU: program (e, column tile) runs over expert e's pairs, 16
     rows at a time, the gate and up products of the same columns side by side, and writes
     silu(gate) * up in group order.
  3. `_grouped_kernel` without: the down product, each row times its routing weight, written
     at the pair's own row.
  4. `_slot_sum_kernel`: each token's k weighted outputs added in slot order, then the
     layer's residual when one is given (the residual connection in the same launch).
  Grids are fixed by the shapes (a product's grid has min(experts, pairs) rows, each taking
  the next expert with pairs from a list the grouping wrote; rows past the last do nothing),
  so one graph per shape replays for any routing.

Bits: every output element of the grouped products sums its K products in ascending order,
16 at a time, into one float32 accumulator, as kernels/matmul.py does, so a pair's row is the
same bits whichever rows share its tile; and the roundings are the references' (each product
rounded to the model dtype, silu rounded before the multiply, the weight's product rounded,
each slot's add rounded), so the result equals the per-expert loop of kernels/reference.py
run through the Triton matmul. Which pairs an expert gets changes only which programs do the
work. The GPU tier checks both claims bitwise (tests/test_kernels_gpu.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import LAUNCH
from .matmul import Tiles  # rows, columns, K per load, warps, stages (no accelerator loads here)

# (tokens a routing program holds, warps): fixed, so a token's reductions run in one order.
# One token and one warp: its reductions stay in the warp's registers (no shared memory), and
# a decode step's one token computes one row, not a tile of 16: 2.7-3.3 us against 4.8-10.1 us
# for 16 tokens and 4 warps on the H200 (docs/results/h200-moe/moe-sweep.log).
ROUTE_LAYOUT = (1, 1)
GROUP_CHUNK = 32  # pairs the one grouping program reads at a time
EXPERT_GROUP_CHUNK = 1024  # pairs each program of the per-expert grouping reads at a time
SUM_BLOCK = 1024


# Chosen by scripts/bench_kernels.py --moe-sweep on the H200 over the Qwen3-30B-A3B and
# Qwen3.5-35B-A3B shapes, replayed from CUDA graphs (docs/results/h200-moe/moe-sweep.log):
# for 2-64 tokens the 64- and 128-column tiles run within 5% of the best pair at each count,
# past that 64-row tiles reuse a weight tile over more pairs. One token (a decode step of
# one request: k pairs) gives too few programs of those to fill the GPU (8 experts x 8
# column tiles of Qwen3.5-35B-A3B's gate and up: 64 programs for 132 SMs); half as many
# columns a program took 20.4 us against 23.8 there, 29.4 against 30.0 on Qwen3-30B-A3B.
ONE_TOKEN_PAIRS = 8
ONE = (Tiles(16, 32, 128, 4, 4), Tiles(16, 64, 128, 4, 4))
FEW_PAIRS = 1024
FEW = (Tiles(16, 64, 128, 4, 3), Tiles(16, 128, 128, 4, 3))
MANY = (Tiles(64, 64, 64, 4, 4), Tiles(64, 64, 64, 4, 4))


def expert_tiles(pairs: int, dtype: torch.dtype) -> tuple[Tiles, Tiles]:
    """The (gate-and-up, down) tiles for a step of `pairs` (token, expert) pairs. No tile
    changes an element's sum (module docstring); float32 loads half the K (shared memory)."""
    tiles = ONE if pairs <= ONE_TOKEN_PAIRS else FEW if pairs <= FEW_PAIRS else MANY
    if dtype == torch.float32:
        return tuple(t._replace(block_k=t.block_k // 4) for t in tiles)
    return tiles


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    T,
    E,
    TOP_K: tl.constexpr,
    RENORMALISE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    x = tl.load(
        logits_ptr + rows[:, None] * E + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0
    ).to(tl.float32)
    x = tl.where(col_ok[None, :], x, float("-inf"))  # rows past T stay finite (never stored)
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    # the top k: k rounds of an argmax over what is not yet chosen (the lowest id of a tie)
    chosen = cols[None, :] < 0
    left = tl.where(col_ok[None, :], p, -1.0)
    for _ in tl.static_range(TOP_K):
        best = tl.argmax(left, axis=1)
        pick = cols[None, :] == best[:, None]
        chosen = chosen | pick
        left = tl.where(pick, -1.0, left)
    w = tl.where(chosen, p, 0.0)
    if RENORMALISE:
        w = w / tl.sum(w, axis=1)[:, None]
    # a chosen expert's slot: how many chosen experts have a lower id
    slot = tl.cumsum(chosen.to(tl.int32), axis=1) - 1
    at = rows[:, None] * TOP_K + slot
    keep = chosen & row_ok[:, None]
    tl.store(ids_ptr + at, (cols[None, :] + 0 * rows[:, None]).to(tl.int64), mask=keep)
    tl.store(weights_ptr + at, w.to(weights_ptr.dtype.element_ty), mask=keep)


def route_experts(
    logits: torch.Tensor, top_k: int, renormalise: bool, layout: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/reference.route_experts's contract: [tokens, experts] router logits ->
    (weights [tokens, k] in the logits' dtype, ids [tokens, k] int64, ascending per token).
    `layout` overrides (tokens a program, warps), for sweeps: a token's bits may differ
    between layouts (its reductions run in another order), never within one."""
    block_t, warps = layout or ROUTE_LAYOUT
    tokens, n = logits.shape
    logits = logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel[(triton.cdiv(tokens, block_t),)](
            logits,
            weights,
            ids,
            tokens,
            n,
            TOP_K=top_k,
            RENORMALISE=renormalise,
            BLOCK_T=block_t,
            BLOCK_E=triton.next_power_of_2(n),
            num_warps=warps,
            **LAUNCH,
        )
    return weights, ids


@triton.jit
def _group_kernel(
    ids_ptr,
    order_ptr,
    starts_ptr,
    active_ptr,
    census_ptr,
    P,
    E,
    CENSUS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, P, CHUNK):
        pairs = p0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < P, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    starts = tl.cumsum(counts, axis=0) - counts
    tl.store(starts_ptr + experts, starts, mask=experts < E)
    tl.store(starts_ptr + E, P)
    # the experts with pairs first, in id order, then the others as -1: a product program
    # takes its expert from this list, so only as many programs as experts with pairs work
    has = (counts > 0).to(tl.int32)
    used = tl.sum(has, axis=0)
    listed = tl.where(has > 0, tl.cumsum(has, axis=0) - 1, used + tl.cumsum(1 - has, axis=0) - 1)
    tl.store(active_ptr + listed, tl.where(has > 0, experts, -1), mask=experts < E)
    # second pass: a pair's place is its group's start plus the pairs of its expert before it
    filled = starts
    for p0 in range(0, P, CHUNK):
        pairs = p0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < P, other=-1).to(tl.int32)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit
        place = tl.sum((filled[None, :] + before) * hit, axis=1)
        tl.store(order_ptr + place, pairs, mask=pairs < P)
        filled += tl.sum(hit, axis=0)
    if CENSUS:
        tl.store(census_ptr, tl.load(census_ptr) + used.to(tl.int64))
        tl.store(census_ptr + 1, tl.load(census_ptr + 1) + 1)


@triton.jit
def _expert_group_kernel(
    ids_ptr,
    order_ptr,
    starts_ptr,
    active_ptr,
    census_ptr,
    P,
    E,
    CENSUS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # program e: its group starts after every pair of a lower expert, and a pair of e goes
    # to that start plus the pairs of e before it (stable, as _group_kernel's)
    e = tl.program_id(0)
    below = 0
    count = 0
    for p0 in range(0, P, CHUNK):
        pairs = p0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < P, other=E).to(tl.int32)  # E: no expert's
        below += tl.sum((ids < e).to(tl.int32), axis=0)
        count += tl.sum((ids == e).to(tl.int32), axis=0)
    tl.store(starts_ptr + e, below)
    if e == 0:
        tl.store(starts_ptr + E, P)
    tl.store(active_ptr + e, tl.where(count > 0, e, -1))  # product row e takes expert e
    filled = below
    for p0 in range(0, P, CHUNK):
        pairs = p0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < P, other=E).to(tl.int32)
        hit = (ids == e).to(tl.int32)
        place = filled + tl.cumsum(hit, axis=0) - hit
        tl.store(order_ptr + place, pairs, mask=hit > 0)
        filled += tl.sum(hit, axis=0)
    if CENSUS:  # integer adds: the same total in any order
        tl.atomic_add(census_ptr, (count > 0).to(tl.int64))
        if e == 0:
            tl.atomic_add(census_ptr + 1, 1)


@triton.jit
def _grouped_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    order_ptr,
    starts_ptr,
    active_ptr,
    scale_ptr,
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_o,
    TOP_K: tl.constexpr,
    SWIGLU: tl.constexpr,  # gate rows [0, N) and up rows [N, 2N): silu(gate) * up, group order
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e = tl.load(active_ptr + tl.program_id(0))
    live = e >= 0  # else fewer experts have pairs than this program's place in the list
    e = tl.maximum(e, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_e = w_ptr + e.to(tl.int64) * stride_we
    start = tl.load(starts_ptr + e)
    end = tl.where(live, tl.load(starts_ptr + e + 1), start)
    out_ty = out_ptr.dtype.element_ty
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)  # places in group order
        row_ok = rows < end
        pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
        src = pair // TOP_K if SWIGLU else rows  # the token's row, or the gated row's place
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks) < K
            a = tl.load(
                a_ptr + src[:, None] * stride_a + (k0 + ks)[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                w_e + cols[None, :] * stride_wn + (k0 + ks)[:, None],
                mask=col_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            if SWIGLU:
                b_up = tl.load(
                    w_e + (N + cols)[None, :] * stride_wn + (k0 + ks)[:, None],
                    mask=col_ok[None, :] & k_ok[:, None],
                    other=0.0,
                )
                if IEEE:
                    acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(a, b_up, acc_up)
        ok = row_ok[:, None] & col_ok[None, :]
        if SWIGLU:  # the references' roundings: each product, then silu, then the product
            g = acc.to(out_ty).to(tl.float32)
            silu = (g * _sigmoid(g)).to(out_ty).to(tl.float32)
            value = (silu * acc_up.to(out_ty).to(tl.float32)).to(out_ty)
            tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], value, mask=ok)
        else:  # the expert's output rounded, times the routing weight, rounded
            weight = tl.load(scale_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
            value = (acc.to(out_ty).to(tl.float32) * weight[:, None]).to(out_ty)
            tl.store(out_ptr + pair[:, None] * stride_o + cols[None, :], value, mask=ok)


@triton.jit
def _slot_sum_kernel(
    x_ptr, res_ptr, out_ptr, H, TOP_K: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    out_ty = out_ptr.dtype.element_ty
    acc = tl.load(x_ptr + token * TOP_K * H + cols, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOP_K):  # each add rounded, as a sum of model-dtype tensors
        acc = (acc + tl.load(x_ptr + (token * TOP_K + j) * H + cols, mask=ok, other=0.0).to(tl.float32)).to(
            out_ty
        )
        acc = acc.to(tl.float32)
    if RESIDUAL:  # residual + sum, rounded, as the model-dtype add of the two tensors
        acc = (tl.load(res_ptr + token * H + cols, mask=ok, other=0.0).to(tl.float32) + acc).to(out_ty)
        acc = acc.to(tl.float32)
    tl.store(out_ptr + token * H + cols, acc.to(out_ty), mask=ok)


def experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    census: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    tiles: tuple[Tiles, Tiles] | None = None,
) -> torch.Tensor:
    """kernels/reference.experts's contract (module docstring: how, and why the bits hold).
    `tiles` overrides the (gate-and-up, down) tiles, for sweeps and the tests that compare
    them."""
    tokens, k = ids.shape
    n_experts, inter, hidden = down.shape[0], down.shape[-1], x.shape[-1]
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if not tokens:
        return out
    if residual is not None:
        residual = residual.reshape(tokens, hidden).contiguous()
    pairs = tokens * k
    x = x.contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()
    groups = group_pairs(ids, n_experts, census)
    swiglu, projection = tiles or expert_tiles(pairs, x.dtype)
    weights = weights.contiguous()
    gated = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # in group order
    _product(x, gate_up, gated, groups, weights, k, True, swiglu)
    weighted = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)  # in pair order
    _product(gated, down, weighted, groups, weights, k, False, projection)
    _slot_sum_kernel[(tokens, triton.cdiv(hidden, SUM_BLOCK))](
        weighted,
        residual if residual is not None else weighted,
        out,
        hidden,
        TOP_K=k,
        RESIDUAL=residual is not None,
        BLOCK=SUM_BLOCK,
        **LAUNCH,
    )
    return out


def group_pairs(
    ids: torch.Tensor, n_experts: int, census: torch.Tensor | None = None, per_expert: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The (token, slot) pairs of `ids` [tokens, k] grouped by expert: (order [pairs] int32,
    the pairs in expert order, a group in pair order; starts [experts + 1] int32, group e
    is order[starts[e]:starts[e + 1]]; active [experts] int32, the expert a product program
    takes, -1 for none; the product grid's rows). Fewer pairs than experts: the experts with
    pairs come first in `active`, in id order, and the grid has a row per pair (at most that
    many experts have pairs); else `active[e]` is e or -1 and a row per expert (module
    docstring). `per_expert` forces one kernel or the other, for the tests that compare them."""
    ids = ids.contiguous()
    pairs = ids.numel()
    order = torch.empty(pairs, dtype=torch.int32, device=ids.device)
    starts = torch.empty(n_experts + 1, dtype=torch.int32, device=ids.device)
    active = torch.empty(n_experts, dtype=torch.int32, device=ids.device)
    counted = census is not None
    if not (pairs >= n_experts if per_expert is None else per_expert):
        _group_kernel[(1,)](
            ids,
            order,
            starts,
            active,
            census if counted else starts,
            pairs,
            n_experts,
            CENSUS=counted,
            CHUNK=GROUP_CHUNK,
            BLOCK_E=triton.next_power_of_2(n_experts),
            **LAUNCH,
        )
        return order, starts, active, pairs
    _expert_group_kernel[(n_experts,)](
        ids,
        order,
        starts,
        active,
        census if counted else starts,
        pairs,
        n_experts,
        CENSUS=counted,
        CHUNK=EXPERT_GROUP_CHUNK,
        **LAUNCH,
    )
    return order, starts, active, n_experts


def _product(
    a: torch.Tensor,  # [rows, K]: the tokens (gate-and-up) or the gated rows in group order (down)
    w: torch.Tensor,  # [experts, N or 2N, K]
    out: torch.Tensor,  # [pairs, N]
    groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],  # order, starts, active, programs
    weights: torch.Tensor,  # [tokens, k] routing weights (read by the down product)
    k: int,
    swiglu: bool,
    tiles: Tiles,
) -> None:
    """One grouped product of `experts`: gate-and-up with the SwiGLU, or down times the
    routing weight."""
    order, starts, active, programs = groups
    n = out.shape[1]
    _grouped_kernel[(programs, triton.cdiv(n, tiles.block_n))](
        a,
        w,
        out,
        order,
        starts,
        active,
        weights,
        n,
        a.shape[1],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        TOP_K=k,
        SWIGLU=swiglu,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
        **LAUNCH,
    )
