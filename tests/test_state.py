"""TargetState: rollback by length (dense), save / restore (hybrid), reset, and independence
of slots. "Fresh run" below means a new state that ran the same token sequence through the
same calls (one prefill, then one decode step per token), so logits must match bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_target
from reference_engine.errors import RequestError
from reference_engine.models import CausalLM
from reference_engine.runtime.decode import decode_step, new_state, prefill
from reference_engine.runtime.state import TargetState

PROMPT = [17, 301, 5, 88, 260, 42, 7, 199, 33, 410]
FIRST = [12, 250, 3, 77, 480, 9, 64, 321]  # decoded, then partly rolled back
SECOND = [500, 2, 144, 38, 91, 270]  # decoded after the rollback
MAX_LEN = 64


@pytest.fixture(scope="module")
def dense(qwen3_checkpoint: Path) -> CausalLM:
    return load_target(qwen3_checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def hybrid(qwen3_5_checkpoint: Path) -> CausalLM:
    return load_target(qwen3_5_checkpoint, dtype=torch.float32)


def decode_all(model: CausalLM, state: TargetState, slot: int, tokens: list[int]) -> torch.Tensor:
    """One decode step per token. [len(tokens), vocab]"""
    logits = [decode_step(model, state, slot, t) for t in tokens]
    return torch.stack(logits) if logits else torch.empty(0, model.config.vocab_size)


def fresh_run(model: CausalLM, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    """Prefill PROMPT, decode `prefix`, then return the logits of decoding `tokens`."""
    state = new_state(model, MAX_LEN)
    prefill(model, state, 0, PROMPT)
    decode_all(model, state, 0, prefix)
    return decode_all(model, state, 0, tokens)


@pytest.mark.parametrize("kept", [0, 1, 5, len(FIRST) - 1, len(FIRST)])
def test_dense_rollback_to_any_shorter_length_then_decode_equals_fresh_run(
    dense: CausalLM, kept: int
) -> None:
    state = new_state(dense, MAX_LEN)
    prefill(dense, state, 0, PROMPT)
    decode_all(dense, state, 0, FIRST)
    assert state.lengths[0] == len(PROMPT) + len(FIRST)

    state.rollback(0, len(PROMPT) + kept)
    assert state.lengths[0] == len(PROMPT) + kept
    after = decode_all(dense, state, 0, SECOND)
    assert torch.equal(after, fresh_run(dense, FIRST[:kept], SECOND))


def test_dense_rollback_into_the_prompt_then_decode_equals_fresh_run(dense: CausalLM) -> None:
    # rows 0..5 were written by a 10-token prefill; the fresh run writes them with a 6-token
    # prefill, so compare in float64 to tolerance rather than bit for bit
    model = load_target(dense.source_path, dtype=torch.float64)
    state = new_state(model, MAX_LEN)
    prefill(model, state, 0, PROMPT)
    decode_all(model, state, 0, FIRST)
    state.rollback(0, 6)
    after = decode_all(model, state, 0, SECOND)

    fresh = new_state(model, MAX_LEN)
    prefill(model, fresh, 0, PROMPT[:6])
    torch.testing.assert_close(after, decode_all(model, fresh, 0, SECOND), rtol=0, atol=1e-12)


def test_dense_rollback_to_zero_then_decode_equals_decoding_from_an_empty_state(
    dense: CausalLM,
) -> None:
    state = new_state(dense, MAX_LEN)
    prefill(dense, state, 0, PROMPT)
    state.rollback(0, 0)
    after = decode_all(dense, state, 0, SECOND)
    assert torch.equal(after, decode_all(dense, new_state(dense, MAX_LEN), 0, SECOND))


@pytest.mark.parametrize("saved_after", [0, 3, len(FIRST) - 1])
def test_hybrid_rollback_to_saved_length_then_decode_equals_fresh_run(
    hybrid: CausalLM, saved_after: int
) -> None:
    state = new_state(hybrid, MAX_LEN)
    prefill(hybrid, state, 0, PROMPT)
    decode_all(hybrid, state, 0, FIRST[:saved_after])
    state.save(0)
    decode_all(hybrid, state, 0, FIRST[saved_after:])

    state.rollback(0, len(PROMPT) + saved_after)
    assert state.lengths[0] == len(PROMPT) + saved_after
    after = decode_all(hybrid, state, 0, SECOND)
    assert torch.equal(after, fresh_run(hybrid, FIRST[:saved_after], SECOND))


def test_hybrid_replay_after_rollback_reproduces_the_rolled_back_logits(
    hybrid: CausalLM,
) -> None:
    state = new_state(hybrid, MAX_LEN)
    prefill(hybrid, state, 0, PROMPT)
    state.save(0)
    first_time = decode_all(hybrid, state, 0, FIRST)
    state.rollback(0, len(PROMPT))
    assert torch.equal(decode_all(hybrid, state, 0, FIRST), first_time)
    # the saved copy survives a restore: a second rollback to the same length works too
    state.rollback(0, len(PROMPT))
    assert torch.equal(decode_all(hybrid, state, 0, FIRST), first_time)


def test_hybrid_rollback_to_unsaved_length_is_refused(hybrid: CausalLM) -> None:
    state = new_state(hybrid, MAX_LEN)
    prefill(hybrid, state, 0, PROMPT)
    with pytest.raises(RequestError, match=r"saved length None, not 5"):
        state.rollback(0, 5)
    state.save(0)
    decode_all(hybrid, state, 0, FIRST)
    with pytest.raises(RequestError, match=rf"saved length {len(PROMPT)}, not {len(PROMPT) + 2}"):
        state.rollback(0, len(PROMPT) + 2)
    assert state.lengths[0] == len(PROMPT) + len(FIRST)


def test_hybrid_rollback_to_the_current_length_needs_no_save(hybrid: CausalLM) -> None:
    state = new_state(hybrid, MAX_LEN)
    prefill(hybrid, state, 0, PROMPT)
    state.rollback(0, len(PROMPT))
    assert torch.equal(decode_all(hybrid, state, 0, SECOND), fresh_run(hybrid, [], SECOND))


@pytest.mark.parametrize("model_name", ["dense", "hybrid"])
@pytest.mark.parametrize("length", [len(PROMPT) + 1, -1])
def test_rollback_outside_zero_to_current_length_is_refused(
    request: pytest.FixtureRequest, model_name: str, length: int
) -> None:
    model = request.getfixturevalue(model_name)
    state = new_state(model, MAX_LEN)
    prefill(model, state, 0, PROMPT)
    state.save(0)
    with pytest.raises(RequestError, match=rf"back to length {length}: it holds {len(PROMPT)}"):
        state.rollback(0, length)
    assert state.lengths[0] == len(PROMPT)


@pytest.mark.parametrize("method", ["save", "reset"])
@pytest.mark.parametrize("slot", [2, -1])
def test_slot_out_of_range_is_refused(dense: CausalLM, method: str, slot: int) -> None:
    state = new_state(dense, MAX_LEN, num_slots=2)
    with pytest.raises(RequestError, match=rf"slot {slot} out of range \[0, 2\)"):
        getattr(state, method)(slot)
    with pytest.raises(RequestError, match=rf"slot {slot} out of range"):
        state.rollback(slot, 0)


@pytest.mark.parametrize("model_name", ["dense", "hybrid"])
def test_slots_are_independent(request: pytest.FixtureRequest, model_name: str) -> None:
    model = request.getfixturevalue(model_name)
    alone = new_state(model, MAX_LEN)
    expected_prefill, _ = prefill(model, alone, 0, PROMPT)
    expected = decode_all(model, alone, 0, FIRST)

    shared = new_state(model, MAX_LEN, num_slots=3)
    prefill(model, shared, 2, SECOND)  # a neighbour before
    got_prefill, _ = prefill(model, shared, 1, PROMPT)
    assert torch.equal(got_prefill, expected_prefill)
    got = []
    for i, token in enumerate(FIRST):
        # interleave another request on slot 2, with its own save and rollback
        shared.save(2)
        decode_step(model, shared, 2, FIRST[-1 - i])
        shared.rollback(2, shared.saved_lengths[2])
        decode_step(model, shared, 0, token)  # and one on slot 0
        got.append(decode_step(model, shared, 1, token))
    assert torch.equal(torch.stack(got), expected)


@pytest.mark.parametrize("model_name", ["dense", "hybrid"])
def test_prefill_into_a_used_slot_equals_a_fresh_state(
    request: pytest.FixtureRequest, model_name: str
) -> None:
    model = request.getfixturevalue(model_name)
    used = new_state(model, MAX_LEN)
    prefill(model, used, 0, SECOND)
    decode_all(model, used, 0, FIRST)
    used.save(0)
    logits, _ = prefill(model, used, 0, PROMPT)  # resets the slot first
    assert used.lengths[0] == len(PROMPT)
    assert used.saved_lengths[0] is None

    fresh = new_state(model, MAX_LEN)
    fresh_logits, _ = prefill(model, fresh, 0, PROMPT)
    assert torch.equal(logits, fresh_logits)
    assert torch.equal(decode_all(model, used, 0, SECOND), decode_all(model, fresh, 0, SECOND))


def test_reset_zeroes_the_hybrid_state_and_forgets_the_save(hybrid: CausalLM) -> None:
    state = new_state(hybrid, MAX_LEN, num_slots=2)
    prefill(hybrid, state, 0, PROMPT)
    prefill(hybrid, state, 1, PROMPT)
    state.save(0)
    state.reset(0)
    assert state.lengths[0] == 0 and state.saved_lengths[0] is None
    for layer in hybrid.config.linear_layers:
        assert not state.conv[layer][0].any() and not state.recurrent[layer][0].any()
        assert state.conv[layer][1].any() and state.recurrent[layer][1].any()
    assert state.lengths[1] == len(PROMPT)


def test_reset_slots_zeroes_those_slots_alone(hybrid: CausalLM) -> None:
    """The admitted requests' slots at once (one fill a state tensor): each is zeroed and its
    save forgotten, and a slot not named keeps its state."""
    state = new_state(hybrid, MAX_LEN, num_slots=4)
    for slot in range(4):
        prefill(hybrid, state, slot, PROMPT)
    state.save_rows([0, 1, 2, 3])
    state.reset_slots([3, 0, 2])
    for slot in (0, 2, 3):
        assert state.lengths[slot] == 0 and state.saved_lengths[slot] is None
    assert state.lengths[1] == len(PROMPT) and state.saved_lengths[1] == len(PROMPT)
    for layer in hybrid.config.linear_layers:
        for slot in (0, 2, 3):
            assert not state.conv[layer][slot].any() and not state.recurrent[layer][slot].any()
        assert state.conv[layer][1].any() and state.recurrent[layer][1].any()
    state.reset_slots([])  # a step that admits nobody
    assert state.lengths[1] == len(PROMPT)
    with pytest.raises(RequestError):
        state.reset_slots([1, 4])


def test_state_allocates_kv_for_attention_layers_and_recurrent_state_for_linear_layers(
    hybrid: CausalLM,
) -> None:
    c = hybrid.config
    state = TargetState(c, num_slots=3, max_len=20, dtype=torch.bfloat16)
    for i in range(c.num_hidden_layers):
        if i in c.attention_layers:
            assert state.k_cache[i].shape == (3, 20, c.num_key_value_heads, c.head_dim)
            assert state.k_cache[i].dtype == torch.bfloat16
            assert state.conv[i] is None and state.recurrent[i] is None
        else:
            assert state.k_cache[i] is None and state.v_cache[i] is None
            assert state.conv[i].shape == (3, c.conv_dim, c.linear_conv_kernel_dim - 1)
            assert state.recurrent[i].shape == (
                3,
                c.linear_num_value_heads,
                c.linear_key_head_dim,
                c.linear_value_head_dim,
            )
            # half-precision models accumulate the recurrent state in float32
            assert state.recurrent[i].dtype == torch.float32
            assert state.saved_recurrent[i].dtype == torch.float32
    assert state.lengths == [0, 0, 0] and state.saved_lengths == [None, None, None]


def test_saving_and_restoring_several_slots_at_once_touches_only_those(qwen3_5_checkpoint) -> None:
    model = load_target(qwen3_5_checkpoint, dtype=torch.float64)
    state = TargetState(model.config, 4, 16, torch.float64)
    layer = model.config.linear_layers[0]
    for tensor in (state.conv[layer], state.recurrent[layer]):
        tensor.copy_(torch.randn_like(tensor))
    state.lengths[:] = [3, 5, 7, 9]
    before = {n: t.clone() for n, t in (("conv", state.conv[layer]), ("rec", state.recurrent[layer]))}
    state.save_rows([1, 3])
    assert state.saved_lengths == [None, 5, None, 9]
    for tensor in (state.conv[layer], state.recurrent[layer]):
        tensor.add_(1.0)
    state.restore_rows([3, 1])
    for name, tensor in (("conv", state.conv[layer]), ("rec", state.recurrent[layer])):
        assert torch.equal(tensor[[1, 3]], before[name][[1, 3]])
        assert torch.equal(tensor[[0, 2]], before[name][[0, 2]] + 1.0)


def test_small_step_inputs_reach_the_device_as_plain_tensors_off_cuda() -> None:
    from reference_engine.runtime.transfer import to_device

    t = to_device([[1, 2], [3, 4]], "cpu")
    assert t.dtype == torch.int64 and t.tolist() == [[1, 2], [3, 4]] and t.device.type == "cpu"


@pytest.mark.parametrize("T", [2, 8])
def test_per_token_buffers_put_a_row_at_the_same_place_for_any_row_count(hybrid: CausalLM, T: int) -> None:
    """A CUDA graph's verify writes the per_token checkpoints and inputs for its padded bucket
    of rows; an eager commit after it reads them for the step's real rows: row i's views must
    be the same memory either way, for every one of q, k, v, g, beta and the checkpoints."""
    state = TargetState(hybrid.config, 5, MAX_LEN, torch.float32, "cpu", 8, "per_token", every=3)
    layer = hybrid.config.linear_layers[0]
    written = [*state.verify_inputs_of(layer, 4, T), state.verify_states_of(layer, 4, T)]
    for i, view in enumerate(written):
        view.copy_(torch.arange(view.numel(), dtype=view.dtype).view_as(view) + 1000 * i)
    read = [*state.verify_inputs_of(layer, 3, T), state.verify_states_of(layer, 3, T)]
    for i, (wide, narrow) in enumerate(zip(written, read)):
        assert torch.equal(narrow, wide[:3]), f"view {i} of 5 moved with the row count"


def test_per_token_checkpoint_spacing_must_be_positive_and_counts_whole_states() -> None:
    """kept_states: ceil(T / every) states, and a spacing below 1 is a ValueError naming it."""
    from reference_engine.runtime.state import kept_states

    assert [kept_states(T, 3) for T in (1, 3, 4, 8)] == [1, 1, 2, 3]
    with pytest.raises(ValueError, match="every must be >= 1, got 0"):
        kept_states(8, 0)


def test_the_per_token_checkpoints_run_on_the_triton_dtypes_of_cuda_alone() -> None:
    """checkpoint_every: PER_TOKEN_EVERY where the Triton kernel runs (CUDA in bfloat16,
    float16 or float32), NO_CHECKPOINTS on the references (the CPU, or CUDA in float64)."""
    from reference_engine.runtime.state import NO_CHECKPOINTS, PER_TOKEN_EVERY, checkpoint_every

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert checkpoint_every("cuda", dtype) == PER_TOKEN_EVERY
        assert checkpoint_every("cpu", dtype) == NO_CHECKPOINTS
    assert checkpoint_every("cuda:0", torch.float64) == NO_CHECKPOINTS


def test_a_verify_longer_than_the_per_token_buffers_is_refused(hybrid: CausalLM) -> None:
    """The per_token views are sized for `verify_len` tokens and `num_slots` rows: a verify
    of more tokens, or of more rows, is refused rather than read past its region."""
    state = TargetState(hybrid.config, 3, MAX_LEN, torch.float32, "cpu", 4, "per_token", every=2)
    layer = hybrid.config.linear_layers[0]
    assert state.verify_inputs_of(layer, 3, 4)[0].shape[:2] == (3, 4)
    for rows, T in ((3, 5), (4, 4)):
        for view in (state.verify_inputs_of, state.verify_states_of):
            with pytest.raises(RuntimeError, match=f"a verify of {rows} rows and {T} tokens does not fit"):
                view(layer, rows, T)


def test_a_pool_for_another_room_is_refused(dense: CausalLM) -> None:
    """A pooled state's rows span the pool's room: a pool laid out for another room than the
    state's max_len is refused."""
    from reference_engine.runtime.kv_pool import PoolLayout

    pool = PoolLayout(cells=4, cell_tokens=16, room=MAX_LEN)
    assert TargetState(dense.config, 2, MAX_LEN, torch.float32, "cpu", pool=pool).cell_of.tolist() == [4, 4]
    with pytest.raises(ValueError, match=f"a pool for rooms of {MAX_LEN} tokens in a state of {MAX_LEN + 8}"):
        TargetState(dense.config, 2, MAX_LEN + 8, torch.float32, "cpu", pool=pool)
