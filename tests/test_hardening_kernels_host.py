"""The host side of the Triton kernels (reference_engine/kernels/): what each launch takes from
its arguments (strides, layouts, grids, tails off the block sizes), which inputs it refuses,
and the table and tile choices, each kernel against its PyTorch reference (kernels/reference.py):

- greedy argmax over a vocabulary of more than one first-pass chunk whose last chunk is
  ragged;
- the norms and SwiGLU reading inputs that are column views of a fused projection or whose
  last axis is strided;
- attention over a cache whose length is not a whole number of splits, and the layouts it
  refuses;
- the attention inputs refusing caches of two layouts and strided head dims;
- the matmul over K and N off its tiles, the tile and weight-class bounds, the accelerator's
  alignment rule, and the shapes it refuses;
- the experts' tiles and grouping at their bounds, routing over strided logits;
- the gated delta rule, its resume and its inputs refusing what they cannot take;
- the kernel switch (`select`, `default_numerics`; an empty numerics name is refused, not
  taken for the default) and the fast table's entries.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before
they are imported), in float32, with `tl.dot` row by row as on the device
(tests/interpreter.py). With CUDA the same tests run compiled.
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
from tests.interpreter import row_invariant_dots  # noqa: E402
from tests.kernel_inputs import DEVICE, delta_inputs, rand  # noqa: E402

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]


@pytest.fixture(autouse=True)
def _dots_like_the_device():
    with row_invariant_dots():
        yield


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-5) -> None:
    """Every row (the last axis) within `tol` of its own, relative."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all(), "non-finite output (an unwritten or misread element)"
    g, w = got.double().reshape(-1, got.shape[-1]), want.double().reshape(-1, want.shape[-1])
    err = (g - w).norm(dim=-1) / w.norm(dim=-1).clamp(min=1e-30)
    assert (err < tol).all(), f"rows over {tol:g}: {(err >= tol).nonzero().tolist()}"


# ----------------------------------------------------------------------------- greedy
def test_greedy_over_more_than_one_chunk_with_a_ragged_last_chunk() -> None:
    """A vocabulary of one whole first-pass chunk and a few more ids: the maximum in the few
    ids past the chunk is found, as is one inside the chunk."""
    from reference_engine.kernels.argmax import CHUNK_V, greedy

    V = CHUNK_V + 5
    logits = rand(2, V, seed=3)
    logits[0, CHUNK_V + 3] = 50.0  # in the ragged tail
    logits[1, 17] = 50.0
    got = greedy(logits)
    assert got.tolist() == [CHUNK_V + 3, 17]
    assert torch.equal(got, ref.greedy(logits))


# ----------------------------------------------------------------------------- norms, SwiGLU
def test_norms_read_an_input_that_is_a_column_view_of_a_fused_projection() -> None:
    """x and the residual as column ranges of one wider tensor (rows further apart than H):
    each row is normed from its own values."""
    from reference_engine.kernels.norms import add_rms_norm, rms_norm

    H = 24
    fused = rand(5, 3 * H, seed=4)
    x, res = fused[:, H : 2 * H], fused[:, 2 * H :]
    w = rand(H, seed=5)
    for offset in (False, True):
        assert_rows_close(rms_norm(x, w, 1e-6, offset), ref.rms_norm(x, w, 1e-6, offset))
        got, got_sum = add_rms_norm(x, res, w, 1e-6, offset)
        want, want_sum = ref.add_rms_norm(x, res, w, 1e-6, offset)
        assert_rows_close(got, want)
        assert torch.equal(got_sum, want_sum)


def test_the_gated_norm_and_swiglu_read_inputs_whose_last_axis_is_strided() -> None:
    """z, gate and up transposed views (their last axis not contiguous): read by value."""
    from reference_engine.kernels.norms import gated_rms_norm, silu_mul

    H = 20
    x = rand(6, H, seed=6)
    z = rand(H, 6, seed=7).T
    gate, up = rand(H, 6, seed=8).T, rand(H, 6, seed=9).T
    assert z.stride(-1) != 1 and gate.stride(-1) != 1
    w = rand(H, seed=10)
    assert_rows_close(gated_rms_norm(x, z, w, 1e-6), ref.gated_rms_norm(x, z, w, 1e-6))
    assert_rows_close(silu_mul(gate, up), ref.silu_mul(gate, up))


# ----------------------------------------------------------------------------- attention
def _cache(length: int, slots: int = 2, kv_heads: int = 2, dim: int = 16, seed: int = 20):
    return rand(slots, length, kv_heads, dim, seed=seed), rand(slots, length, kv_heads, dim, seed=seed + 1)


