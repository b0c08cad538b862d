"""Committing a verified block into the target's state (commit.py, state.py, and how
speculative_step.py calls them), on the tiny hybrid Qwen3.5 and dense Qwen3 targets in float64
on the CPU:

- `commit_hybrid` after a recorded verify, for each strategy (`replay`, `per_token` with the
  references' default and with checkpoints every 1, 2 or 3 tokens, `recompute`): each row of a
  batch, in any slot order and keeping its own count of the block, ends with the conv and
  recurrent state a fresh prefill of its committed tokens reaches; slots outside the batch are
  left alone, and a second step from there still lands on the fresh prefill's state.
- the strategies themselves: which names are accepted, which need the state saved before the
  verify, and what the verify keeps (nothing on a dense target, nothing for `replay`).
- `TargetState`: the checkpoint spacing it is built with, the views a `per_token` verify
  writes, save / restore / rollback / reset of some slots and not others, and slot checks
  (restoring a slot outside the state is refused by name, as saving one is); a state for a
  commit strategy that does not exist is refused when it is built.
- the engine: several hybrid requests of one batch, under each strategy and an oracle that makes
  rows accept different counts, give plain greedy decode and, after every commit, the state of a
  fresh prefill of the committed tokens; the dense target's lengths after each commit are the
  committed ones.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.errors import ConfigError, RequestError
from reference_engine.models import CausalLM
from reference_engine.models.dflash import DFlashDraft
from reference_engine.runtime.commit import (
    COMMIT_STRATEGIES,
    check_strategy,
    commit_hybrid,
    needs_snapshot,
    verify_record,
)
from reference_engine.runtime.decode import decode_step, generate_plain, new_state, prefill
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.state import NO_CHECKPOINTS, TargetState

TinyPair = Callable[..., tuple[Path, Path]]
F64 = torch.float64
BLOCK = 8
MAX_LEN = 64
ATOL = 1e-9  # float64: the verify's other matmul shapes move only the last bits
PROMPTS = [[5, 9, 3, 77, 12], [40, 8, 1, 2, 3, 4, 5, 6, 7], [7, 7, 1], [300, 2, 9, 11, 4, 6, 8]]
# (strategy, checkpoint spacing): None is the device's default (NO_CHECKPOINTS on the CPU)
VARIANTS = [
    ("replay", None),
    ("recompute", None),
    ("per_token", None),
    ("per_token", 1),
    ("per_token", 2),
    ("per_token", 3),
]
VARIANT_IDS = [f"{s}-{'default' if e is None else e}" for s, e in VARIANTS]


@pytest.fixture(scope="module")
def hybrid(qwen3_5_checkpoint: Path) -> CausalLM:
    return load_target(qwen3_5_checkpoint, dtype=F64)


@pytest.fixture(scope="module")
def dense(qwen3_checkpoint: Path) -> CausalLM:
    return load_target(qwen3_checkpoint, dtype=F64)


def block_for(slot: int, step: int, T: int) -> list[int]:
    return [(97 * slot + 31 * step + 13 * j + 3) % 500 for j in range(T)]


def prefilled(model: CausalLM, strategy: str, every: int | None, verify_len: int = BLOCK) -> TargetState:
    """A state of len(PROMPTS) + 1 slots, slot i holding PROMPTS[i], the last slot empty."""
    state = TargetState(
        model.config, len(PROMPTS) + 1, MAX_LEN, F64, "cpu", verify_len, strategy, every=every
    )
    for slot, prompt in enumerate(PROMPTS):
        prefill(model, state, slot, prompt)
    return state


@torch.inference_mode()
def verify_and_commit(
    model: CausalLM,
    state: TargetState,
    strategy: str,
    slots: list[int],
    blocks: list[list[int]],
    processed: list[int],
    valid: list[int] | None = None,
) -> None:
    """A speculative step's target side: save where the strategy needs it, one recorded verify
    of every row's block, then the commit of `processed` tokens of each; lengths moved on."""
    T = len(blocks[0])
    starts = torch.tensor([state.lengths[s] for s in slots])
    positions = starts[:, None] + torch.arange(T)
    kv_len = int(starts.max()) + T
    ids = torch.tensor(blocks)
    at = torch.tensor(slots)
    valid_t = torch.tensor(valid if valid is not None else [T] * len(slots))
    if model.config.is_hybrid and needs_snapshot(strategy):
        state.save_rows(slots)
    model(ids, positions, at, state, kv_len, valid_len=valid_t, record=verify_record(strategy, model))
    commit_hybrid(strategy, model, state, list(slots), ids, positions, torch.tensor(processed), kv_len)
    for slot, p in zip(slots, processed):
        state.lengths[slot] += p


