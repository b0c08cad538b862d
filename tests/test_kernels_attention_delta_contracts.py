"""Edges of the attention, gated delta, norm, RoPE and argmax kernels that the shapes of
tests/test_kernels.py do not reach, each against the PyTorch reference (or, where the
reference itself is what is pinned, against the rule written out in float64):

- attention for queries whose keys end exactly at a key-block or split edge (positions 0,
  62, 63, 64, 127, 128, ...), on a cache whose length is not a whole number of splits, in a
  decode step, a verify block and a prefill chunk; a non-causal block with a sliding window
  (the window hides keys on both sides); a sliding-window query's bits on either split
  path; a value cache holding non-finite values past every key a query may see;
- the gated delta inputs' L2 norm of a head of small norm (eps 1e-6 under the root);
- RMSNorm, gated RMSNorm, SwiGLU and the per-head norms with RoPE rounding each step to the
  model dtype as the reference does, checked in float16 (which the interpreter rounds as
  PyTorch does; bfloat16 it truncates), and the RoPE in bfloat16 too where compiled;
- RoPE's cache write at positions laid out with a batch stride other than T, and values
  read with their own strides;
- greedy argmax over rows of only negative logits, and rows whose neighbour starts with a
  larger logit.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before
they are imported), in float32 where they multiply tiles, with `tl.dot` row by row as on the
device (tests/interpreter.py). With CUDA the same tests run compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from reference_engine.kernels import reference as ref  # noqa: E402
from reference_engine.kernels.attention import attention  # noqa: E402
from tests.interpreter import row_invariant_dots  # noqa: E402
from tests.kernel_inputs import DEVICE, rand  # noqa: E402

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]


@pytest.fixture(autouse=True)
def _dots_like_the_device():
    with row_invariant_dots():
        yield


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-5) -> None:
    assert got.shape == want.shape
    assert torch.isfinite(got).all(), "non-finite output (an unwritten or misread element)"
    err = (got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)
    assert err < tol, f"relative error {err:.3g} over {tol:g}"


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-5) -> None:
    """Every query row (the last two axes: heads and head dims) within `tol` of its own:
    one wrong row among many must not hide inside a tolerance over the whole tensor."""
    assert got.shape == want.shape
    assert torch.isfinite(got).all(), "non-finite output (an unwritten or misread element)"
    g, w = got.double().flatten(-2), want.double().flatten(-2)
    err = (g - w).norm(dim=-1) / w.norm(dim=-1).clamp(min=1e-30)
    assert (err < tol).all(), f"rows over {tol:g}: {(err >= tol).nonzero().tolist()}"


# ----------------------------------------------------------------------------- attention
def kv_cache(slots: int, length: int, kv_heads: int = 2, dim: int = 16):
    return rand(slots, length, kv_heads, dim, seed=21), rand(slots, length, kv_heads, dim, seed=22)


EDGES = [0, 1, 62, 63, 64, 65, 126, 127, 128, 129, 191, 192, 199]  # around blocks of 64


@pytest.mark.parametrize("split", [64, 2048], ids=["splits-of-64", "one-split"])
def test_decode_steps_whose_keys_end_at_a_block_or_split_edge_equal_the_reference(split: int) -> None:
    """One row per position around the edges of key blocks (64) and splits, on a cache of 200
    positions: the last split (192..199) is partial. Each row sees its own key and every one
    before it, and none after."""
    k_cache, v_cache = kv_cache(len(EDGES), 200)
    positions = torch.tensor(EDGES, device=DEVICE)[:, None]
    slots = torch.arange(len(EDGES), device=DEVICE)
    q = rand(len(EDGES), 1, 4, 16, seed=23)
    args = (q, k_cache, v_cache, slots, positions, 200, 0.3)
    assert_rows_close(attention(*args, split=split), ref.attention(*args))


@pytest.mark.parametrize(("T", "last"), [(4, 64), (4, 127), (16, 128), (16, 199), (17, 128), (40, 192)])
def test_blocks_and_chunks_that_end_at_a_block_or_split_edge_equal_the_reference(T: int, last: int) -> None:
    """A verify block (T <= 16: splits run apart, then merged) or a prefill chunk (T > 16: one
    program runs the splits in turn) whose last query sits at an edge, beside a row that ends
    one position earlier, over splits of 64 on a cache of 200 positions."""
    k_cache, v_cache = kv_cache(3, 200)
    ends = torch.tensor([last, last - 1], device=DEVICE)
    positions = ends[:, None] - T + 1 + torch.arange(T, device=DEVICE)
    slots = torch.tensor([2, 0], device=DEVICE)
    q = rand(2, T, 4, 16, seed=24)
    args = (q, k_cache, v_cache, slots, positions, 200, 0.3)
    assert_rows_close(attention(*args, split=64), ref.attention(*args))
    assert_rows_close(attention(*args), ref.attention(*args))


def rule_attention(q, k_cache, v_cache, slots, positions, scale, causal, window, valid_len):
    """The attention contract written out, in float64: query (b, t) at position p sees key j
    of its slot when j <= p (causal) or j <= the row's last real position (non-causal:
    positions[b, 0] + valid_len[b] - 1, or positions[b, -1]), and, with a window w, when
    |p - j| < w."""
    batch, T, heads, _ = q.shape
    group = heads // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)  # on the CPU; callers move it to their device
    for b in range(batch):
        keys = k_cache[slots[b]].double().cpu()
        values = v_cache[slots[b]].double().cpu()
        if valid_len is not None:
            last = int(positions[b, 0] + valid_len[b] - 1)
        else:
            last = int(positions[b, -1])
        for t in range(T):
            p = int(positions[b, t])
            seen = [j for j in range(keys.shape[0]) if j <= (p if causal else last)]
            if window is not None:
                seen = [j for j in seen if abs(p - j) < window]
            for h in range(heads):
                kv = h // group
                scores = keys[seen, kv] @ q[b, t, h].double().cpu() * scale
                out[b, t, h] = torch.softmax(scores, 0) @ values[seen, kv]
    return out


@pytest.mark.parametrize("valid", [None, [5, 8]], ids=["block", "block-valid-len"])
def test_a_non_causal_block_with_a_sliding_window_hides_keys_on_both_sides(valid) -> None:
    """The draft's non-causal block in a sliding-window layer: a query sees the block's keys
    up to the row's last real token, less those w or more positions away on either side (a
    window of 3 hides block keys after the first queries as well as context before them)."""
    k_cache, v_cache = kv_cache(3, 120)
    T, window = 8, 3
    positions = torch.stack([torch.arange(100, 100 + T), torch.arange(7, 7 + T)]).to(DEVICE)
    slots = torch.tensor([2, 0], device=DEVICE)
    q = rand(2, T, 4, 16, seed=25)
    valid_len = torch.tensor(valid, device=DEVICE) if valid else None
    args = (q, k_cache, v_cache, slots, positions, 120, 0.3, False, window, valid_len)
    want = rule_attention(q, k_cache, v_cache, slots, positions, 0.3, False, window, valid_len)
    reference = ref.attention(*args)
    assert_rows_close(reference, want.to(reference))
    assert_rows_close(attention(*args), reference)
    assert_rows_close(attention(*args, split=64), reference)


def test_a_sliding_window_query_gets_the_same_bits_from_either_split_path() -> None:
    """Position 200 with a window of 100 over splits of 128: its keys (101..200) start inside
    the first split. Decoded alone (each split a program of its own, then merged), in a verify
    block (the same) and in a prefill chunk (one program, the splits in turn): the splits are
    cut at the same absolute positions, so the same bits."""
    k_cache, v_cache = kv_cache(2, 260)
    slots = torch.tensor([1], device=DEVICE)
    q = rand(1, 40, 4, 16, seed=27)
    prefill = torch.arange(170, 210, device=DEVICE)[None]  # position 200 is row 30
    run = dict(causal=True, sliding_window=100, split=128)
    chunk = attention(q, k_cache, v_cache, slots, prefill, 210, 0.3, **run)
    alone = attention(q[:, 30:31], k_cache, v_cache, slots, prefill[:, 30:31], 201, 0.3, **run)
    block = attention(q[:, 24:40], k_cache, v_cache, slots, prefill[:, 24:40], 210, 0.3, **run)
    assert torch.equal(alone[0, 0], chunk[0, 30])
    assert torch.equal(block[0, 6], chunk[0, 30])
    assert_rows_close(chunk, ref.attention(q, k_cache, v_cache, slots, prefill, 210, 0.3, True, 100))


@pytest.mark.parametrize("T", [1, 20], ids=["decode", "prefill"])
def test_non_finite_values_past_every_key_a_query_sees_do_not_reach_it(T: int) -> None:
    """A slot's cache past a request's length may hold what an earlier request of the slot
    left there (a slot's reset clears its recurrent state, not its key and value rows), NaN
    from a request that failed on non-finite numbers included. Those keys are hidden from every
    query of the new request, so their values must not reach its outputs, neither alone nor
    beside a longer request whose keys reach past them (the batch's kv_len): the kernel and
    the reference over the request's own keys."""
    k_cache, v_cache = kv_cache(2, 128)
    k_cache[0, 40:] = float("nan")
    v_cache[0, 40:] = float("nan")
    positions = torch.arange(30 - T + 1, 31, device=DEVICE)[None]  # keys 0..30
    slots = torch.tensor([0], device=DEVICE)
    q = rand(1, T, 4, 16, seed=28)
    args = (q, k_cache, v_cache, slots, positions, 31, 0.3)
    want = ref.attention(*args)  # over the first 31 keys alone
    assert torch.isfinite(want).all()
    assert_rows_close(attention(*args), want)
    # beside a request at positions up to 120 in slot 1: the batch reads 121 keys a row
    both = torch.cat([positions, positions + 90])
    slots2 = torch.tensor([0, 1], device=DEVICE)
    q2 = torch.cat([q, rand(1, T, 4, 16, seed=29)])
    args2 = (q2, k_cache, v_cache, slots2, both, 121, 0.3)
    for got in (ref.attention(*args2), attention(*args2)):
        assert torch.isfinite(got).all()
        assert_rows_close(got[:1], want)


# ----------------------------------------------------------------------------- gated delta inputs
def test_a_head_of_small_norm_is_l2_normalised_with_eps_1e6_under_the_root() -> None:
    """q and k are x * rsqrt(sum(x^2) + 1e-6): on a head whose sum of squares is near eps
    (entries of 1e-4 over 16 dims sum to 1.6e-7), eps decides the result, which a tolerance
    over ordinary heads cannot see."""
    from reference_engine.kernels.gated_delta import gated_delta_inputs

    batch, T, k_heads, v_heads, k_dim, v_dim = 2, 3, 2, 4, 16, 8
    mixed = rand(batch, 2 * k_heads * k_dim + v_heads * v_dim, T, seed=31)
    mixed[:, : 2 * k_heads * k_dim] *= 1e-4
    a, b = rand(batch, T, v_heads, seed=32), rand(batch, T, v_heads, seed=33)
    A_log, dt_bias = rand(v_heads, seed=34), rand(v_heads, seed=35)
    got = gated_delta_inputs(mixed, a, b, A_log, dt_bias, k_heads, k_dim, v_dim)
    want = ref.gated_delta_inputs(mixed, a, b, A_log, dt_bias, k_heads, k_dim, v_dim)
    heads = mixed[:, : 2 * k_heads * k_dim].transpose(1, 2).double().reshape(batch, T, 2, k_heads, k_dim)
    rule = heads * (heads.square().sum(-1, keepdim=True) + 1e-6).rsqrt()
    rule = rule.repeat_interleave(v_heads // k_heads, dim=3)
    for g, w, r in zip(got[:2], want[:2], (rule[:, :, 0] * k_dim**-0.5, rule[:, :, 1])):  # q, k
        assert_close(w, r.float())
        assert_close(g, w)


# ----------------------------------------------------------------------------- row kernels
def assert_rounds_as_the_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    """float16 or bfloat16 results that follow the reference's roundings step by step: all
    but a few elements the same bits (a last-place difference of a root or an exponential),
    none more than one place apart. A step rounded otherwise (one rounding dropped, or one
    added, as when a product and the sum after it are contracted into one multiply-add) moves
    a large share of the elements."""
    assert got.dtype == want.dtype and got.dtype in (torch.float16, torch.bfloat16)
    assert got.shape == want.shape
    differ = got != want
    assert differ.float().mean() < 0.01, f"{int(differ.sum())} of {differ.numel()} elements differ"
    info = torch.finfo(got.dtype)
    scale = want.float().abs().clamp(min=info.smallest_normal)
    assert ((got.float() - want.float()).abs() <= scale * info.eps).all()


def test_norms_and_swiglu_round_each_step_to_the_model_dtype_as_the_reference() -> None:
    """RMSNorm (w and 1 + w), the residual add before it, gated RMSNorm (a float32 input
    rounded to z's dtype first, the weighted norm rounded before silu(z)) and SwiGLU (silu
    rounded before the product), in float16."""
    from reference_engine.kernels.norms import add_rms_norm, gated_rms_norm, rms_norm, silu_mul

    x, r = rand(64, 96, seed=41).half(), rand(64, 96, seed=42).half()
    z, w = rand(64, 96, seed=43).half(), rand(96, seed=44).half()
    for offset in (False, True):
        assert_rounds_as_the_reference(rms_norm(x, w, 1e-6, offset), ref.rms_norm(x, w, 1e-6, offset))
        got, got_sum = add_rms_norm(x, r, w, 1e-6, offset)
        want, want_sum = ref.add_rms_norm(x, r, w, 1e-6, offset)
        assert torch.equal(got_sum, want_sum)
        assert_rounds_as_the_reference(got, want)
    wide = rand(64, 96, seed=45) * 3  # the recurrence's float32 output
    assert_rounds_as_the_reference(gated_rms_norm(wide, z, w, 1e-6), ref.gated_rms_norm(wide, z, w, 1e-6))
    assert_rounds_as_the_reference(silu_mul(x * 3, z), ref.silu_mul(x * 3, z))


def test_rms_norm_keeps_eps_under_the_root() -> None:
    """A row of zeros normalises to zeros, and a row whose mean square is near eps is
    scaled by rsqrt(mean + eps), not by rsqrt(mean)."""
    from reference_engine.kernels.norms import rms_norm

    x = rand(4, 40, seed=46)
    x[0] = 0.0
    x[1] *= 1e-4  # mean square about 1e-8, beside eps 1e-6
    w = rand(40, seed=47)
    for offset in (False, True):
        got, want = rms_norm(x, w, 1e-6, offset), ref.rms_norm(x, w, 1e-6, offset)
        assert (got[0] == 0).all()
        assert_rows_close(got[:, None], want[:, None])


# ----------------------------------------------------------------------------- attention inputs
def test_rope_reads_positions_and_values_with_their_own_strides() -> None:
    """Positions a column range of a wider tensor (a batch stride other than T) and values laid
    out unlike the keys: each key and value lands at its row's own positions, as the
    reference writes them."""
    from reference_engine.kernels.rope import attention_inputs
    from reference_engine.models.layers import RotaryEmbedding

    batch, T, heads, kv_heads, dim = 2, 3, 4, 2, 32
    q = rand(batch, T, heads, dim, seed=51)
    k = rand(batch, T, kv_heads, dim, seed=52)
    v = rand(kv_heads, batch, T, dim, seed=53).permute(1, 2, 0, 3)  # [batch, T, kv_heads, dim], strided
    qw, kw = rand(dim, seed=54), rand(dim, seed=55)
    wide = torch.tensor([[9, 10, 11, 12, 13], [2, 3, 4, 5, 6]], device=DEVICE)
    positions = wide[:, 1 : 1 + T]
    assert positions.stride(0) != T and v.stride() != k.stride()
    cos, sin = RotaryEmbedding(dim, 10000.0).to(DEVICE).cos_sin(positions, torch.float32)
    slots = torch.tensor([1, 2], device=DEVICE)
    got = [torch.zeros(3, 16, kv_heads, dim, device=DEVICE) for _ in range(2)]
    want = [torch.zeros(3, 16, kv_heads, dim, device=DEVICE) for _ in range(2)]
    got_q = attention_inputs(q, k, v, qw, kw, 1e-6, False, cos, sin, *got, slots, positions)
    want_q = ref.attention_inputs(q, k, v, qw, kw, 1e-6, False, cos, sin, *want, slots, positions)
    assert_close(got_q, want_q)
    assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])


COMPILED_BFLOAT16 = pytest.param(
    torch.bfloat16,
    id="bfloat16",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not CUDA, reason="the interpreter rounds float32 to bfloat16 by truncation"),
    ],
)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="float16"), COMPILED_BFLOAT16])
@pytest.mark.parametrize("norm", [True, False], ids=["norms", "no_norms"])
def test_rope_and_norms_round_each_step_to_the_model_dtype_as_the_reference(dtype, norm) -> None:
    """q_norm and k_norm (w and 1 + w; none for Llama), then RoPE over part of the head, in
    float16 and bfloat16: each product and sum rounded as the reference's PyTorch operations
    round, so the rotation's two products are rounded before their sum."""
    from reference_engine.kernels.rope import attention_inputs
    from reference_engine.models.layers import RotaryEmbedding

    batch, T, heads, kv_heads, dim, rotary = 4, 8, 4, 2, 48, 16
    q = (rand(batch, T, heads, dim, seed=56) * 2).to(dtype)
    k = (rand(batch, T, kv_heads, dim, seed=57) * 2).to(dtype)
    v = rand(batch, T, kv_heads, dim, seed=58).to(dtype)
    qw, kw = (rand(dim, seed=59).to(dtype), rand(dim, seed=60).to(dtype)) if norm else (None, None)
    positions = torch.arange(batch * T, device=DEVICE).view(batch, T) * 3
    cos, sin = RotaryEmbedding(rotary, 10000.0).to(DEVICE).cos_sin(positions, dtype)
    slots = torch.arange(batch, device=DEVICE)
    for offset in (False, True):
        got = [torch.zeros(batch, 96, kv_heads, dim, dtype=dtype, device=DEVICE) for _ in range(2)]
        want = [torch.zeros_like(c) for c in got]
        got_q = attention_inputs(q, k, v, qw, kw, 1e-6, offset, cos, sin, *got, slots, positions)
        want_q = ref.attention_inputs(q, k, v, qw, kw, 1e-6, offset, cos, sin, *want, slots, positions)
        assert_rounds_as_the_reference(got_q, want_q)
        written = (slots[:, None], positions)  # the keys' rows (the rest stays zero in both)
        assert_rounds_as_the_reference(got[0][written], want[0][written])
        assert torch.equal(got[1], want[1])


# ----------------------------------------------------------------------------- greedy
def test_greedy_over_rows_of_negative_logits_and_beside_larger_rows() -> None:
    """Rows whose every logit is negative (the running maximum starts at -inf, not 0), and
    rows followed by a row whose first logit beats them (a row reads none of its
    neighbour's): the reference's ids, on one and on several first-pass chunks."""
    from reference_engine.kernels.argmax import CHUNK_V, greedy

    for V in (5000, CHUNK_V + 100):
        logits = -rand(4, V, seed=61).abs() - 1.0
        logits[1] += 100.0  # row 0 sits before a row of larger logits
        logits[3] = logits[3] * 1e-3 - 50.0
        got = greedy(logits)
        assert torch.equal(got, ref.greedy(logits)), V
        assert (got < V).all()