@pytest.mark.parametrize("T", [1, 20], ids=["decode", "prefill"])
def test_attention_over_a_cache_that_is_not_a_whole_number_of_splits(T: int) -> None:
    """A cache of 150 positions over splits of 64: the keys of the ragged last split
    (128-149) count, for a decode step (splits apart) and a prefill chunk (one program)."""
    from reference_engine.kernels.attention import attention

    k_cache, v_cache = _cache(150)
    slots = torch.tensor([1, 0], device=DEVICE)
    positions = torch.stack([torch.arange(149 - T + 1, 150), torch.arange(120, 120 + T)]).to(DEVICE)
    q = rand(2, T, 4, 16, seed=22)
    args = (q, k_cache, v_cache, slots, positions, 150, 0.25)
    assert_rows_close(attention(*args, split=64), ref.attention(*args))


def test_attention_reads_positions_whose_tokens_are_strided() -> None:
    """Positions every other column of a wider tensor: each query reads its own position."""
    from reference_engine.kernels.attention import attention

    k_cache, v_cache = _cache(80)
    wide = torch.tensor([[10, 0, 40, 0, 75, 0], [5, 0, 6, 0, 60, 0]], device=DEVICE)
    positions = wide[:, ::2]
    assert positions.stride(-1) != 1
    slots = torch.tensor([0, 1], device=DEVICE)
    q = rand(2, 3, 4, 16, seed=23)
    args = (q, k_cache, v_cache, slots, positions, 80, 0.25)
    assert_rows_close(attention(*args), ref.attention(*args))


def test_attention_refuses_heads_that_do_not_group_and_caches_of_two_layouts() -> None:
    from reference_engine.kernels.attention import attention

    k_cache, v_cache = _cache(32, kv_heads=4)
    slots, positions = torch.tensor([0], device=DEVICE), torch.tensor([[3]], device=DEVICE)
    with pytest.raises(ValueError, match="6 query heads do not group over 4 kv heads"):
        attention(rand(1, 1, 6, 16), k_cache, v_cache, slots, positions, 4, 0.25)
    v_other = v_cache.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, another layout
    with pytest.raises(ValueError, match="share a layout"):
        attention(rand(1, 1, 4, 16), k_cache, v_other, slots, positions, 4, 0.25)


@pytest.mark.parametrize("window", [3, 10])
def test_a_sliding_window_hides_keys_window_or_more_positions_behind(window: int) -> None:
    """A window of w shows a query at p the keys p-w+1 .. p, no more: the key at p-w changes
    nothing."""
    from reference_engine.kernels.attention import attention

    k_cache, v_cache = _cache(48, slots=1)
    positions = torch.tensor([[30, 31]], device=DEVICE)
    slots = torch.tensor([0], device=DEVICE)
    q = rand(1, 2, 4, 16, seed=24)
    args = (q, k_cache, v_cache, slots, positions, 32, 0.25, True, window)
    got = attention(*args)
    assert_rows_close(got, ref.attention(*args))
    k2, v2 = k_cache.clone(), v_cache.clone()
    k2[0, 30 - window], v2[0, 30 - window] = 100.0, 100.0
    moved = attention(q, k2, v2, slots, positions, 32, 0.25, True, window)
    assert torch.equal(moved[0, 0], got[0, 0])


# ----------------------------------------------------------------------------- attention inputs
def _rope_args(positions: torch.Tensor, dim: int = 16, kv_heads: int = 2):
    from reference_engine.models.layers import RotaryEmbedding

    batch, T = positions.shape
    q = rand(batch, T, 4, dim, seed=30)
    k = rand(batch, T, kv_heads, dim, seed=31)
    v = rand(batch, T, kv_heads, dim, seed=32)
    qw, kw = rand(dim, seed=33), rand(dim, seed=34)
    cos, sin = RotaryEmbedding(dim, 10000.0).to(DEVICE).cos_sin(positions, torch.float32)
    return q, k, v, qw, kw, cos, sin


