"""Gated DeltaNet kernels: the recurrent gated delta rule over T tokens in one launch, its
inputs from the conv output (`gated_delta_inputs`), and the depthwise causal conv (+ SiLU) in
front of it, over the slot's conv state in place (`causal_conv_step`).

The recurrence keeps each (row, value head, value block) state tile [k_dim, BLOCK_V] in
float32 registers and steps the T tokens in order with exactly the per-token arithmetic of a
one-token decode step (kernels/reference.py states the rule). One compiled kernel serves
every T (T, the flags and the row strides are not specialisation keys), so a token's output
and the state after it are the same bits in decode, in a verify block, and in a prefill
chunk of any size: prefill runs this same recurrence, so any prefill chunking gives the same
state. Tokens at t >= valid_len of their row leave the state alone; with `states_out`, the
state after every `every`-th token (the first included) is written out: the checkpoints of
the `per_token` commit, which `gated_delta_resume` runs on from over the verify's recorded
inputs. It is the same kernel, so the state it reaches has the bits of the state the
verify's own run passed through at that token.

The conv sums its `kernel` taps in a fixed order in float32 per output element.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import LAUNCH


class DeltaTiles(NamedTuple):
    """How the recurrence is laid out: value columns a program, warps, and whether the next
    token's inputs load ahead. The value columns and warps decide how a state tile spreads over
    the threads, so they may move a sum's bits: one choice serves every T (decode, verify,
    prefill), which keeps those the same bits. PREFETCH changes no bits."""

    block_v: int
    warps: int
    prefetch: bool


# Chosen by scripts/bench_kernels.py --delta-sweep on the H200 (32 value heads of 128 x 128,
# replayed from CUDA graphs; docs/results/h200-delta-layouts/delta-sweep.log), against the
# layout before (32 columns, 4 warps, no loading ahead): a verify of 16 rows x 8 tokens with
# its checkpoints 51.5 against 67.4 us, 16 x 16 84.7 against 121.8, a 1024-token prefill
# chunk 612 against 1010, decode steps of 1, 16 and 64 rows within 4%.
DELTA_TILES = DeltaTiles(32, 2, True)


@triton.jit(do_not_specialize=["T", "T_rows", "store_states", "store_final", "every", "kept"])
def _gated_delta_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    valid_ptr,
    out_ptr,
    final_ptr,
    states_ptr,
    slots_ptr,
    first_ptr,
    init_ptr,
    init_rows_ptr,
    T,
    T_rows,
    H,
    store_states,
    store_final,  # 0: the final state is not written (a per_token verify's commit writes it)
    every,
    kept,  # all contiguous: q, k [batch, T_rows, H, DK]; v, out [batch, T, H, DV];
    # g, beta [batch, T_rows, H]; state, final [batch, H, DK, DV] (or, with slots, state is
    # every slot's [slots, H, DK, DV] and final is state); states [batch, kept, H, DK, DV],
    # the state after token t at t // every when t % every == 0
    HAS_SLOTS: tl.constexpr,
    RESUME: tl.constexpr,  # row b runs its tokens first[b] .. from init[init_rows[b]], no outputs
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PREFETCH: tl.constexpr,
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
    if HAS_SLOTS:  # this program alone reads, then writes, its row's tile: in place is safe
        row_state = tl.load(slots_ptr + b).to(tl.int64)
    else:
        row_state = b.to(tl.int64)
    head_state = (row_state * H + h) * DK * DV
    if RESUME:
        first = tl.load(first_ptr + b)
        init_row = tl.load(init_rows_ptr + b).to(tl.int64)
        S = tl.load(init_ptr + (init_row * H + h) * DK * DV + tile, mask=tile_ok, other=0.0)
    else:
        first = 0
        S = tl.load(state_ptr + head_state + tile, mask=tile_ok, other=0.0)
    S = S.to(tl.float32)
    valid = tl.load(valid_ptr + b)
    # token (b, first + t) of head h; a resumed row's tokens past its count are read (from its
    # own row: the index stops at its last) but change nothing. With PREFETCH the next
    # token's inputs are loaded before this token's arithmetic, so their latency overlaps it
    # (the arithmetic is the same either way)
    tok = (b * T_rows + tl.minimum(first, T_rows - 1)).to(tl.int64) * H + h
    q = tl.load(q_ptr + tok * DK + ks, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + tok * DK + ks, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + tok * DV + vs, mask=v_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + tok).to(tl.float32)
    beta = tl.load(beta_ptr + tok).to(tl.float32)
    for t in range(0, T):
        if not PREFETCH:
            tok = (b * T_rows + tl.minimum(first + t, T_rows - 1)).to(tl.int64) * H + h
            q = tl.load(q_ptr + tok * DK + ks, mask=k_ok, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + tok * DK + ks, mask=k_ok, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + tok * DV + vs, mask=v_ok, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + tok).to(tl.float32)
            beta = tl.load(beta_ptr + tok).to(tl.float32)
        else:
            nxt = (b * T_rows + tl.minimum(first + t + 1, T_rows - 1)).to(tl.int64) * H + h
            q_next = tl.load(q_ptr + nxt * DK + ks, mask=k_ok, other=0.0).to(tl.float32)
            k_next = tl.load(k_ptr + nxt * DK + ks, mask=k_ok, other=0.0).to(tl.float32)
            v_next = tl.load(v_ptr + nxt * DV + vs, mask=v_ok, other=0.0).to(tl.float32)
            g_next = tl.load(g_ptr + nxt).to(tl.float32)
            beta_next = tl.load(beta_ptr + nxt).to(tl.float32)
        decayed = S * tl.exp(g)
        kv_mem = tl.sum(decayed * k[:, None], axis=0)
        delta = (v - kv_mem) * beta
        updated = decayed + k[:, None] * delta[None, :]
        if not RESUME:
            o = tl.sum(updated * q[:, None], axis=0)
            tl.store(out_ptr + tok * DV + vs, o.to(out_ptr.dtype.element_ty), mask=v_ok)
        S = tl.where(t < valid, updated, S)
        if store_states != 0:
            if t % every == 0:
                at = ((b * kept + t // every).to(tl.int64) * H + h) * DK * DV
                tl.store(states_ptr + at + tile, S, mask=tile_ok)
        if PREFETCH:
            tok, q, k, v, g, beta = nxt, q_next, k_next, v_next, g_next, beta_next
    if store_final != 0:
        tl.store(final_ptr + head_state + tile, S, mask=tile_ok)


def gated_delta(
    q: torch.Tensor,  # [batch, T, v_heads, k_dim] float32
    k: torch.Tensor,  # [batch, T, v_heads, k_dim]
    v: torch.Tensor,  # [batch, T, v_heads, v_dim]
    g: torch.Tensor,  # [batch, T, v_heads]
    beta: torch.Tensor,  # [batch, T, v_heads]
    state: torch.Tensor,  # [batch, v_heads, k_dim, v_dim] float32
    valid_len: torch.Tensor | None = None,  # [batch]
    states_out: torch.Tensor | None = None,  # [batch, ceil(T / every), v_heads, k_dim, v_dim]
    slots: torch.Tensor | None = None,  # [batch]: `state` is every slot's, updated in place
    every: int = 1,
    keep_final: bool = True,  # with slots, False leaves `state` as it was (a per_token verify)
    tiles: DeltaTiles | None = None,  # the engine's DELTA_TILES unless given (sweeps, tests)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as kernels.reference.gated_delta: (outputs [batch, T, v_heads, v_dim],
    final state, or None with `slots`). With `slots` the rows' states are read and written
    in the slot tensor itself: no gather, no scatter after. A `per_token` verify does not
    write them (`keep_final` False): its commit writes every row's state from the checkpoints,
    so the write would be a row's whole state in float32 a layer, for nothing."""
    batch, T, H, DK = q.shape
    DV = v.shape[-1]
    if state.dtype != torch.float32:
        raise ValueError(f"gated_delta: the state is kept in float32, got {state.dtype}")
    if slots is not None and not state.is_contiguous():
        raise ValueError("gated_delta: a slot state tensor updated in place must be contiguous")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    state = state.contiguous()
    out = torch.empty((batch, T, H, DV), dtype=v.dtype, device=v.device)
    final = state if slots is not None else torch.empty_like(state)
    if valid_len is None:
        valid_len = torch.full((batch,), T, dtype=torch.int64, device=q.device)
    if states_out is None:
        every = 1  # the spacing of checkpoints, read with states_out alone (a caller keeping none may pass 0)
    elif every < 1:
        raise ValueError(f"gated_delta: every must be >= 1 with states_out, got {every}")
    if not keep_final and slots is None:
        raise ValueError("gated_delta: keep_final False leaves a slot state alone; give slots")
    kept = -(-T // every)  # states kept: after tokens 0, every, 2 * every, ...
    if states_out is not None:
        if not states_out.is_contiguous():
            raise ValueError("gated_delta: states_out must be contiguous")
        if states_out.shape[:2] != (batch, kept):
            raise ValueError(
                f"gated_delta: states_out holds {tuple(states_out.shape[:2])} states, "
                f"expected ({batch}, {kept})"
            )
    result = (out, None) if slots is not None else (out, final)
    if batch == 0 or T == 0:  # no tokens: every state is as it was (a launch would read token -1)
        if slots is None:
            final.copy_(state)
        return result
    _launch(
        (q, k, v, g, beta),
        state,
        valid_len,
        out,
        final,
        states_out,
        slots,
        None,
        None,
        T,
        T,
        every,
        kept,
        tiles,
        keep_final,
    )
    return result


def gated_delta_resume(
    q: torch.Tensor,  # [batch, T, v_heads, k_dim] float32: a verify's recorded inputs
    k: torch.Tensor,  # [batch, T, v_heads, k_dim]
    v: torch.Tensor,  # [batch, T, v_heads, v_dim]
    g: torch.Tensor,  # [batch, T, v_heads]
    beta: torch.Tensor,  # [batch, T, v_heads]
    init: torch.Tensor,  # [n, v_heads, k_dim, v_dim] float32 states to start from
    init_rows: torch.Tensor,  # [batch] row b starts from init[init_rows[b]]
    first: torch.Tensor,  # [batch] its first token
    count: torch.Tensor,  # [batch] how many of its tokens to run, at most `steps`
    steps: int,
    state: torch.Tensor,  # [slots, v_heads, k_dim, v_dim] float32, contiguous
    slots: torch.Tensor,  # [batch] where each row's final state goes
) -> None:
    """Same contract as kernels.reference.gated_delta_resume, in one launch."""
    batch, T, H, DK = q.shape
    if state.dtype != torch.float32 or init.dtype != torch.float32:
        raise ValueError("gated_delta_resume: the states are kept in float32")
    if not (state.is_contiguous() and init.is_contiguous()):
        raise ValueError("gated_delta_resume: the states must be contiguous")
    if batch == 0:
        return
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    _launch(
        (q, k, v, g, beta), state, count, None, state, None, slots, first, (init, init_rows), steps, T, 1, 0
    )


def delta_input_buffers(
    batch: int, T: int, H: int, k_dim: int, v_dim: int, device, out: tuple[torch.Tensor, ...] | None
) -> tuple[torch.Tensor, ...]:
    """Float32 q, k, v, g, beta for `gated_delta_inputs`: new, or `out` checked."""
    shapes = ((batch, T, H, k_dim), (batch, T, H, k_dim), (batch, T, H, v_dim), (batch, T, H), (batch, T, H))
    if out is None:
        return tuple(torch.empty(shape, dtype=torch.float32, device=device) for shape in shapes)
    for name, x, shape in zip(("q", "k", "v", "g", "beta"), out, shapes):
        if x.shape != shape or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"gated_delta_inputs: out {name} must be contiguous float32 {shape}")
    return tuple(out)


