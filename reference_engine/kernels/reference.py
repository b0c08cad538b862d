"""The plain-PyTorch implementation of every kernel: the reference the Triton kernels are
tested against, the CPU path, and what a float64 model runs on CUDA (the `fast` numerics take
`linear` and `greedy` from here, cuBLAS and PyTorch's argmax).

Precision policy: half-precision inputs accumulate norms, softmax and recurrent state in
float32; float32 and float64 stay in their own dtype (never downcast). Everything here is
differentiable (the demo-pair training runs through it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reductions run in: float32 for half types, else the dtype itself."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): [..., K] x [N, K] -> [..., N].

    On the CPU the product is taken as (weight @ x^T)^T: MKL's GEMM with the weight as the
    transposed right operand takes up to twice as long when x has few rows (a decode step,
    a verify block: 85 against 50 us for 8 x 256 @ 256 x 768 on a 2-core EPYC), and the
    transposed result is small."""
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).T  # [K, M]
    out = torch.mm(weight, rows) if bias is None else torch.addmm(bias[:, None], weight, rows)
    return out.T.reshape(*x.shape[:-1], weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w, or * (1 + w) when `offset` (Qwen3.5), over the last axis
    (F.rms_norm runs these very operations in one call)."""
    acc = accumulation_dtype(x.dtype)
    if offset:
        return F.rms_norm(x.to(acc), x.shape[-1:], 1.0 + weight.to(acc), eps).to(x.dtype)
    return weight * F.rms_norm(x.to(acc), x.shape[-1:], None, eps).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): a decoder layer's residual add and the norm
    that reads its result, in one pass."""
    summed = x + residual
    return rms_norm(summed, weight, eps, offset), summed


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (no offset) times silu(z): the Gated DeltaNet output norm, over the last axis.
    x is first rounded to z's dtype (the recurrence's float32 output to the model's), and the
    result is in z's dtype."""
    x = x.to(z.dtype)
    acc = accumulation_dtype(x.dtype)
    xf = x.to(acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return (out * F.silu(z.to(acc))).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last axis, in x's dtype."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU product silu(gate) * up."""
    return F.silu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half layout, over the first rotary_dim dims of each head (the rest pass
    through). x: [batch, T, heads, head_dim]; cos, sin: [batch, T, 1, rotary_dim] in x's
    dtype, so every product and sum rounds to it."""
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def attention_inputs(
    q: torch.Tensor | None,  # [batch, T, heads, head_dim] or None (keys and values only)
    k: torch.Tensor,  # [batch, T, kv_heads, head_dim]
    v: torch.Tensor,  # [batch, T, kv_heads, head_dim]
    q_weight: torch.Tensor | None,  # q_norm's weight [head_dim]
    k_weight: torch.Tensor | None,  # k_norm's weight [head_dim]; None: no per-head norms
    eps: float,
    offset: bool,  # norms multiply by (1 + w) (Qwen3.5)
    cos: torch.Tensor,  # [batch, T, 1, rotary_dim]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [slots, max_len, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [batch]
    positions: torch.Tensor,  # [batch, T]
) -> torch.Tensor | None:
    """What attention needs before it runs: queries and keys normed per head (q_norm,
    k_norm; neither when k_weight is None, as in Llama) and rotated (RoPE); keys and values
    written into the cache at their positions. Returns the queries (None when q is None: the
    DFlash draft's context rows)."""
    rows = slots[:, None]
    normed = k_weight is not None
    k_cache[rows, positions] = rotate(rms_norm(k, k_weight, eps, offset) if normed else k, cos, sin)
    v_cache[rows, positions] = v
    if q is None:
        return None
    return rotate(rms_norm(q, q_weight, eps, offset) if normed else q, cos, sin)


def causal_conv(full: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv1d then SiLU. full: [batch, channels, kernel-1+T] (the previous
    kernel-1 inputs, then T new ones); weight: [channels, 1, kernel]. Returns [batch, channels, T].

    The taps are summed in order in the accumulation dtype, then rounded to the input's (as
    the Triton kernel does): a few multiply-adds over the new tokens, which on the CPU cost a
    fraction of a library conv's set-up."""
    acc = accumulation_dtype(full.dtype)
    kernel = weight.shape[-1]
    T = full.shape[-1] - kernel + 1
    x, w = full.to(acc), weight[:, 0].to(acc)  # w: [channels, kernel]
    out = x[..., :T] * w[:, :1]
    for j in range(1, kernel):
        out = out.addcmul_(x[..., j : j + T], w[:, j : j + 1])
    return F.silu(out.to(full.dtype))


def conv_state_after(full: torch.Tensor, kernel: int, processed: torch.Tensor | None) -> torch.Tensor:
    """The conv state (last kernel-1 inputs) after `processed` tokens of each row.

    full: [batch, conv_dim, kernel-1+T], the previous conv state followed by T new inputs;
    processed: [batch] or None (all T). Returns [batch, conv_dim, kernel-1].
    """
    width = kernel - 1
    if processed is None:
        return full[..., full.shape[-1] - width :]
    offsets = processed[:, None, None] + torch.arange(width, device=full.device)
    return full.gather(-1, offsets.expand(-1, full.shape[1], -1))


def causal_conv_step(
    x: torch.Tensor,  # [batch, T, channels] new inputs (channels contiguous)
    conv_state: torch.Tensor,  # [slots, channels, kernel-1] every slot's last inputs
    slots: torch.Tensor,  # [batch]
    weight: torch.Tensor,  # [channels, 1, kernel]
    valid_len: torch.Tensor | None = None,  # [batch] real tokens per row, None: all T
    record: torch.Tensor | None = None,  # [slots, channels, >= kernel-1+T]
) -> torch.Tensor:
    """`causal_conv` over each row's slot state followed by x, the slot state moved on in
    place to the last kernel-1 inputs up to the row's valid length. Returns [batch, channels,
    T] (SiLU applied). With `record`, record[slots[i], :, :kernel-1+T] is set to row i's
    conv input (its old slot state, then x): what a verify keeps for the commit."""
    full = torch.cat([conv_state.index_select(0, slots), x.transpose(1, 2)], -1)
    if record is not None:
        record[slots, :, : full.shape[-1]] = full
    conv_state.index_copy_(0, slots, conv_state_after(full, weight.shape[-1], valid_len))
    return causal_conv(full, weight)


def copy_rows(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for every i, in place (the commit's kept states)."""
    dst.index_copy_(0, dst_rows, src.index_select(0, src_rows))


def conv_state_at(
    conv: torch.Tensor, slots: torch.Tensor, recorded: torch.Tensor, processed: torch.Tensor
) -> None:
    """conv [slots, channels, kernel-1]: each row's slot state set, in place, to the kernel-1
    inputs of its recorded conv input [slots, channels, kernel-1+T] (the state before a block
    followed by the block's inputs) after `processed` [rows] tokens of the block."""
    full = recorded.index_select(0, slots)
    conv.index_copy_(0, slots, conv_state_after(full, conv.shape[-1] + 1, processed))


def attention(
    q: torch.Tensor,  # [batch, T, heads, head_dim], already rotated
    k_cache: torch.Tensor,  # [slots, max_len, kv_heads, head_dim], this step's keys written
    v_cache: torch.Tensor,  # [slots, max_len, kv_heads, head_dim]
    slots: torch.Tensor,  # [batch]
    positions: torch.Tensor,  # [batch, T]
    kv_len: int,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    valid_len: torch.Tensor | None = None,  # [batch] real tokens per row (rest: padding)
) -> torch.Tensor:
    """Softmax attention of each query over its slot's cache rows.

    A query at position p sees key rows 0..p (causal) or, non-causal (the DFlash draft's
    block), every row up to the last real token of its row; a sliding window also hides rows
    w or more positions away. Returns [batch, T, heads, head_dim].
    """
    if q.shape[1] == 0:  # a step with no queries (the masks below read a first position)
        return torch.empty_like(q)
    keys = k_cache[:, :kv_len].index_select(0, slots)  # [batch, kv_len, kv_heads, head_dim]
    values = v_cache[:, :kv_len].index_select(0, slots)
    key_pos = torch.arange(kv_len, device=q.device)[None, None, :]
    query_pos = positions[:, :, None]
    if causal:
        visible_to = query_pos
    elif valid_len is None:
        visible_to = positions[:, -1:, None]
    else:
        visible_to = (positions[:, 0] + valid_len - 1)[:, None, None]
    allowed = key_pos <= visible_to  # [batch, T or 1 (non-causal), kv_len]
    # the rows past every query's last key read as 0: their weights are 0, and what an earlier
    # request of the slot left there (NaN from one that failed included) must reach no score
    # or product (a masked NaN score, or a weight of 0 times NaN, is NaN)
    past = (key_pos[0] > visible_to.amax(1))[:, :, None, None]  # [batch, kv_len, 1, 1]
    keys.masked_fill_(past, 0)
    values.masked_fill_(past, 0)
    if sliding_window is not None:  # not in place: a non-causal limit broadcasts over T
        allowed = allowed & (query_pos - key_pos < sliding_window) & (key_pos - query_pos < sliding_window)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=allowed[:, None],
        scale=scale,
        enable_gqa=q.shape[2] != keys.shape[2],
    )
    return out.transpose(1, 2)


def gated_delta_inputs(
    mixed: torch.Tensor,  # [batch, conv_dim, T] the conv's output: q, k, v channels in turn
    a: torch.Tensor,  # [batch, T, v_heads] decay input (the model dtype)
    b: torch.Tensor,  # [batch, T, v_heads] write-strength input
    A_log: torch.Tensor,  # [v_heads]
    dt_bias: torch.Tensor,  # [v_heads]
    k_heads: int,
    k_dim: int,
    v_dim: int,
    out: tuple[torch.Tensor, ...] | None = None,  # q, k, v, g, beta written here when given
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated delta rule's inputs from a Gated DeltaNet layer's conv output: q and k
    L2-normalised per key head (q also scaled by k_dim^-0.5) and repeated for the value heads
    that share them (2i and 2i+1 share key head i for a ratio of 2), v per value head, the
    log decay g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b); all in the
    accumulation dtype. Returns (q, k [batch, T, v_heads, k_dim], v [batch, T, v_heads,
    v_dim], g, beta [batch, T, v_heads])."""
    batch, _, T = mixed.shape
    v_heads = A_log.shape[0]
    acc = accumulation_dtype(mixed.dtype)
    key_dim = k_heads * k_dim
    q, k, v = mixed.transpose(1, 2).split([key_dim, key_dim, v_heads * v_dim], -1)
    q = l2_norm(q.reshape(batch, T, k_heads, k_dim).to(acc))
    k = l2_norm(k.reshape(batch, T, k_heads, k_dim).to(acc))
    v = v.reshape(batch, T, v_heads, v_dim).to(acc)
    ratio = v_heads // k_heads
    q = q.repeat_interleave(ratio, dim=2) * k_dim**-0.5
    k = k.repeat_interleave(ratio, dim=2)
    beta = torch.sigmoid(b).to(acc)
    g = -A_log.to(acc).exp() * F.softplus(a.to(acc) + dt_bias.to(acc))
    if out is None:
        return q, k, v, g, beta
    for into, x in zip(out, (q, k, v, g, beta)):
        into.copy_(x)
    return tuple(out)


def gated_delta(
    q: torch.Tensor,  # [batch, T, v_heads, k_dim], normalised and scaled, state dtype
    k: torch.Tensor,  # [batch, T, v_heads, k_dim], normalised, state dtype
    v: torch.Tensor,  # [batch, T, v_heads, v_dim], state dtype
    g: torch.Tensor,  # [batch, T, v_heads] log decay (<= 0)
    beta: torch.Tensor,  # [batch, T, v_heads] write strength in (0, 1)
    state: torch.Tensor,  # [batch, v_heads, k_dim, v_dim]
    valid_len: torch.Tensor | None = None,  # [batch]: rows stop updating after this many
    states_out: torch.Tensor | None = None,  # [batch, ceil(T / every), v_heads, k_dim, v_dim]
    slots: torch.Tensor | None = None,  # [batch]: `state` holds every slot's, updated in place
    every: int = 1,
    keep_final: bool = True,
    written_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule as the engine runs it off the Triton path (the CPU and float64
    models): a decode step (T = 1) takes one step of the recurrence, a verify block or a
    prefill chunk the chunked form, so no Python loop runs over tokens. The contract is
    `gated_delta_recurrent`'s, except outputs at padded tokens (t >= valid_len), which
    nothing reads, and `slots`: with it, `state` is every slot's state [slots, v_heads,
    k_dim, v_dim], row i starts from state[slots[i]] and its final state is written back
    there (unless `keep_final` is False: a `per_token` verify, whose commit writes each row's
    state from what the verify kept, leaves `state` as it was); the second result is then
    None. `written_out` ([batch, v_heads, T, v_dim]): a `per_token` verify that keeps no
    state (state.NO_CHECKPOINTS) keeps the row each token writes instead, from which
    `gated_delta_after` makes the state after any token of the block."""
    if states_out is not None and every < 1:
        raise ValueError(f"gated_delta: every must be >= 1 with states_out, got {every}")
    if q.shape[1] == 0:  # no tokens: every state is as it was
        out = v.new_empty(v.shape)
        return (out, None) if slots is not None else (out, state.clone())
    if slots is not None:
        start = state.index_select(0, slots)
        if written_out is not None:  # nothing carried: the commit makes the state it needs
            out, _ = gated_delta_chunked(q, k, v, g, beta, start, valid_len, written_out=written_out)
            return out, None
        out, final = gated_delta(q, k, v, g, beta, start, valid_len, states_out, every=every)
        if keep_final:
            state.index_copy_(0, slots, final)
        return out, None
    if q.shape[1] == 1:
        return gated_delta_recurrent(q, k, v, g, beta, state, valid_len, states_out, every)
    if states_out is None or every == 1:
        return gated_delta_chunked(q, k, v, g, beta, state, valid_len, states_out)
    every_state = states_out.new_empty((q.shape[0], q.shape[1], *states_out.shape[2:]))
    out, final = gated_delta_chunked(q, k, v, g, beta, state, valid_len, every_state)
    states_out.copy_(every_state[:, ::every])
    return out, final


def gated_delta_resume(
    q: torch.Tensor,  # [batch, T, v_heads, k_dim]: a verify's recorded inputs
    k: torch.Tensor,  # [batch, T, v_heads, k_dim]
    v: torch.Tensor,  # [batch, T, v_heads, v_dim]
    g: torch.Tensor,  # [batch, T, v_heads]
    beta: torch.Tensor,  # [batch, T, v_heads]
    init: torch.Tensor,  # [n, v_heads, k_dim, v_dim] states to start from
    init_rows: torch.Tensor,  # [batch] row b starts from init[init_rows[b]]
    first: torch.Tensor,  # [batch] its first token
    count: torch.Tensor,  # [batch] how many of its tokens to run, at most `steps`
    steps: int,  # a host bound on count (no value is read back)
    state: torch.Tensor,  # [slots, v_heads, k_dim, v_dim]
    slots: torch.Tensor,  # [batch] where each row's final state goes
) -> None:
    """Run each row on from a kept state: from init[init_rows[b]], over its tokens first[b] ..
    first[b] + count[b] - 1 of the inputs, the state after them written into state[slots[b]]
    in place; no outputs. The `per_token` commit: from the checkpoint at or before a row's
    accepted boundary (the verify kept the state after every `every`-th token) up to it."""
    start = init.index_select(0, init_rows)
    if steps > 0:
        at = (first[:, None] + torch.arange(steps, device=q.device)).clamp(max=q.shape[1] - 1)
        rows = torch.arange(q.shape[0], device=q.device)[:, None]
        taken = [x[rows, at] for x in (q, k, v, g, beta)]
        _, start = gated_delta(*taken, start, valid_len=count)
    state.index_copy_(0, slots, start)


def gated_delta_recurrent(
    q: torch.Tensor,  # [batch, T, v_heads, k_dim], normalised and scaled, state dtype
    k: torch.Tensor,  # [batch, T, v_heads, k_dim], normalised, state dtype
    v: torch.Tensor,  # [batch, T, v_heads, v_dim], state dtype
    g: torch.Tensor,  # [batch, T, v_heads] log decay (<= 0)
    beta: torch.Tensor,  # [batch, T, v_heads] write strength in (0, 1)
    state: torch.Tensor,  # [batch, v_heads, k_dim, v_dim]
    valid_len: torch.Tensor | None = None,  # [batch]: rows stop updating after this many
    states_out: torch.Tensor | None = None,  # [batch, ceil(T / every), v_heads, k_dim, v_dim]
    every: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one token at a time, per value head:

        S <- S * exp(g_t);  delta = (v_t - S^T k_t) * beta_t;  S <- S + k_t (x) delta;  o_t = S^T q_t

    Returns (outputs [batch, T, v_heads, v_dim], final state). Tokens at t >= valid_len of
    their row leave the state unchanged (padding in a batch of unequal rows). When
    `states_out` is given, the state after token t is written into states_out[:, t // every]
    for every t that `every` divides (every = 1: after every token): the `per_token` commit's
    checkpoints.

    The readable definition, which the Triton kernel follows step for step and the chunked
    form is tested against; the engine calls it for one-token decode steps only.
    """
    outputs = []
    for t in range(q.shape[1]):
        decayed = state * g[:, t, :, None, None].exp()
        kv_mem = (k[:, t, :, None, :] @ decayed)[:, :, 0]  # S^T k_t: [batch, v_heads, v_dim]
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        updated = torch.addcmul(decayed, k[:, t, :, :, None], delta[:, :, None, :])  # + k (x) delta
        outputs.append((q[:, t, :, None, :] @ updated)[:, :, 0])
        if valid_len is None:
            state = updated
        else:
            state = torch.where((t < valid_len)[:, None, None, None], updated, state)
        if states_out is not None and t % every == 0:
            states_out[:, t // every] = state
    return torch.stack(outputs, dim=1), state


def gated_delta_chunked(
    q: torch.Tensor,  # [batch, T, v_heads, k_dim], normalised and scaled
    k: torch.Tensor,  # [batch, T, v_heads, k_dim], normalised
    v: torch.Tensor,  # [batch, T, v_heads, v_dim]
    g: torch.Tensor,  # [batch, T, v_heads] log decay (<= 0)
    beta: torch.Tensor,  # [batch, T, v_heads]
    state: torch.Tensor,  # [batch, v_heads, k_dim, v_dim]
    valid_len: torch.Tensor | None = None,  # [batch]: rows stop updating after this many
    states_out: torch.Tensor | None = None,  # [batch, T, v_heads, k_dim, v_dim] or None
    chunk: int = 64,
    written_out: torch.Tensor | None = None,  # [batch, v_heads, T, v_dim] the rows written
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule of `gated_delta_recurrent`, a chunk of tokens at a time, with
    matrix products in place of the loop over tokens: the engine's verify blocks and prefill
    chunks, and training (differentiable, fast on long rows).

    Inside a chunk, with S0 the state before it, G_t the cumulative log decay and u_t the
    row written at token t (S_t = e^{G_t} S0 + sum_{s<=t} e^{G_t-G_s} k_s u_s^T):

        u_t = beta_t (v_t - e^{G_t} S0^T k_t) - beta_t sum_{s<t} e^{G_t-G_s} (k_t.k_s) u_s

    i.e. (I + L) U = beta (V - e^G K S0), with L strictly lower triangular: one triangular
    solve per chunk. Then O = e^G Q S0 + (Q K^T * D) U with D_ts = e^{G_t-G_s} for s <= t,
    and the next state is e^{G_C} S0 + (K * e^{G_C-G})^T U.

    A padded token (t >= valid_len) gets beta = 0 and g = 0: it writes nothing (u = 0) and
    decays nothing, so every state from there on equals the row's last real one; its output
    is that state read by its query (the recurrence's differs: nothing reads either).
    With `states_out`, each chunk computes its per-token states, D (k (x) u) + e^G S0 in
    one product, and carries on the one after each row's last real token; with `valid_len`
    alone, it computes that one state only (`_state_after`, the same arithmetic for one
    token: the same bits). Either way the final state is states_out[valid_len - 1] bit for
    bit, and a rerun over fewer tokens of the same block (the `recompute` commit) reaches
    the very bits that the `per_token` commit picks from a verify's states. Without either
    (prefill, training), the cheaper chunk-end update carries the state.

    `written_out` (a block of one chunk): the row u_t each token writes is kept there and no
    state is carried (the result's final state is None). The state after any token t is
    then e^{G_t} S0 + sum_{s<=t} e^{G_t-G_s} k_s u_s^T: `gated_delta_after`, bit for bit
    the state a rerun over tokens 0..t carries (the same operations on the same shapes).
    """
    batch, T, heads, _ = q.shape
    chunk = min(chunk, T)
    if written_out is not None and T > chunk:
        raise ValueError(f"the rows written are kept for a block of one chunk ({chunk} tokens), not {T}")
    q, k, v, g, beta = _chunked_inputs(q, k, v, g, beta, valid_len, chunk)
    n = q.shape[2]
    G, gap, causal = _decays(g)
    strict = gap.masked_fill(causal.diagonal().diag_embed(), 0.0)  # s < t only
    L = beta[..., None] * (k @ k.transpose(-1, -2)) * strict
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    qk = (q @ k.transpose(-1, -2)) * gap
    per_token = states_out is not None or valid_len is not None
    ends = torch.full((batch,), T, device=q.device) if valid_len is None else valid_len
    rows = torch.arange(batch, device=q.device)
    outputs = []
    for c in range(n):
        decay = G[:, :, c].exp()[..., None]  # [batch, heads, C, 1]
        rhs = beta[:, :, c, :, None] * (v[:, :, c] - decay * (k[:, :, c] @ state))
        u = torch.linalg.solve_triangular(eye + L[:, :, c], rhs, upper=False, unitriangular=True)
        # one layout for every product that reads u (the solve's is column-major): a product's
        # bits may depend on it, and the rows a verify keeps (`written_out`) are read back so
        u = u.contiguous()
        outputs.append(decay * (q[:, :, c] @ state) + qk[:, :, c] @ u)
        if written_out is not None:  # one chunk: nothing to carry
            written_out.copy_(u)
            state = None
        elif per_token:
            begin = c * chunk
            end = min(begin + chunk, T)
            # carried on: the state after each row's last real token in this chunk (the
            # chunk's first when the row ended before it: that state has not moved since)
            last = (ends - 1 - begin).clamp(0, chunk - 1)
            if states_out is None:
                state = _state_after(state, k[:, :, c], u, gap[rows, :, c, last], decay[rows, :, last])
                continue
            into = states_out[:, begin:end]
            if end - begin < chunk or not into.is_contiguous():
                into = None  # then computed aside and copied in
            states = _states_in_chunk(state, k[:, :, c], u, gap[:, :, c], decay, into)
            if into is None:
                states_out[:, begin:end] = states[:, : end - begin]
            state = states.flatten(0, 1).index_select(0, rows * chunk + last)
        else:
            last = G[:, :, c, -1:]  # [batch, heads, 1]
            carried = k[:, :, c] * (last - G[:, :, c]).exp()[..., None]
            state = last.exp()[..., None] * state + carried.transpose(-1, -2) @ u
    out = torch.stack(outputs, 2)  # [batch, heads, n, C, v_dim]
    out = out.movedim(1, 3).reshape(batch, n * chunk, heads, out.shape[-1])  # no -1: batch may be 0
    return out[:, :T], state


def _chunked_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    valid_len: torch.Tensor | None,
    chunk: int,
) -> tuple[torch.Tensor, ...]:
    """The chunked form's inputs: padded tokens (t >= valid_len) given beta = 0 and g = 0,
    the block padded to whole chunks, each input laid out [batch, heads, n, C, ...]."""
    batch, T, heads, _ = q.shape
    if valid_len is not None:
        real = (torch.arange(T, device=q.device) < valid_len[:, None])[..., None]  # [batch, T, 1]
        g, beta = torch.where(real, g, 0.0), torch.where(real, beta, 0.0)
    pad = (-T) % chunk
    if pad:  # padded tokens come last, and change nothing (beta = 0, g = 0)
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = q.shape[1] // chunk

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [batch, n*C, heads, ...] -> [batch, heads, n, C, ...]
        x = x.reshape(batch, n, chunk, heads, *x.shape[3:])
        return x.movedim(3, 1)

    return chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)


def _decays(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the log decays [batch, heads, n, C]: G, their running sums in each chunk; gap,
    e^{G_t - G_s} for s <= t and 0 above ([batch, heads, n, C, C]); the causal mask."""
    G = g.cumsum(-1)
    chunk = g.shape[-1]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=g.device).tril()
    # the exponent is masked first (it is positive above the diagonal)
    gap = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    return G, gap, causal


def _states_in_chunk(
    start: torch.Tensor,  # [batch, heads, k_dim, v_dim] the state before the chunk
    k: torch.Tensor,  # [batch, heads, C, k_dim]
    u: torch.Tensor,  # [batch, heads, C, v_dim] the rows written
    gap: torch.Tensor,  # [batch, heads, C, C] e^{G_t - G_s} for s <= t, else 0
    decay: torch.Tensor,  # [batch, heads, C, 1] e^{G_t}
    out: torch.Tensor | None = None,  # [batch, C, heads, k_dim, v_dim], contiguous
) -> torch.Tensor:
    """The state after every token of a chunk, [batch, C, heads, k_dim, v_dim] (the layout
    of states_out): S_t = e^{G_t} S0 + sum_{s<=t} (e^{G_t-G_s} k_s) u_s^T, one batched
    product over every (row, token, head), written into `out` when given."""
    # e^{G_t-G_s} k_s for every (t, s): [batch, C (t), heads, k_dim, C (s)], laid out as the
    # product reads it (from contiguous factors)
    weighted = gap.transpose(1, 2).contiguous()[..., None, :] * k.transpose(-1, -2).contiguous()[:, None]
    states = torch.matmul(weighted, u[:, None], out=out)
    return states.addcmul_(decay.transpose(1, 2)[..., None], start[:, None])


def _state_after(
    start: torch.Tensor,  # [batch, heads, k_dim, v_dim] the state before the chunk
    k: torch.Tensor,  # [batch, heads, C, k_dim]
    u: torch.Tensor,  # [batch, heads, C, v_dim] the rows written
    gap: torch.Tensor,  # [batch, heads, C] e^{G_t - G_s} of each row's token t, 0 past t
    decay: torch.Tensor,  # [batch, heads, 1] e^{G_t}
) -> torch.Tensor:
    """The state after one token t of each row's chunk, [batch, heads, k_dim, v_dim]:
    `_states_in_chunk`'s arithmetic for that token alone (its bits), an eighth of the
    product and of the memory for a block of 8."""
    weighted = gap[..., None, :] * k.transpose(-1, -2)  # e^{G_t-G_s} k_s: [batch, heads, k_dim, C]
    return torch.matmul(weighted, u).addcmul_(decay[..., None], start)


def gated_delta_after(
    q: torch.Tensor,  # [batch, T, v_heads, k_dim]: a verify's recorded inputs
    k: torch.Tensor,  # [batch, T, v_heads, k_dim]
    v: torch.Tensor,  # [batch, T, v_heads, v_dim]
    g: torch.Tensor,  # [batch, T, v_heads]
    beta: torch.Tensor,  # [batch, T, v_heads]
    written: torch.Tensor,  # [batch, v_heads, T, v_dim] the rows its tokens wrote (written_out)
    processed: torch.Tensor,  # [batch] the block tokens each row keeps, at least 1
    state: torch.Tensor,  # [slots, v_heads, k_dim, v_dim] each slot's state before the block
    slots: torch.Tensor,  # [batch]
) -> None:
    """The `per_token` commit of a verify that kept no state (state.NO_CHECKPOINTS): each
    slot's state after its first processed[i] block tokens, from the state before the block
    (a `per_token` verify leaves it alone) and the rows the verify wrote
    (`gated_delta_chunked`'s `written_out`), into state[slots] in place. The decays are
    made as a rerun of the block over those tokens makes them (`_chunked_inputs`,
    `_decays`) and the state by the rerun's carry (`_state_after`): the bits of the
    `recompute` commit's state. A row's rows written up to its boundary are the rerun's
    (a token's row reads only the tokens before it)."""
    T = q.shape[1]
    _, k, _, g, _ = _chunked_inputs(q, k, v, g, beta, processed, T)
    G, gap, _ = _decays(g)
    rows = torch.arange(q.shape[0], device=q.device)
    last = processed - 1
    decay = G[:, :, 0].exp()[..., None]  # [batch, heads, T, 1]
    start = state.index_select(0, slots)
    after = _state_after(start, k[:, :, 0], written, gap[rows, :, 0, last], decay[rows, :, last])
    state.index_copy_(0, slots, after)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last axis; on an exact tie the lowest token id wins, on every backend
    (torch.max's index is the first maximal one); a row whose maximum is not finite (it holds
    a NaN or +inf, or is -inf throughout: no distribution) gives `vocab`.

    logits: [..., vocab] -> [...] (int64). No host synchronisation. On the CPU, where
    torch.max's index-keeping reduction is several times slower than a plain maximum, a
    vocabulary of whole chunks is searched by chunks (`_greedy_by_chunks`), with the same result.
    """
    vocab = logits.shape[-1]
    if logits.device.type == "cpu" and vocab > GREEDY_CHUNK and vocab % GREEDY_CHUNK == 0:
        return _greedy_by_chunks(logits)
    best, ids = logits.max(dim=-1)
    return torch.where(best.isfinite(), ids, vocab)


GREEDY_CHUNK = 64


def _greedy_by_chunks(logits: torch.Tensor) -> torch.Tensor:
    """`greedy` from each chunk's maximum of GREEDY_CHUNK logits: the first chunk whose maximum
    is the row's (torch.max's first maximal index; a NaN propagates into its chunk's maximum
    and then the row's), then the first maximal logit inside that chunk. Every logit before it
    is in an earlier chunk, whose maximum is lower, or earlier in its chunk, so it is the
    row's first maximal logit, as torch.max over the whole row finds it (-0.0 and 0.0 are
    equal to both)."""
    vocab = logits.shape[-1]
    by_vocab = logits.movedim(-1, 0)
    if logits.stride(-1) != 1 and by_vocab.is_contiguous():
        # the CPU's `linear` gives its output transposed (a row's logits `rows` apart): each
        # reduction then runs over whole rows of vocabulary entries, where a search along a
        # row would stride through memory (16 times slower at [16, 8, 4096])
        chunks = by_vocab.reshape(vocab // GREEDY_CHUNK, GREEDY_CHUNK, -1)  # [chunks, chunk, rows]
        best, chunk = chunks.amax(dim=1).max(dim=0)
        rows = torch.arange(chunks.shape[-1], device=logits.device)
        _, inside = chunks[chunk, :, rows].max(dim=-1)
    else:
        chunks = logits.reshape(-1, vocab // GREEDY_CHUNK, GREEDY_CHUNK)  # [rows, chunks, chunk]
        best, chunk = chunks.amax(dim=-1).max(dim=-1)
        rows = torch.arange(chunks.shape[0], device=logits.device)
        _, inside = chunks[rows, chunk].max(dim=-1)
    ids = torch.where(best.isfinite(), chunk * GREEDY_CHUNK + inside, vocab)
    return ids.reshape(logits.shape[:-1])


def route_experts(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture of experts' routing, as transformers routes: softmax of the router logits in
    float32 whatever their dtype, the top k, optionally renormalised to sum 1 (still float32),
    cast back to the logits' dtype. A near-tie between two experts is decided on float32
    probabilities.

    logits: [tokens, experts] -> (weights [tokens, k] in logits' dtype, expert ids [tokens, k]
    int64), each token's experts in ascending id order (the order their outputs are summed in).
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(logits.dtype)
    experts, order = experts.sort(dim=-1)
    return weights.gather(-1, order), experts


def experts(
    x: torch.Tensor,  # [tokens, hidden]
    weights: torch.Tensor,  # [tokens, k] routing weights, x's dtype
    ids: torch.Tensor,  # [tokens, k] expert ids, ascending per token
    gate_up: torch.Tensor,  # [experts, 2 * inter, hidden], gate rows first
    down: torch.Tensor,  # [experts, hidden, inter]
    census: torch.Tensor | None = None,  # [2] int64: (distinct experts, calls), added to
    residual: torch.Tensor | None = None,  # [tokens, hidden]: added to the sum, rounded
) -> torch.Tensor:
    """sum over j of weights[t, j] * expert_{ids[t, j]}(x[t]) for each token t, where expert e
    is the SwiGLU MLP down[e] @ (silu(gate[e] @ x) * up[e] @ x). Each (token, expert) output is
    rounded to x's dtype, times its weight (rounded), and the k products are added one at a
    time in slot order j = 0, 1, ..., each sum rounded: the order transformers' eager loop adds
    them in, and one that does not depend on the other tokens. `census`, when given, gets the
    number of distinct experts the tokens chose and one call added. With `residual`, the
    result is residual + the sum, one more rounded add (a layer's residual connection, so the
    capturable kernels add it in the launch that sums the slots). Returns [tokens, hidden].

    One expert at a time, for the experts that have tokens (a host synchronisation: which
    ones), so it cannot be captured in a CUDA graph; kernels/moe.py is the capturable one.
    """
    tokens, k = ids.shape
    inter = down.shape[-1]
    weighted = x.new_empty(tokens, k, x.shape[-1])
    chosen = ids.unique().tolist()
    for e in chosen:
        token, slot = (ids == e).nonzero(as_tuple=True)
        projected = linear(x[token], gate_up[e])
        out = linear(silu_mul(projected[:, :inter], projected[:, inter:]), down[e])
        weighted[token, slot] = out * weights[token, slot, None]
    if census is not None:
        census += torch.tensor([len(chosen), 1], device=census.device)
    out = weighted[:, 0]
    for j in range(1, k):
        out = out + weighted[:, j]
    return out if residual is None else residual + out