def test_attention_inputs_write_at_positions_whose_tokens_are_strided() -> None:
    """Positions every other column of a wider tensor: each key and value lands at its own."""
    from reference_engine.kernels.rope import attention_inputs

    wide = torch.tensor([[3, 0, 9, 0, 4, 0], [11, 0, 1, 0, 7, 0]], device=DEVICE)
    positions = wide[:, ::2]
    q, k, v, qw, kw, cos, sin = _rope_args(positions)
    slots = torch.tensor([1, 0], device=DEVICE)
    got = [torch.zeros(2, 16, 2, 16, device=DEVICE) for _ in range(2)]
    want = [torch.zeros(2, 16, 2, 16, device=DEVICE) for _ in range(2)]
    got_q = attention_inputs(q, k, v, qw, kw, 1e-6, False, cos, sin, *got, slots, positions)
    want_q = ref.attention_inputs(q, k, v, qw, kw, 1e-6, False, cos, sin, *want, slots, positions)
    assert_rows_close(got_q, want_q)
    assert_rows_close(got[0], want[0])
    assert torch.equal(got[1], want[1])


def test_attention_inputs_norm_queries_with_their_own_weight() -> None:
    from reference_engine.kernels.rope import attention_inputs

    positions = torch.tensor([[2, 3]], device=DEVICE)
    q, k, v, qw, kw, cos, sin = _rope_args(positions)
    slots = torch.tensor([0], device=DEVICE)
    got = [torch.zeros(1, 8, 2, 16, device=DEVICE) for _ in range(2)]
    want = [torch.zeros(1, 8, 2, 16, device=DEVICE) for _ in range(2)]
    got_q = attention_inputs(q, k, v, qw, kw, 1e-6, True, cos, sin, *got, slots, positions)
    want_q = ref.attention_inputs(q, k, v, qw, kw, 1e-6, True, cos, sin, *want, slots, positions)
    assert_rows_close(got_q, want_q)
    assert_rows_close(got[0], want[0])


def test_attention_inputs_refuse_caches_of_two_layouts_and_strided_head_dims() -> None:
    from reference_engine.kernels.rope import attention_inputs

    positions = torch.tensor([[2, 3]], device=DEVICE)
    q, k, v, qw, kw, cos, sin = _rope_args(positions)
    slots = torch.tensor([0], device=DEVICE)
    k_cache = torch.zeros(1, 8, 2, 16, device=DEVICE)
    v_other = torch.zeros(1, 2, 8, 16, device=DEVICE).transpose(1, 2)
    with pytest.raises(ValueError, match="share one layout"):
        attention_inputs(q, k, v, qw, kw, 1e-6, False, cos, sin, k_cache, v_other, slots, positions)
    v_cache = torch.zeros_like(k_cache)
    for name in ("q", "k", "v"):
        given = {"q": q, "k": k, "v": v}
        given[name] = given[name].transpose(-1, -2).contiguous().transpose(-1, -2)
        assert given[name].stride(-1) != 1
        with pytest.raises(ValueError, match=f"{name}'s head dims must be contiguous"):
            attention_inputs(
                given["q"], given["k"], given["v"], qw, kw, 1e-6, False, cos, sin,
                k_cache, v_cache, slots, positions,
            )  # fmt: skip


# ----------------------------------------------------------------------------- matmul
def test_matmul_over_k_and_n_off_the_tiles() -> None:
    """K = 300 (past one K tile, not a multiple of it) and N = 40 (past one column tile, the
    second ragged): every output column equals the reference, with and without a bias."""
    from reference_engine.kernels.matmul import matmul

    x, w, b = rand(3, 300, seed=40), rand(40, 300, seed=41), rand(40, seed=42)
    for bias in (None, b):
        got = matmul(x, w, bias)
        assert got.shape == (3, 40)
        assert_rows_close(got, ref.linear(x, w, bias))


def test_matmul_refuses_an_input_or_a_bias_that_does_not_fit_the_weight() -> None:
    from reference_engine.kernels.matmul import matmul

    w = rand(8, 16, seed=43)
    with pytest.raises(ValueError, match="x has 20 columns, weight expects 16"):
        matmul(rand(2, 20), w)
    with pytest.raises(ValueError, match="x has 12 columns, weight expects 16"):
        matmul(rand(2, 12), w)
    for shape in ((9,), (1, 8)):
        with pytest.raises(ValueError, match=r"bias has shape .*, weight expects \(8,\)"):
            matmul(rand(2, 16), w, rand(*shape))


def test_the_accelerator_takes_16_byte_aligned_row_major_tensors_only() -> None:
    from reference_engine.kernels.matmul import tma_ready

    assert tma_ready(torch.empty(4, 8, dtype=torch.bfloat16))
    assert not tma_ready(torch.empty(4, 10, dtype=torch.bfloat16))  # rows 20 bytes apart
    assert not tma_ready(torch.empty(4, 16, dtype=torch.bfloat16)[:, 1:9])  # start off 16 bytes
    assert not tma_ready(torch.empty(8, 4, dtype=torch.bfloat16).T)  # column-major
    assert not tma_ready(torch.empty(2, 4, 8, dtype=torch.bfloat16))  # not 2-D


