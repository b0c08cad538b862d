"""The Triton kernels (reference_engine/kernels/) on shapes the other kernel tests leave out,
each against its PyTorch reference (kernels/reference.py) or against its own bits:

- SwiGLU over rows longer than one column block (1024), gate and up column views of one
  fused projection;
- the experts' slot sum over a hidden size longer than one sum block (1024), with the
  layer's residual;
- attention with a query group (query heads per kv head) that does not divide a tile of 16
  rows, so that a tile ends inside a token's heads: every row equals the reference and a
  query alone gets the bits it gets inside its verify block or prefill chunk, over one split
  and over splits of 64;
- the gated delta rule with a key dim that is not a power of two (the state tile's masked
  rows), rows of different valid lengths, per-token states and slot states in place;
- the gated delta inputs with a key dim that is not a power of two, read from the conv's
  output in its token-major layout; and the decay g = -exp(A_log) * softplus(a + dt_bias)
  to float32 precision where a + dt_bias is very negative (F.softplus is log1p(exp(x)));
- greedy argmax over vocabularies smaller than one block, of one whole block, and of whole
  first-pass chunks, with the maximum at a chunk's last id and ties across a chunk edge;
- empty inputs the kernels return empty results for, which the references and SwiGLU must
  take as well: the gated delta rule over no rows and over no tokens, attention over no
  queries, SwiGLU over rows of no columns.

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


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, dims: int = 1, tol: float = 2e-5) -> None:
    """Every row (the last `dims` axes) within `tol` of its own, relative: one wrong row among
    many must not hide inside a tolerance over the whole tensor."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all(), "non-finite output (an unwritten or misread element)"
    g, w = got.double().flatten(-dims), want.double().flatten(-dims)
    err = (g - w).norm(dim=-1) / w.norm(dim=-1).clamp(min=1e-30)
    assert (err < tol).all(), f"rows over {tol:g}: {(err >= tol).nonzero().tolist()}"


# ----------------------------------------------------------------------------- SwiGLU
def test_swiglu_over_rows_longer_than_one_column_block() -> None:
    """A row of 1024 + 40 columns spans two column blocks, the second ragged: every column of
    every row is silu(gate) * up, read from the two column ranges of one fused projection."""
    from reference_engine.kernels.norms import silu_mul

    n = 1024 + 40
    fused = rand(3, 2, 2 * n, seed=1)
    gate, up = fused.split([n, n], dim=-1)
    got = silu_mul(gate, up)
    assert got.shape == (3, 2, n)
    assert_rows_close(got, ref.silu_mul(gate, up))
    assert torch.equal(got, silu_mul(gate.contiguous(), up.contiguous()))
    # the second block alone is what the columns past 1024 are
    assert_rows_close(got[..., 1024:], ref.silu_mul(gate[..., 1024:], up[..., 1024:]))


def test_swiglu_over_rows_of_no_columns_gives_an_empty_result() -> None:
    from reference_engine.kernels.norms import silu_mul

    gate = up = torch.zeros(3, 0, device=DEVICE)
    assert ref.silu_mul(gate, up).shape == (3, 0)
    assert silu_mul(gate, up).shape == (3, 0)


# ----------------------------------------------------------------------------- experts
def test_the_experts_slot_sum_covers_a_hidden_size_longer_than_one_sum_block() -> None:
    """hidden = 1024 + 8: each token's slots and its residual are summed over every column,
    the ragged second block included, as the per-expert loop sums them."""
    from reference_engine.kernels import moe

    hidden, inter, experts, tokens = moe.SUM_BLOCK + 8, 8, 4, 3
    x = rand(tokens, hidden, seed=2)
    gate_up = rand(experts, 2 * inter, hidden, seed=3) * hidden**-0.5
    down = rand(experts, hidden, inter, seed=4) * inter**-0.5
    weights, ids = ref.route_experts(rand(tokens, experts, seed=5), 2, True)
    residual = rand(tokens, hidden, seed=6) * 4
    for res in (None, residual):
        got = moe.experts(x, weights, ids, gate_up, down, residual=res)
        want = ref.experts(x, weights, ids, gate_up, down, residual=res)
        assert_rows_close(got, want)
        assert_rows_close(got[:, moe.SUM_BLOCK :], want[:, moe.SUM_BLOCK :])