def _launch(
    inputs,
    state,
    valid_len,
    out,
    final,
    states_out,
    slots,
    first,
    init,
    T,
    T_rows,
    every,
    kept,
    tiles=None,
    keep_final=True,
) -> None:
    q, k, v, g, beta = inputs
    batch, _, H, DK = q.shape
    DV = v.shape[-1]
    resume = init is not None
    init_states, init_rows = init if resume else (state, valid_len)
    tiles = tiles or DELTA_TILES
    _gated_delta_kernel[(batch, H, triton.cdiv(DV, tiles.block_v))](
        q,
        k,
        v,
        g,
        beta,
        state,
        valid_len.contiguous(),
        out if out is not None else final,
        final,
        states_out if states_out is not None else final,
        slots.contiguous() if slots is not None else valid_len,
        first.contiguous() if resume else valid_len,
        init_states,
        init_rows.contiguous(),
        T,
        T_rows,
        H,
        int(states_out is not None),
        int(keep_final),
        every,
        kept,
        HAS_SLOTS=slots is not None,
        RESUME=resume,
        DK=DK,
        DV=DV,
        BLOCK_K=max(16, triton.next_power_of_2(DK)),
        BLOCK_V=tiles.block_v,
        PREFETCH=tiles.prefetch,
        num_warps=tiles.warps,
        **LAUNCH,
    )