def test_the_tiles_and_weight_class_at_their_bounds() -> None:
    from reference_engine.kernels import matmul as mm

    bf16 = torch.bfloat16
    assert mm.weight_class(mm.VOCAB_N, 64) == "vocab" and mm.weight_class(mm.VOCAB_N - 1, 64) == "wide"
    assert mm.weight_class(mm.WIDE_N, 64) == "wide" and mm.weight_class(mm.WIDE_N - 1, 64) == "narrow"
    assert mm.weight_class(64, mm.DEEP_K) == "deep" and mm.weight_class(64, mm.DEEP_K - 1) == "narrow"
    assert mm.tiles_for(16, 4096, 4096, bf16, 132) == mm.NARROW
    assert mm.tiles_for(17, 4096, 4096, bf16, 132) == mm.FEW_ROWS_DEEP
    assert mm.block_n(128 * 132, 132) == 128 and mm.block_n(128 * 131, 132) == 64
    assert mm.block_n(64 * 132, 132) == 64 and mm.block_n(64 * 131, 132) == 32


# ----------------------------------------------------------------------------- experts
def test_the_expert_tiles_switch_past_eight_and_past_1024_pairs() -> None:
    from reference_engine.kernels import moe

    bf16 = torch.bfloat16
    assert moe.expert_tiles(moe.ONE_TOKEN_PAIRS, bf16) == moe.ONE
    assert moe.expert_tiles(moe.ONE_TOKEN_PAIRS + 1, bf16) == moe.FEW
    assert moe.expert_tiles(moe.FEW_PAIRS, bf16) == moe.FEW
    assert moe.expert_tiles(moe.FEW_PAIRS + 1, bf16) == moe.MANY
    for half, single in zip(moe.expert_tiles(1, bf16), moe.expert_tiles(1, torch.float32)):
        assert single.block_k < half.block_k and single._replace(block_k=half.block_k) == half


def test_as_many_pairs_as_experts_take_a_product_row_per_expert() -> None:
    """pairs == experts: each product row e takes expert e (or none), the groups stable."""
    from reference_engine.kernels import moe

    ids = torch.tensor([[0, 2], [2, 3]], device=DEVICE)  # 4 pairs, 4 experts, expert 1 has none
    census = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    order, starts, active, programs = moe.group_pairs(ids, 4, census)
    assert programs == 4
    assert active.tolist() == [0, -1, 2, 3]
    assert starts.tolist() == [0, 1, 1, 3, 4]
    assert order.tolist() == [0, 1, 2, 3]
    assert census.tolist() == [3, 1]


def test_the_grouping_census_counts_one_call_per_grouping() -> None:
    """Fewer pairs than experts (the one grouping program): distinct experts, and one call."""
    from reference_engine.kernels import moe

    census = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    moe.group_pairs(torch.tensor([[1, 5], [5, 6]], device=DEVICE), 8, census)
    assert census.tolist() == [3, 1]
    moe.group_pairs(torch.tensor([[0, 7]], device=DEVICE), 8, census)
    assert census.tolist() == [5, 2]


def test_routing_and_experts_read_transposed_inputs_by_value() -> None:
    """Router logits and tokens laid out column-major (a transposed buffer)."""
    from reference_engine.kernels import moe

    tokens, n_experts, hidden, inter = 5, 6, 24, 16
    logits = rand(n_experts, tokens, seed=50).T
    assert not logits.is_contiguous()
    got_w, got_ids = moe.route_experts(logits, 2, True)
    want_w, want_ids = ref.route_experts(logits, 2, True)
    assert torch.equal(got_ids, want_ids)
    assert_rows_close(got_w, want_w)
    x = rand(hidden, tokens, seed=51).T
    gate_up = rand(n_experts, 2 * inter, hidden, seed=52) * hidden**-0.5
    down = rand(n_experts, hidden, inter, seed=53) * inter**-0.5
    got = moe.experts(x, want_w, want_ids, gate_up, down)
    assert_rows_close(got, ref.experts(x.contiguous(), want_w, want_ids, gate_up, down), tol=1e-4)