def assert_fresh_prefill_state(model: CausalLM, state: TargetState, slot: int, tokens: list[int]) -> None:
    """The slot's committed length, attention rows, conv and recurrent states are those of a
    fresh prefill of `tokens`."""
    assert state.lengths[slot] == len(tokens)
    fresh = new_state(model, MAX_LEN)
    prefill(model, fresh, 0, tokens)
    n = len(tokens)
    for layer in range(model.config.num_hidden_layers):
        if state.k_cache[layer] is not None:
            for got, want in (
                (state.k_cache[layer], fresh.k_cache[layer]),
                (state.v_cache[layer], fresh.v_cache[layer]),
            ):
                torch.testing.assert_close(got[slot, :n], want[0, :n], rtol=0, atol=ATOL)
        else:
            for name in ("conv", "recurrent"):
                got, want = getattr(state, name)[layer][slot], getattr(fresh, name)[layer][0]
                err = (got - want).abs().max().item()
                assert err <= ATOL, f"slot {slot}, layer {layer} {name}: differs by {err:.3g}"


def snapshot(state: TargetState, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for t in (*state.conv, *state.recurrent) if t is not None]


# ------------------------------------------------------------------ commit_hybrid
@pytest.mark.parametrize(("strategy", "every"), VARIANTS, ids=VARIANT_IDS)
def test_each_row_keeps_its_own_count_in_any_slot_order(
    hybrid: CausalLM, strategy: str, every: int | None
) -> None:
    """Rows of one batch in slots 2, 0, 3 keep 1, all, and a middle count of the block; slot 1
    (not in the batch) is left as it was; a second step, other slots and counts, still reaches
    the state of a fresh prefill of each slot's committed tokens."""
    state = prefilled(hybrid, strategy, every)
    committed = {slot: list(p) for slot, p in enumerate(PROMPTS)}
    steps = [([2, 0, 3], [1, BLOCK, 5]), ([3, 1], [BLOCK - 1, 2]), ([0, 2, 1, 3], [4, 7, BLOCK, 1])]
    for step, (slots, processed) in enumerate(steps):
        blocks = [block_for(slot, step, BLOCK) for slot in slots]
        outside = {s: snapshot(state, s) for s in range(len(PROMPTS) + 1) if s not in slots}
        verify_and_commit(hybrid, state, strategy, slots, blocks, processed)
        for slot, block, p in zip(slots, blocks, processed):
            committed[slot] += block[:p]
        for slot, before in outside.items():
            after = snapshot(state, slot)
            assert all(torch.equal(a, b) for a, b in zip(after, before)), (
                f"slot {slot} outside the batch moved"
            )
    for slot, tokens in committed.items():
        assert_fresh_prefill_state(hybrid, state, slot, tokens)


