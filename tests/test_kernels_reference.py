"""The PyTorch references' gated delta rule (reference_engine/kernels/reference.py): the
chunked form the engine runs for verify blocks and prefill chunks equals the per-token
recurrence (outputs of real tokens, final state, per-token states) with padded rows, more
tokens than a chunk, in float64 and float32; a decode step is the recurrence itself; a
`per_token` verify that keeps the rows its tokens write instead of states (the references'
NO_CHECKPOINTS) lets its commit make the state after any token, bit for bit a rerun's."""

from __future__ import annotations

import pytest
import torch

from reference_engine.kernels.reference import (
    gated_delta,
    gated_delta_after,
    gated_delta_chunked,
    gated_delta_recurrent,
    l2_norm,
)

# float64: rounding only; float32: what the CPU engine runs (the state error of the two
# orders of summation, far below the O(0.1) of a skipped token)
ATOL = {torch.float64: 1e-12, torch.float32: 2e-5}


def delta_inputs(
    batch: int, T: int, dtype: torch.dtype, seed: int = 0, heads: int = 3, k_dim: int = 16, v_dim: int = 24
):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = l2_norm(randn(batch, T, heads, k_dim)) * k_dim**-0.5
    k = l2_norm(randn(batch, T, heads, k_dim))
    g = -torch.rand(batch, T, heads, generator=gen, dtype=torch.float64) * 3
    beta = torch.rand(batch, T, heads, generator=gen, dtype=torch.float64)
    inputs = (q, k, randn(batch, T, heads, v_dim), g, beta, randn(batch, heads, k_dim, v_dim))
    return tuple(x.to(dtype) for x in inputs)