# ----------------------------------------------------------------------------- gated delta rule
def test_the_gated_delta_rule_refuses_what_it_cannot_run() -> None:
    from reference_engine.kernels.gated_delta import gated_delta

    q, k, v, g, beta, state = delta_inputs(batch=1, T=5, heads=1, dk=16, dv=8)
    with pytest.raises(ValueError, match="every must be >= 1 with states_out, got 0"):
        gated_delta(q, k, v, g, beta, state, states_out=torch.empty(1, 5, 1, 16, 8, device=DEVICE), every=0)
    with pytest.raises(ValueError, match=r"states_out holds \(1, 4\) states, expected \(1, 3\)"):
        gated_delta(q, k, v, g, beta, state, states_out=torch.empty(1, 4, 1, 16, 8, device=DEVICE), every=2)
    with pytest.raises(ValueError, match="keep_final False leaves a slot state alone; give slots"):
        gated_delta(q, k, v, g, beta, state, keep_final=False)
    with pytest.raises(ValueError, match="the state is kept in float32"):
        gated_delta(q, k, v, g, beta, state.double())
    strided = torch.zeros(2, 1, 8, 16, device=DEVICE).transpose(-1, -2)
    with pytest.raises(ValueError, match="updated in place must be contiguous"):
        gated_delta(q, k, v, g, beta, strided, slots=torch.tensor([1], device=DEVICE))


def test_a_resume_refuses_states_it_cannot_update_in_place() -> None:
    from reference_engine.kernels.gated_delta import gated_delta_resume

    q, k, v, g, beta, init = delta_inputs(batch=1, T=3, heads=1, dk=16, dv=8)
    state = torch.zeros(2, 1, 16, 8, device=DEVICE)
    rows = (
        torch.tensor([0], device=DEVICE),
        torch.tensor([0], device=DEVICE),
        torch.tensor([2], device=DEVICE),
    )
    with pytest.raises(ValueError, match="the states are kept in float32"):
        gated_delta_resume(q, k, v, g, beta, init.double(), *rows, 2, state, torch.tensor([1], device=DEVICE))
    with pytest.raises(ValueError, match="the states must be contiguous"):
        strided = torch.zeros(1, 1, 8, 16, device=DEVICE).transpose(-1, -2)
        gated_delta_resume(q, k, v, g, beta, strided, *rows, 2, state, torch.tensor([1], device=DEVICE))


def _mixed(batch: int = 1, T: int = 2, k_heads: int = 1, k_dim: int = 16, heads: int = 2, v_dim: int = 8):
    C = 2 * k_heads * k_dim + heads * v_dim
    mixed = rand(batch, T, C, seed=60).transpose(1, 2)  # token-major, as the conv writes it
    a, b = rand(batch, T, heads, seed=61), rand(batch, T, heads, seed=62)
    return mixed, a, b, rand(heads, seed=63), rand(heads, seed=64)


def test_gated_delta_inputs_refuse_strided_heads_and_unfit_buffers() -> None:
    from reference_engine.kernels.gated_delta import gated_delta_inputs

    mixed, a, b, A_log, dt_bias = _mixed()
    for name in ("a", "b"):
        given = {"a": a, "b": b}
        given[name] = given[name].transpose(-1, -2).contiguous().transpose(-1, -2)
        with pytest.raises(ValueError, match="a's and b's heads must be contiguous"):
            gated_delta_inputs(mixed, given["a"], given["b"], A_log, dt_bias, 1, 16, 8)
    shapes = ((1, 2, 2, 16), (1, 2, 2, 16), (1, 2, 2, 8), (1, 2, 2), (1, 2, 2))
    good = [torch.empty(s, device=DEVICE) for s in shapes]
    bad_k = torch.empty(1, 2, 16, 2, device=DEVICE).transpose(-1, -2)  # right shape, not contiguous
    bad_g = torch.empty(1, 2, 2, dtype=torch.float64, device=DEVICE)
    bad_v = torch.empty(1, 2, 2, 9, device=DEVICE)
    for i, bad, name in ((1, bad_k, "k"), (3, bad_g, "g"), (2, bad_v, "v")):
        out = list(good)
        out[i] = bad
        with pytest.raises(ValueError, match=f"out {name} must be contiguous float32"):
            gated_delta_inputs(mixed, a, b, A_log, dt_bias, 1, 16, 8, out=tuple(out))