# ----------------------------------------------------------------------------- attention
def group_cache(slots: int, length: int, kv_heads: int = 2, dim: int = 16):
    return rand(slots, length, kv_heads, dim, seed=11), rand(slots, length, kv_heads, dim, seed=12)


@pytest.mark.parametrize("split", [64, 2048], ids=["splits-of-64", "one-split"])
@pytest.mark.parametrize("T", [1, 7, 16, 20], ids=["decode", "verify-7", "verify-16", "prefill"])
def test_attention_with_a_query_group_that_does_not_divide_a_tile(split: int, T: int) -> None:
    """6 query heads over 2 kv heads (3 a group): tile rows are t * 3 + g, so a tile of 16
    rows ends inside a token's group. Every query row equals the reference, each row of the
    batch at its own positions and slot."""
    from reference_engine.kernels.attention import attention

    k_cache, v_cache = group_cache(3, 200)
    positions = torch.stack([torch.arange(150, 150 + T), torch.arange(60, 60 + T)]).to(DEVICE)
    slots = torch.tensor([2, 0], device=DEVICE)
    q = rand(2, T, 6, 16, seed=13)
    args = (q, k_cache, v_cache, slots, positions, 150 + T, 0.3)
    assert_rows_close(attention(*args, split=split), ref.attention(*args), dims=2)


def test_a_query_of_a_group_that_does_not_divide_a_tile_gets_the_same_bits_alone() -> None:
    """The same group of 3: the query at position 200 decoded alone (its 3 rows in tile 0),
    inside a verify block of 15 (rows 15..17: the end of tile 0 and the start of tile 1) and
    inside a prefill chunk, over splits of 64 and over one split, gets the same bits."""
    from reference_engine.kernels.attention import attention

    k_cache, v_cache = group_cache(2, 260)
    slots = torch.tensor([1], device=DEVICE)
    q = rand(1, 40, 6, 16, seed=14)
    prefill = torch.arange(170, 210, device=DEVICE)[None]  # position 200 is row 30
    for split in (64, 2048):
        chunk = attention(q, k_cache, v_cache, slots, prefill, 210, 0.3, split=split)
        alone = attention(q[:, 30:31], k_cache, v_cache, slots, prefill[:, 30:31], 201, 0.3, split=split)
        block = attention(q[:, 25:40], k_cache, v_cache, slots, prefill[:, 25:40], 210, 0.3, split=split)
        assert torch.equal(alone[0, 0], chunk[0, 30]), split
        assert torch.equal(block[0, 5], chunk[0, 30]), split


@pytest.mark.parametrize(("causal", "valid"), [(True, None), (False, None), (False, [1])])
def test_attention_over_no_queries_gives_an_empty_result(causal: bool, valid) -> None:
    from reference_engine.kernels.attention import attention

    k_cache, v_cache = group_cache(2, 16)
    q = torch.zeros(1, 0, 4, 16, device=DEVICE)
    slots = torch.tensor([1], device=DEVICE)
    positions = torch.zeros(1, 0, dtype=torch.int64, device=DEVICE)
    valid_len = torch.tensor(valid, device=DEVICE) if valid else None
    args = (q, k_cache, v_cache, slots, positions, 1, 0.3, causal, None, valid_len)
    assert attention(*args).shape == q.shape
    assert ref.attention(*args).shape == q.shape