def states_buffer(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    batch, T, heads, k_dim = q.shape
    return torch.full((batch, T, heads, k_dim, v.shape[-1]), float("nan"), dtype=q.dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("T", "chunk", "valid"),
    [
        (2, 64, [1, 2, 2]),  # the smallest verify block
        (8, 64, [8, 1, 5]),  # a B = 8 verify, rows of different lengths
        (16, 64, [0, 16, 9]),  # a row with no real token keeps its state
        (70, 16, [70, 33, 16]),  # more tokens than a chunk: rows end in different chunks
        (45, 64, None),  # a prefill chunk, every token real
    ],
)
def test_chunked_form_equals_the_recurrence_with_padded_rows_and_per_token_states(
    dtype: torch.dtype, T: int, chunk: int, valid: list[int] | None
) -> None:
    q, k, v, g, beta, state = delta_inputs(3, T, dtype)
    valid_len = None if valid is None else torch.tensor(valid)
    want_states, got_states = states_buffer(q, v), states_buffer(q, v)
    want_out, want_final = gated_delta_recurrent(q, k, v, g, beta, state, valid_len, want_states)
    out, final = gated_delta_chunked(q, k, v, g, beta, state, valid_len, got_states, chunk=chunk)
    atol = ATOL[dtype]
    torch.testing.assert_close(final, want_final, rtol=0, atol=atol)
    torch.testing.assert_close(got_states, want_states, rtol=0, atol=atol)  # padded tokens too
    for row, n in enumerate(valid or [T] * 3):  # padded tokens' outputs are unspecified
        torch.testing.assert_close(out[row, :n], want_out[row, :n], rtol=0, atol=atol)
        if n:
            assert torch.equal(final[row], got_states[row, n - 1])
        else:
            assert torch.equal(final[row], state[row])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_final_state_without_per_token_states_is_the_same(dtype: torch.dtype) -> None:
    q, k, v, g, beta, state = delta_inputs(2, 8, dtype, seed=1)
    valid_len = torch.tensor([3, 8])
    with_states = gated_delta_chunked(q, k, v, g, beta, state, valid_len, states_buffer(q, v))
    without = gated_delta_chunked(q, k, v, g, beta, state, valid_len)
    assert torch.equal(without[1], with_states[1])
    assert torch.equal(without[0], with_states[0])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_rerun_over_the_processed_tokens_reaches_the_per_token_state_bit_for_bit(
    dtype: torch.dtype,
) -> None:
    """The `recompute` commit reruns a verify block with fewer real tokens; it must land on
    the very state the `per_token` commit picks from the verify's per-token states."""
    q, k, v, g, beta, state = delta_inputs(3, 8, dtype, seed=2)
    states = states_buffer(q, v)
    gated_delta(q, k, v, g, beta, state, torch.tensor([8, 6, 8]), states)
    processed = torch.tensor([3, 6, 1])
    _, final = gated_delta(q, k, v, g, beta, state, processed)
    assert torch.equal(final, states[torch.arange(3), processed - 1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("valid", [[1, 0, 1, 1], [1, 1, 1, 1]])  # a held row; every row real
def test_a_decode_step_is_one_step_of_the_recurrence(dtype: torch.dtype, valid: list[int]) -> None:
    """Also with every row real (a plain step's verify of the anchor alone), where the step
    skips the hold of rows past their length: the same bits as the recurrence with it."""
    q, k, v, g, beta, state = delta_inputs(4, 1, dtype, seed=3)
    valid_len = torch.tensor(valid)
    got_states, want_states = states_buffer(q, v), states_buffer(q, v)
    out, final = gated_delta(q, k, v, g, beta, state, valid_len, got_states)
    want_out, want_final = gated_delta_recurrent(q, k, v, g, beta, state, valid_len, want_states)
    assert torch.equal(out, want_out) and torch.equal(final, want_final)
    assert torch.equal(got_states, want_states)
    for row, n in enumerate(valid):
        assert torch.equal(final[row], state[row]) == (n == 0)


def test_a_wrong_write_is_seen() -> None:
    """The comparison is sharp: a 10% change in one row's values moves its states."""
    q, k, v, g, beta, state = delta_inputs(2, 8, torch.float32, seed=4)
    _, want = gated_delta_recurrent(q, k, v, g, beta, state)
    v_wrong = v.clone()
    v_wrong[1, 4] *= 1.1
    _, got = gated_delta_chunked(q, k, v_wrong, g, beta, state)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=ATOL[torch.float32])
    assert (got[1] - want[1]).abs().max() > 1e-3


def written_verify(q, k, v, g, beta, state, valid_len):
    """A `per_token` verify of every slot as the references run it (NO_CHECKPOINTS): its
    outputs, and the rows its tokens wrote."""
    batch, T, heads, _ = q.shape
    written = torch.full((batch, heads, T, v.shape[-1]), float("nan"), dtype=q.dtype)
    slots = torch.arange(batch)
    out, _ = gated_delta(
        q, k, v, g, beta, state, valid_len, slots=slots, keep_final=False, written_out=written
    )
    return out, written


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("T", "valid"), [(8, [8, 8, 5, 8]), (2, [2, 1, 2, 2]), (16, [16, 9, 16, 3])])
def test_the_state_after_any_token_from_the_rows_written_is_a_reruns_bit_for_bit(
    dtype: torch.dtype, T: int, valid: list[int]
) -> None:
    """The references' per_token commit (gated_delta_after) against the recompute commit's
    rerun of the block over the processed tokens: the same bits, for every boundary a row can
    keep (rows verified with fewer real tokens included), and the recurrence's state to
    rounding. The verify's outputs are those of a verify that keeps nothing, and it leaves
    the state alone."""
    q, k, v, g, beta, start = delta_inputs(4, T, dtype, seed=5)
    valid_len = torch.tensor(valid)
    state = start.clone()
    out, written = written_verify(q, k, v, g, beta, state, valid_len)
    assert torch.equal(state, start)
    plain_out, _ = gated_delta(q, k, v, g, beta, start, valid_len)
    for row, n in enumerate(valid):
        assert torch.equal(out[row, :n], plain_out[row, :n])
    for shift in range(T):
        processed = torch.tensor([max(1, n - shift) for n in valid])
        got = start.clone()
        gated_delta_after(q, k, v, g, beta, written, processed, got, torch.arange(4))
        _, rerun = gated_delta(q, k, v, g, beta, start, processed)
        assert torch.equal(got, rerun), f"processed {processed.tolist()}"
        _, want = gated_delta_recurrent(q, k, v, g, beta, start, processed)
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL[dtype])


def test_the_state_after_a_token_is_that_tokens_and_goes_where_its_slot_is() -> None:
    """The comparison is sharp: one token more or less moves the state; and each row's state
    lands in its own slot, the other slots untouched."""
    q, k, v, g, beta, start = delta_inputs(3, 8, torch.float64, seed=6)
    _, written = written_verify(q, k, v, g, beta, start, None)
    processed = torch.tensor([3, 6, 1])
    _, want = gated_delta(q, k, v, g, beta, start, processed)
    for wrong in (processed + 1, processed.clamp(min=2) - 1):
        got = start.clone()
        gated_delta_after(q, k, v, g, beta, written, wrong, got, torch.arange(3))
        assert all((got[i] - want[i]).abs().max() > 1e-3 for i in range(3) if wrong[i] != processed[i])
    slots = torch.tensor([4, 0, 2])
    held = torch.randn(5, *start.shape[1:], dtype=start.dtype)
    held[slots] = start
    before = held.clone()
    gated_delta_after(q, k, v, g, beta, written, processed, held, slots)
    assert torch.equal(held[slots], want)
    assert torch.equal(held[[1, 3]], before[[1, 3]])


def test_rows_written_are_kept_for_a_block_of_one_chunk() -> None:
    q, k, v, g, beta, state = delta_inputs(2, 70, torch.float64)
    written = torch.empty(2, 3, 70, 24, dtype=torch.float64)
    with pytest.raises(ValueError, match="block of one chunk"):
        gated_delta_chunked(q, k, v, g, beta, state, chunk=64, written_out=written)