def test_the_conv_step_refuses_a_record_too_short_or_of_another_dtype() -> None:
    from reference_engine.kernels.gated_delta import causal_conv_step

    batch, T, C, kernel = 1, 3, 4, 4
    x = rand(batch, T, C, seed=65)
    weight = rand(C, 1, kernel, seed=66)
    slots = torch.tensor([0], device=DEVICE)
    for record in (
        torch.zeros(1, C, kernel - 1 + T - 1, device=DEVICE),
        torch.zeros(1, C, T, device=DEVICE),
        torch.zeros(1, C, 9, device=DEVICE).double(),
    ):
        conv_state = torch.zeros(1, C, kernel - 1, device=DEVICE)
        with pytest.raises(ValueError, match="causal_conv_step: record must be"):
            causal_conv_step(x, conv_state, slots, weight, record=record)
    record = torch.zeros(1, C, kernel - 1 + T, device=DEVICE)
    conv_state = rand(1, C, kernel - 1, seed=67)
    want_state, want_record = conv_state.clone(), torch.zeros_like(record)
    got = causal_conv_step(x, conv_state, slots, weight, record=record)
    want = ref.causal_conv_step(x, want_state, slots, weight, record=want_record)
    assert_rows_close(got, want)
    assert torch.equal(record, want_record) and torch.equal(conv_state, want_state)


# ----------------------------------------------------------------------------- the switch
def test_the_switch_picks_by_device_and_dtype() -> None:
    """Each dtype the exact numerics run defaults to them on CUDA and takes the fast ones when
    asked; float64 on CUDA is `fast`, which runs the references, and refused as `exact`; a
    device other than CUDA runs the references whatever is asked."""
    from reference_engine import kernels

    for dtype in kernels.EXACT_DTYPES:
        assert kernels.default_numerics("cuda", dtype) == "exact"
        assert kernels.default_numerics("cpu", dtype) == "fast"
        assert kernels.select(None, "cuda", dtype).name == "triton"
        assert kernels.select("fast", "cuda:0", dtype).name == "vendor"
    assert kernels.default_numerics("cuda", torch.float64) == "fast"
    assert kernels.select("fast", "cuda", torch.float64) is kernels.TORCH
    assert kernels.select("exact", "meta", torch.float32) is kernels.TORCH  # no CUDA: the references
    with pytest.raises(ValueError, match="exact numerics runs bfloat16, float16 or float32 models"):
        kernels.select("exact", "cuda", torch.float64)


def test_the_fast_table_takes_argmax_and_products_from_pytorch_and_is_capturable() -> None:
    from reference_engine.kernels.triton_ops import TRITON, VENDOR

    assert VENDOR.greedy is ref.greedy and VENDOR.linear is ref.linear
    assert TRITON.greedy is not ref.greedy and TRITON.linear is not ref.linear
    assert TRITON.capturable and VENDOR.capturable


def test_the_switch_refuses_an_empty_numerics_name() -> None:
    """None asks for the default; an empty name is no numerics and is refused by name."""
    from reference_engine import kernels

    with pytest.raises(ValueError, match="numerics must be one of exact, fast, got ''"):
        kernels.select("", "cpu", torch.float32)


# ----------------------------------------------------------------------------- references
def test_the_references_accumulate_half_types_in_float32_and_never_downcast() -> None:
    assert ref.accumulation_dtype(torch.bfloat16) == ref.accumulation_dtype(torch.float16) == torch.float32
    assert ref.accumulation_dtype(torch.float32) == torch.float32
    assert ref.accumulation_dtype(torch.float64) == torch.float64
    x = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert ref.rms_norm(x, torch.ones(8, dtype=torch.float64), 1e-6, False).dtype == torch.float64


def test_the_reference_greedy_by_chunks_gives_vocab_for_a_row_holding_a_nan() -> None:
    """A vocabulary of whole chunks (the CPU's chunked search): a NaN anywhere gives `vocab`,
    in rows laid out either way."""
    V = 4 * ref.GREEDY_CHUNK
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    logits[1, 70] = float("nan")
    assert ref.greedy(logits).tolist()[1] == V
    assert ref.greedy(logits.T.contiguous().T).tolist()[1] == V


def test_the_reference_recurrence_refuses_a_checkpoint_spacing_below_one() -> None:
    q, k, v, g, beta, state = delta_inputs(batch=1, T=3, heads=1, dk=16, dv=8)
    with pytest.raises(ValueError, match="every must be >= 1 with states_out, got 0"):
        ref.gated_delta(
            q, k, v, g, beta, state, states_out=torch.empty(1, 3, 1, 16, 8, device=DEVICE), every=0
        )