# ----------------------------------------------------------------------------- gated delta rule
def test_the_gated_delta_rule_with_a_key_dim_that_is_not_a_power_of_two() -> None:
    """k_dim 24 (a state tile of 32 rows, 8 of them masked) and v_dim 20 (one value block of
    32, 12 columns masked), over 3 heads: outputs, the state after every token and the final
    state are the recurrence's, and with slots each row's state is read and written in its
    own slot, the others untouched."""
    from reference_engine.kernels.gated_delta import gated_delta

    batch, T, heads, dk, dv = 2, 5, 3, 24, 20
    q, k, v, g, beta, state = delta_inputs(batch, T, heads, dk, dv)
    valid = torch.tensor([3, 5], device=DEVICE)
    got_states = torch.full((batch, T, heads, dk, dv), float("nan"), device=DEVICE)
    want_states = torch.zeros_like(got_states)
    out, final = gated_delta(q, k, v, g, beta, state, valid, got_states)
    want_out, want_final = ref.gated_delta_recurrent(q, k, v, g, beta, state, valid, want_states)
    assert_rows_close(out, want_out)
    assert_rows_close(final, want_final, dims=2)
    assert_rows_close(got_states, want_states, dims=2)
    slots = torch.tensor([3, 1], device=DEVICE)
    held = rand(4, heads, dk, dv, seed=27)
    held[slots] = state
    before = held.clone()
    in_place, none = gated_delta(q, k, v, g, beta, held, valid, slots=slots)
    assert none is None and torch.equal(in_place, out)
    assert torch.equal(held[slots], final)
    assert torch.equal(held[[0, 2]], before[[0, 2]])


@pytest.mark.parametrize("T", [2, 5])
def test_the_gated_delta_rule_over_no_rows_gives_empty_results(T: int) -> None:
    from reference_engine.kernels.gated_delta import gated_delta

    q, k, v, g, beta, state = delta_inputs(0, T, 2, 16, 8)
    for kernel in (gated_delta, ref.gated_delta):
        out, final = kernel(q, k, v, g, beta, state)
        assert out.shape == (0, T, 2, 8) and final.shape == (0, 2, 16, 8)
        held = rand(3, 2, 16, 8, seed=28)
        before = held.clone()
        out, none = kernel(q, k, v, g, beta, held, slots=torch.zeros(0, dtype=torch.int64, device=DEVICE))
        assert out.shape == (0, T, 2, 8) and none is None
        assert torch.equal(held, before)


def test_the_gated_delta_rule_over_no_tokens_leaves_every_state_as_it_was() -> None:
    """A block of no tokens: no outputs, and the final state is the state given (the kernel
    launches nothing, where its first-token index would be -1); with slots, the slot states
    are untouched."""
    from reference_engine.kernels.gated_delta import gated_delta

    q, k, v, g, beta, state = delta_inputs(2, 0, 2, 16, 8)
    state = rand(2, 2, 16, 8, seed=27)
    for kernel in (gated_delta, ref.gated_delta):
        out, final = kernel(q, k, v, g, beta, state)
        assert out.shape == (2, 0, 2, 8) and torch.equal(final, state)
        held = rand(3, 2, 16, 8, seed=28)
        before = held.clone()
        slots = torch.tensor([2, 0], device=DEVICE)
        out, none = kernel(q, k, v, g, beta, held, slots=slots)
        assert out.shape == (2, 0, 2, 8) and none is None and torch.equal(held, before)


def delta_layer_inputs(batch: int, T: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int):
    """The conv's output as the engine lays it out (token-major: [batch, C, T] over a
    [batch, T, C] buffer), and a and b as column views of one fused projection."""
    channels = 2 * k_heads * k_dim + v_heads * v_dim
    mixed = rand(batch, T, channels, seed=31).transpose(1, 2)
    fused = rand(batch, T, 3 + 2 * v_heads, seed=32)
    a, b = fused[..., 3 : 3 + v_heads], fused[..., 3 + v_heads :]
    A_log, dt_bias = rand(v_heads, seed=33), rand(v_heads, seed=34)
    return mixed, a, b, A_log, dt_bias