@pytest.mark.parametrize(("strategy", "every"), VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("T", [1, 2, 3])
def test_blocks_shorter_than_the_spacing_commit_the_fresh_prefill_state(
    hybrid: CausalLM, strategy: str, every: int | None, T: int
) -> None:
    """Blocks of 1 to 3 tokens (a plain-sized verify, and blocks narrower than the checkpoint
    spacing), each row keeping its whole block or its anchor alone."""
    state = prefilled(hybrid, strategy, every)
    slots = [1, 3, 0]
    processed = [T, 1, max(1, T - 1)]
    blocks = [block_for(slot, 0, T) for slot in slots]
    verify_and_commit(hybrid, state, strategy, slots, blocks, processed)
    for slot, block, p in zip(slots, blocks, processed):
        assert_fresh_prefill_state(hybrid, state, slot, PROMPTS[slot] + block[:p])


@pytest.mark.parametrize(("strategy", "every"), VARIANTS, ids=VARIANT_IDS)
def test_a_padded_row_commits_its_real_tokens_alone(
    hybrid: CausalLM, strategy: str, every: int | None
) -> None:
    """A row whose block holds fewer real tokens than the verify's width (`valid_len`, the
    rest padding) keeps at most its real ones; its padding leaves no trace."""
    state = prefilled(hybrid, strategy, every)
    slots, valid, processed = [0, 2], [BLOCK, 3], [6, 3]
    blocks = [block_for(slot, 1, BLOCK) for slot in slots]
    verify_and_commit(hybrid, state, strategy, slots, blocks, processed, valid)
    for slot, block, p in zip(slots, blocks, processed):
        assert_fresh_prefill_state(hybrid, state, slot, PROMPTS[slot] + block[:p])


@pytest.mark.parametrize("strategy", COMMIT_STRATEGIES)
def test_the_dense_target_commits_by_length_alone(dense: CausalLM, strategy: str) -> None:
    """A dense target keeps nothing for the commit and `commit_hybrid` leaves it as the verify
    left it: moving the length back is the whole commit, and decoding from there is a fresh
    prefill's decode."""
    assert verify_record(strategy, dense) is None
    state = prefilled(dense, strategy, None)
    slots, processed = [2, 0], [3, BLOCK]
    blocks = [block_for(slot, 0, BLOCK) for slot in slots]
    verify_and_commit(dense, state, strategy, slots, blocks, processed)
    for slot, block, p in zip(slots, blocks, processed):
        tokens = PROMPTS[slot] + block[:p]
        assert_fresh_prefill_state(dense, state, slot, tokens)
        fresh = new_state(dense, MAX_LEN)
        prefill(dense, fresh, 0, tokens)
        torch.testing.assert_close(
            decode_step(dense, state, slot, 11), decode_step(dense, fresh, 0, 11), rtol=0, atol=ATOL
        )


# ------------------------------------------------------------------ the strategies
def test_only_the_known_strategies_are_accepted() -> None:
    assert COMMIT_STRATEGIES == ("replay", "per_token", "recompute")
    for name in COMMIT_STRATEGIES:
        assert check_strategy(name) == name
    for name in ("Replay", "per-token", "", "recompute "):
        with pytest.raises(ConfigError, match="unknown commit strategy"):
            check_strategy(name)
    with pytest.raises(ConfigError, match="unknown commit strategy 'rewind'"):
        EngineConfig(commit_strategy="rewind")


def test_what_each_strategy_saves_and_records(hybrid: CausalLM, dense: CausalLM) -> None:
    """`replay` and `recompute` start again from the state saved before the verify; `per_token`
    keeps its own. A hybrid verify records what the strategy names (nothing for `replay`); a
    dense one records nothing."""
    assert [needs_snapshot(s) for s in COMMIT_STRATEGIES] == [True, False, True]
    assert [verify_record(s, hybrid) for s in COMMIT_STRATEGIES] == [None, "per_token", "recompute"]
    assert [verify_record(s, dense) for s in COMMIT_STRATEGIES] == [None, None, None]


# ------------------------------------------------------------------ TargetState
def test_the_checkpoint_spacing_a_state_is_built_with(hybrid: CausalLM) -> None:
    """`every` given is kept; without it the device's default (NO_CHECKPOINTS on the CPU), and
    a `per_token` state then keeps the rows each token writes instead of states."""
    layer = hybrid.config.linear_layers[0]
    default = TargetState(hybrid.config, 2, MAX_LEN, F64, "cpu", 4, "per_token")
    assert default.every == NO_CHECKPOINTS and default.keeps_written_rows
    assert default.verify_written_of(layer, 2, 4).shape[:3] == (2, hybrid.config.linear_num_value_heads, 4)
    with pytest.raises(RuntimeError, match="per-token states need"):
        default.verify_states_of(layer, 2, 4)
    for every in (1, 3):
        state = TargetState(hybrid.config, 2, MAX_LEN, F64, "cpu", 4, "per_token", every=every)
        assert state.every == every and not state.keeps_written_rows
        assert state.verify_states_of(layer, 2, 4).shape[:2] == (2, -(-4 // every))
        with pytest.raises(RuntimeError, match="the rows written need"):
            state.verify_written_of(layer, 2, 4)
    recompute = TargetState(hybrid.config, 2, MAX_LEN, F64, "cpu", 4, "recompute")
    assert recompute.verify_q[layer] is not None and recompute.verify_conv_of(layer).shape[-1] == 3 + 4
    assert not recompute.keeps_written_rows
    plain = TargetState(hybrid.config, 2, MAX_LEN, F64, "cpu", 4, "replay")
    with pytest.raises(RuntimeError, match="verify recording needs"):
        plain.verify_conv_of(layer)


def test_the_written_rows_are_refused_past_their_room(hybrid: CausalLM) -> None:
    state = TargetState(hybrid.config, 3, MAX_LEN, F64, "cpu", 4, "per_token")
    layer = hybrid.config.linear_layers[0]
    assert state.verify_written_of(layer, 3, 4).shape[0] == 3
    for rows, T in ((3, 5), (4, 4)):
        with pytest.raises(RuntimeError, match=f"a verify of {rows} rows and {T} tokens does not fit"):
            state.verify_written_of(layer, rows, T)


def test_a_per_token_verify_of_fewer_tokens_finds_each_input_where_a_wider_one_put_it(
    hybrid: CausalLM,
) -> None:
    """The recurrence inputs of row i for a verify of T tokens are the first T of the row's
    room: the same memory whatever T, and the five inputs never overlap."""
    state = TargetState(hybrid.config, 3, MAX_LEN, F64, "cpu", 8, "per_token", every=2)
    layer = hybrid.config.linear_layers[0]
    wide = state.verify_inputs_of(layer, 3, 8)
    for i, view in enumerate(wide):
        view.fill_(float(i + 1))
    narrow = state.verify_inputs_of(layer, 2, 5)
    for i, view in enumerate(narrow):
        assert view.shape[:2] == (2, 5)
        assert bool((view == float(i + 1)).all()), f"input {i} of a narrower verify reads another's"


def test_save_and_rollback_of_one_hybrid_slot_leave_the_others(hybrid: CausalLM) -> None:
    """Saving slot 0 tags it with its length alone; rolling it back restores it alone; a slot
    never saved still refuses a rollback to an earlier length."""
    state = new_state(hybrid, MAX_LEN, num_slots=3)
    for slot in range(3):
        prefill(hybrid, state, slot, PROMPTS[slot])
    state.save(0)
    assert state.saved_lengths == [len(PROMPTS[0]), None, None]
    for slot in range(3):
        decode_step(hybrid, state, slot, 21)
    neighbours = {s: snapshot(state, s) for s in (1, 2)}
    state.rollback(0, len(PROMPTS[0]))
    assert state.lengths == [len(PROMPTS[0]), len(PROMPTS[1]) + 1, len(PROMPTS[2]) + 1]
    assert_fresh_prefill_state(hybrid, state, 0, PROMPTS[0])
    for slot, before in neighbours.items():
        assert all(torch.equal(a, b) for a, b in zip(snapshot(state, slot), before))
    with pytest.raises(RequestError, match="saved length None"):
        state.rollback(1, len(PROMPTS[1]))
    assert state.lengths[1] == len(PROMPTS[1]) + 1
    # a later save of another slot keeps slot 0's copy: slot 0 still rolls back to it
    state.save(0)
    decode_step(hybrid, state, 0, 22)
    state.save(2)
    assert state.saved_lengths == [len(PROMPTS[0]), None, len(PROMPTS[2]) + 1]
    state.rollback(0, len(PROMPTS[0]))
    assert_fresh_prefill_state(hybrid, state, 0, PROMPTS[0])


def test_a_reset_slot_forgets_its_save_and_state_and_prefills_like_a_new_one(hybrid: CausalLM) -> None:
    state = prefilled(hybrid, "recompute", None)
    state.save_rows([0, 1])
    state.reset_slots([1])
    assert state.saved_lengths[1] is None and state.lengths[1] == 0
    assert state.saved_lengths[0] == len(PROMPTS[0])
    for layer in hybrid.config.linear_layers:
        assert not state.conv[layer][1].any() and not state.recurrent[layer][1].any()
    prefill(hybrid, state, 1, PROMPTS[3])
    assert_fresh_prefill_state(hybrid, state, 1, PROMPTS[3])


@pytest.mark.parametrize("slot", [5, -1])
def test_a_slot_outside_the_state_is_refused_by_every_operation(hybrid: CausalLM, slot: int) -> None:
    state = prefilled(hybrid, "replay", None)
    for call in (
        lambda: state.save(slot),
        lambda: state.save_rows([0, slot]),
        lambda: state.reset(slot),
        lambda: state.reset_slots([1, slot]),
        lambda: state.rollback(slot, 0),
    ):
        with pytest.raises(RequestError, match=rf"slot {slot} out of range \[0, 5\)"):
            call()
    # nothing was reset or saved on the way to the refusal
    assert state.lengths[:4] == [len(p) for p in PROMPTS]
    assert state.saved_lengths == [None] * 5


# ------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def hybrid_pair(tiny_pair: TinyPair) -> tuple[CausalLM, DFlashDraft]:
    target_dir, draft_dir = tiny_pair("qwen3_5", block_size=BLOCK)
    target = load_target(target_dir, dtype=F64)
    return target, load_draft(draft_dir, target)


@pytest.fixture(scope="module")
def dense_pair(tiny_pair: TinyPair) -> tuple[CausalLM, DFlashDraft]:
    target_dir, draft_dir = tiny_pair("qwen3", block_size=BLOCK)
    target = load_target(target_dir, dtype=F64)
    return target, load_draft(draft_dir, target)


ENGINE_PROMPTS = [[5, 9, 3, 77, 12], [40, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 7, 1], [300, 2, 9, 11, 4, 6, 8]]
ACCEPTS = [[7, 0, 3, 6, 1, 5], [2, 5, 0, 7, 4, 1], [0, 4, 7, 2, 6, 3], [6, 1, 7, 0, 3, 5]]
PARAMS = SamplingParams(max_tokens=17, ignore_eos=True)


def run_observed(
    pair: tuple[CausalLM, DFlashDraft], config: EngineConfig
) -> tuple[dict[str, list[int]], list[tuple[int, int, list]], list[list[int]]]:
    """A short neighbour in slot 0 and three requests in slots 1-3; once the neighbour is done
    a fourth request takes slot 0, so the batch's rows are no longer in slot order. Each
    request has its oracle. Returns the four outputs, (request, length, its conv and recurrent
    states) after every commit, and their plain greedy references."""
    target, draft = pair
    refs = [generate_plain(target, p, PARAMS).output_ids for p in ENGINE_PROMPTS]
    engine = Engine(target, draft, config)
    seen: list = []
    slots: dict[int, int] = {}
    layers = target.config.linear_layers

    def observe(seq, state: TargetState, length: int) -> None:
        if seq.request_id.startswith("r"):
            i = int(seq.request_id[1:])
            slots[i] = seq.slot
            kept = [(state.conv[x][seq.slot].clone(), state.recurrent[x][seq.slot].clone()) for x in layers]
            seen.append((i, length, kept))

    def add(i: int) -> None:
        oracle = OracleProposer(refs[i], ACCEPTS[i], target.config.vocab_size)
        engine.add_request(f"r{i}", ENGINE_PROMPTS[i], PARAMS, oracle=oracle)

    engine.commit_observer = observe
    engine.add_request("neighbour", [3, 4, 250, 17], SamplingParams(max_tokens=2, ignore_eos=True))
    for i in range(3):
        add(i)
    added = False
    for _ in range(300):
        if not engine.has_unfinished():
            break
        engine.step()
        if not added and engine.get("neighbour").finish_reason is not None:
            add(3)
            added = True
    outputs = {f"r{i}": engine.collect(f"r{i}").output_ids for i in range(len(ENGINE_PROMPTS))}
    assert slots == {0: 1, 1: 2, 2: 3, 3: 0}
    return outputs, seen, refs


@pytest.mark.parametrize(("strategy", "every"), VARIANTS, ids=VARIANT_IDS)
def test_batched_hybrid_requests_commit_the_fresh_prefill_state_every_step(
    hybrid_pair: tuple[CausalLM, DFlashDraft], strategy: str, every: int | None
) -> None:
    target, _ = hybrid_pair
    config = EngineConfig(max_num_seqs=4, block_size=BLOCK, commit_strategy=strategy, checkpoint_every=every)
    outputs, seen, refs = run_observed(hybrid_pair, config)
    assert outputs == {f"r{i}": ref for i, ref in enumerate(refs)}
    assert len(seen) >= 10
    fresh = new_state(target, MAX_LEN)
    for i, length, kept in seen:
        prefill(target, fresh, 0, (ENGINE_PROMPTS[i] + refs[i])[:length])
        for layer, (conv, recurrent) in zip(target.config.linear_layers, kept):
            for name, got in (("conv", conv), ("recurrent", recurrent)):
                err = (got - getattr(fresh, name)[layer][0]).abs().max().item()
                assert err <= ATOL, f"request {i} at length {length}, layer {layer} {name}: {err:.3g}"


@pytest.mark.parametrize("strategy", COMMIT_STRATEGIES)
def test_batched_dense_requests_move_to_the_committed_length(
    dense_pair: tuple[CausalLM, DFlashDraft], strategy: str
) -> None:
    """On a dense target the commit is the length: after each step it is the prompt and the
    tokens emitted so far, less the step's bonus (the next anchor), and the output is plain
    greedy's."""
    target, _ = dense_pair
    config = EngineConfig(max_num_seqs=4, block_size=BLOCK, commit_strategy=strategy)
    outputs, seen, refs = run_observed(dense_pair, config)
    assert outputs == {f"r{i}": ref for i, ref in enumerate(refs)}
    by_request: dict[int, list[int]] = {}
    for i, length, _ in seen:
        by_request.setdefault(i, []).append(length)
    for i, lengths in by_request.items():
        # each step commits its anchor and the oracle's accepted count, the last step cut
        # where the request's max_tokens end
        expected, at = [], len(ENGINE_PROMPTS[i])
        for accepted in ACCEPTS[i]:
            at = min(at + accepted + 1, len(ENGINE_PROMPTS[i]) + PARAMS.max_tokens)
            expected.append(at)
        assert lengths == expected[: len(lengths)] and lengths[-1] == expected[-1], (i, lengths)


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("slot", [2, -1])
def test_restoring_a_slot_outside_the_state_is_refused_by_name(hybrid: CausalLM, slot: int) -> None:
    state = new_state(hybrid, MAX_LEN, num_slots=2)
    with pytest.raises(RequestError, match=rf"slot {slot} out of range \[0, 2\)"):
        state.restore_saved(slot)


def test_a_state_for_an_unknown_commit_strategy_is_refused(hybrid: CausalLM) -> None:
    with pytest.raises(ConfigError, match="unknown commit strategy 'per-token'"):
        TargetState(hybrid.config, 2, MAX_LEN, F64, "cpu", 4, "per-token")