@triton.jit(do_not_specialize=["T", "s_mb", "s_mc", "s_mt", "s_ab", "s_at", "s_bb", "s_bt"])
def _inputs_kernel(
    mixed_ptr,
    a_ptr,
    b_ptr,
    alog_ptr,
    dt_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    T,
    H,
    ratio,
    scale,
    eps,
    s_mb,
    s_mc,
    s_mt,
    s_ab,
    s_at,
    s_bb,
    s_bt,
    KEY_DIM: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)  # b * T + t
    h = tl.program_id(1)  # value head
    bi = row // T
    t = row % T
    kh = h // ratio
    ks = tl.arange(0, BLOCK_K)
    vs = tl.arange(0, BLOCK_V)
    k_ok = ks < DK
    v_ok = vs < DV
    base = mixed_ptr + bi * s_mb + t * s_mt  # channel c of token t at base + c * s_mc
    q = tl.load(base + (kh * DK + ks) * s_mc, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(base + (KEY_DIM + kh * DK + ks) * s_mc, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(base + (2 * KEY_DIM + h * DV + vs) * s_mc, mask=v_ok, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    out = row.to(tl.int64) * H + h
    tl.store(q_ptr + out * DK + ks, q, mask=k_ok)
    tl.store(k_ptr + out * DK + ks, k, mask=k_ok)
    tl.store(v_ptr + out * DV + vs, v, mask=v_ok)
    a = tl.load(a_ptr + bi * s_ab + t * s_at + h).to(tl.float32) + tl.load(dt_ptr + h).to(tl.float32)
    # F.softplus: log1p(e^a), to float32 precision where e^a is small (1 + e^a rounds it off:
    # log(u) * y / (u - 1) is log1p(y) whichever way u rounded), a past its threshold of 20
    y = tl.exp(a)
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
    softplus = tl.where(a > 20.0, a, log1p)
    tl.store(g_ptr + out, -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus)
    x = tl.load(b_ptr + bi * s_bb + t * s_bt + h)
    sig = 1.0 / (1.0 + tl.exp(-x.to(tl.float32)))
    tl.store(beta_ptr + out, sig.to(x.dtype).to(tl.float32))  # sigmoid rounds to b's dtype first


def gated_delta_inputs(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    k_heads: int,
    k_dim: int,
    v_dim: int,
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as kernels.reference.gated_delta_inputs, in one launch (one program per
    token and value head). a and b may be column views of a fused projection."""
    batch, C, T = mixed.shape
    H = A_log.shape[0]
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("gated_delta_inputs: a's and b's heads must be contiguous")
    q, k, v, g, beta = delta_input_buffers(batch, T, H, k_dim, v_dim, mixed.device, out)
    if batch * T:
        _inputs_kernel[(batch * T, H)](
            mixed,
            a,
            b,
            A_log,
            dt_bias,
            q,
            k,
            v,
            g,
            beta,
            T,
            H,
            H // k_heads,
            k_dim**-0.5,
            1e-6,
            mixed.stride(0),
            mixed.stride(1),
            mixed.stride(2),
            a.stride(0),
            a.stride(1),
            b.stride(0),
            b.stride(1),
            KEY_DIM=k_heads * k_dim,
            DK=k_dim,
            DV=v_dim,
            BLOCK_K=triton.next_power_of_2(k_dim),
            BLOCK_V=triton.next_power_of_2(v_dim),
            **LAUNCH,
        )
    return q, k, v, g, beta


@triton.jit(do_not_specialize=["T", "s_xb", "s_xt", "s_ob", "s_ot", "s_rs", "s_rc"])
def _conv_step_kernel(
    x_ptr,
    state_ptr,
    slots_ptr,
    valid_ptr,
    w_ptr,
    out_ptr,
    record_ptr,
    C,
    T,
    s_xb,
    s_xt,
    s_ob,
    s_ot,
    s_rs,
    s_rc,
    KERNEL: tl.constexpr,
    RECORD: tl.constexpr,  # record[slot, c, :W + T] = the old state then the inputs
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """One program per (row, channel block), over all T tokens: it alone reads the channels'
    old slot state and then writes the new one, so the update is in place without a race."""
    b = tl.program_id(0)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cs < C
    W = KERNEL - 1  # inputs kept per channel
    slot = tl.load(slots_ptr + b).to(tl.int64)
    state = state_ptr + (slot * C + cs)[:, None] * W  # [BLOCK_C, 1] row starts
    x_row = x_ptr + b * s_xb + cs[:, None]
    out_ty = out_ptr.dtype.element_ty
    if RECORD:  # a verify keeps its conv input for the commit: the old state, then x below
        rec = record_ptr + slot * s_rs + cs[:, None] * s_rc
        w_i = tl.arange(0, BLOCK_W)
        old_ok = c_ok[:, None] & (w_i[None, :] < W)
        tl.store(rec + w_i[None, :], tl.load(state + w_i[None, :], mask=old_ok, other=0.0), mask=old_ok)
    # the new state: full[valid + i] for i < W, full = old state (W inputs) then x (T inputs);
    # loaded before any store, then stored after every read of the old state
    for t0 in range(0, T, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        ok = c_ok[:, None] & (ts[None, :] < T)
        acc = tl.zeros((BLOCK_C, BLOCK_T), tl.float32)
        for j in tl.static_range(KERNEL):
            m = ts[None, :] + j  # index into full
            from_state = m < W
            old = tl.load(state + m, mask=ok & from_state, other=0.0)
            new = tl.load(x_row + (m - W) * s_xt, mask=ok & (m >= W), other=0.0)
            xv = tl.where(from_state, old, new).to(tl.float32)
            w = tl.load(w_ptr + cs * KERNEL + j, mask=c_ok, other=0.0).to(tl.float32)
            acc += w[:, None] * xv
        if RECORD:
            x_t = tl.load(x_row + ts[None, :] * s_xt, mask=ok, other=0.0)
            tl.store(rec + W + ts[None, :], x_t, mask=ok)
        y = acc.to(out_ty).to(tl.float32)  # conv1d's output in the model dtype, then SiLU
        y = y / (1.0 + tl.exp(-y))
        tl.store(out_ptr + b * s_ob + cs[:, None] + ts[None, :] * s_ot, y.to(out_ty), mask=ok)
    valid = tl.load(valid_ptr + b)
    i = tl.arange(0, BLOCK_W)
    m = valid + i[None, :]
    keep_ok = c_ok[:, None] & (i[None, :] < W)
    from_state = m < W
    old = tl.load(state + m, mask=keep_ok & from_state, other=0.0)
    new = tl.load(x_row + (m - W) * s_xt, mask=keep_ok & (m >= W), other=0.0)
    tl.store(state + i[None, :], tl.where(from_state, old, new), mask=keep_ok)


def causal_conv_step(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    valid_len: torch.Tensor | None = None,
    record: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as kernels.reference.causal_conv_step, in one launch: the slot states
    are read and written in place (no gather, no concatenation, no scatter), and `record`
    written in the same pass. x may be a
    column view of a fused projection (channels contiguous). Each output sums its `kernel`
    taps in order in float32, so a token's output is the same bits whichever runs it."""
    batch, T, C = x.shape
    kernel = weight.shape[-1]
    if x.stride(-1) != 1 or not conv_state.is_contiguous():
        raise ValueError("causal_conv_step: x's channels and the conv state must be contiguous")
    if record is not None and (
        record.dtype != x.dtype
        or record.shape[1] != C
        or record.shape[2] < kernel - 1 + T
        or record.stride(2) != 1
    ):
        raise ValueError(
            f"causal_conv_step: record must be {x.dtype} [slots, {C}, >= {kernel - 1 + T}] with its "
            f"last axis contiguous, got {record.dtype} {tuple(record.shape)}"
        )
    # [batch, C, T] as the contract says, laid out token-major for the next kernel's reads
    out = torch.empty((batch, T, C), dtype=x.dtype, device=x.device).transpose(1, 2)
    if batch == 0 or T == 0:
        return out
    if valid_len is None:
        valid_len = torch.full((batch,), T, dtype=torch.int64, device=x.device)
    block_c = 64
    _conv_step_kernel[(batch, triton.cdiv(C, block_c))](
        x,
        conv_state,
        slots.contiguous(),
        valid_len.contiguous(),
        weight.reshape(C, kernel).contiguous(),
        out,
        record if record is not None else out,
        C,
        T,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(2),
        record.stride(0) if record is not None else 0,
        record.stride(1) if record is not None else 0,
        KERNEL=kernel,
        RECORD=record is not None,
        BLOCK_C=block_c,
        BLOCK_T=16,
        BLOCK_W=triton.next_power_of_2(max(kernel - 1, 1)),
        **LAUNCH,
    )
    return out