def test_gated_delta_inputs_with_a_key_dim_that_is_not_a_power_of_two() -> None:
    """k_dim 24 and v_dim 20 (blocks of 32, the rest masked): each head's q and k are
    L2-normalised over its own 24 channels alone, from the conv's token-major output."""
    from reference_engine.kernels.gated_delta import gated_delta_inputs

    batch, T, k_heads, v_heads, k_dim, v_dim = 2, 3, 2, 4, 24, 20
    mixed, a, b, A_log, dt_bias = delta_layer_inputs(batch, T, k_heads, v_heads, k_dim, v_dim)
    assert mixed.stride(1) == 1
    got = gated_delta_inputs(mixed, a, b, A_log, dt_bias, k_heads, k_dim, v_dim)
    want = ref.gated_delta_inputs(mixed, a, b, A_log, dt_bias, k_heads, k_dim, v_dim)
    for x, w in zip(got, want):
        assert_rows_close(x, w)


def test_the_decay_keeps_float32_precision_where_a_plus_dt_bias_is_very_negative() -> None:
    """g = -exp(A_log) * softplus(a + dt_bias): for a + dt_bias of -8, -12 and -20 softplus is
    e^x to float32 precision, not 0 or e^x with a few digits."""
    from reference_engine.kernels.gated_delta import gated_delta_inputs

    batch, T, k_heads, v_heads, k_dim, v_dim = 1, 3, 1, 2, 16, 8
    mixed, _, b, A_log, _ = delta_layer_inputs(batch, T, k_heads, v_heads, k_dim, v_dim)
    a = torch.tensor([[[-8.0, -12.0], [-20.0, -2.0], [0.5, 3.0]]], device=DEVICE)
    dt_bias = torch.zeros(v_heads, device=DEVICE)
    got = gated_delta_inputs(mixed, a, b, A_log, dt_bias, k_heads, k_dim, v_dim)[3]
    want = ref.gated_delta_inputs(mixed, a, b, A_log, dt_bias, k_heads, k_dim, v_dim)[3]
    assert (want < 0).all()
    assert torch.allclose(got, want, rtol=1e-5, atol=0), (got, want)


# ----------------------------------------------------------------------------- greedy
@pytest.mark.parametrize(
    "V", [3, 100, 2047, 2048], ids=["three", "under-a-block", "a-block-less-one", "one-block"]
)
def test_greedy_over_vocabularies_of_at_most_one_block(V: int) -> None:
    """Vocabularies smaller than a block of 2048 (the block shrinks to the next power of two,
    the rest masked) and of exactly one block: the first maximal id of negative rows, a NaN
    row's `vocab`, and a tie at the last id against an earlier one."""
    from reference_engine.kernels.argmax import greedy

    logits = -rand(4, V, seed=41).abs() - 1.0
    logits[1, V - 1] = 5.0
    logits[2, V - 1] = float("nan")
    logits[3, V - 1] = logits[3, V // 2] = 7.0
    got = greedy(logits)
    assert torch.equal(got, ref.greedy(logits))
    assert got.tolist()[1:] == [V - 1, V, V // 2]


def test_greedy_over_whole_chunks_with_the_maximum_at_a_chunks_edge() -> None:
    """A vocabulary of exactly two first-pass chunks: the maximum at the last id of the first
    chunk, at the last id of the row, and a tie between the last id of one chunk and the
    first of the next."""
    from reference_engine.kernels.argmax import CHUNK_V, greedy

    V = 2 * CHUNK_V
    logits = rand(3, V, seed=42)
    logits[0, CHUNK_V - 1] = 50.0
    logits[1, V - 1] = 50.0
    logits[2, CHUNK_V - 1] = logits[2, CHUNK_V] = 50.0
    got = greedy(logits)
    assert got.tolist() == [CHUNK_V - 1, V - 1, CHUNK_V - 1]
    assert torch.equal(got, ref.greedy(logits))
