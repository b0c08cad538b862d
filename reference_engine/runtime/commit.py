"""Commit strategies: bring a hybrid target's Gated DeltaNet state to the accepted boundary.

A verify pass runs the whole block (anchor + B-1 draft tokens) through the target, so every
Gated DeltaNet layer's conv and recurrent state has absorbed all B tokens. After acceptance
only the anchor and the a accepted tokens (`processed` = a + 1) may remain. Attention rows
need nothing: the committed length moves back and the next writes overwrite the rest.

- `replay`: restore the state saved before verify, then run the processed tokens through
  the target again (a second, shorter forward; its logits are discarded).
- `per_token`: verify keeps the recurrent state after block tokens 0, E, 2E, ... (E =
  `state.checkpoint_every`: PER_TOKEN_EVERY on the Triton path) and the recurrence inputs;
  commit takes the checkpoint at or before the last processed token and runs the
  recurrence on from it over the fewer than E tokens up to it. It is the verify's own
  arithmetic from the verify's own state, so the bits are those of the state after that
  token. Costs memory (B / E states per layer and row) and that short recurrence, not the
  projections. On the references (NO_CHECKPOINTS) the verify keeps no state but the row
  each token writes (the chunked form's u_t), and the commit makes the state after the
  boundary from the state before the block (which a `per_token` verify leaves alone) in one
  product: reference.gated_delta_after, the bits of `recompute`'s rerun.
- `recompute`: verify keeps each layer's recurrence inputs (q, k, v, g, beta after the
  conv); commit runs the recurrence again from the saved state over the processed tokens
  only. Costs the recurrence, not the projections.

For `per_token` and `recompute` the conv state is read off the verify's conv input: the
last kernel-1 inputs up to the processed boundary. All of this is per row: rows of one
batch may process different counts, and no value is read back to the host.
"""

from __future__ import annotations

import torch

from ..kernels import TORCH, Kernels
from ..kernels.reference import gated_delta_after
from ..models import CausalLM
from .state import COMMIT_STRATEGIES, TargetState, check_strategy, kept_states

# the strategies' names live beside the state that keeps what each needs (state.py)
__all__ = ["COMMIT_STRATEGIES", "check_strategy", "commit_hybrid", "needs_snapshot", "verify_record"]


def needs_snapshot(strategy: str) -> bool:
    """Whether the state must be saved before verify (per_token keeps its own)."""
    return strategy in ("replay", "recompute")


def verify_record(strategy: str, model: CausalLM) -> str | None:
    """What the verify forward must keep for this strategy (None: nothing)."""
    if not model.config.is_hybrid or strategy == "replay":
        return None
    return strategy


def commit_hybrid(
    strategy: str,
    model: CausalLM,
    state: TargetState,
    slot_ids: list[int] | torch.Tensor,  # a device tensor keeps it free of host work
    block_tokens: torch.Tensor,  # [batch, T] the verified block
    positions: torch.Tensor,  # [batch, T]
    processed: torch.Tensor,  # [batch] tokens of the block to keep (accepted + anchor)
    kv_len: int,
    ops: Kernels = TORCH,
) -> None:
    """Set every Gated DeltaNet layer of the rows' slots to the state after `processed`
    tokens of the block. Host-side lengths are the caller's to update."""
    if not model.config.is_hybrid:
        return
    slots = state.slot_rows(slot_ids)
    if strategy == "replay":
        state.restore_rows(slots)
        model(block_tokens, positions, slots, state, kv_len, valid_len=processed, ops=ops)
        return
    T = block_tokens.shape[1]
    kernel = model.config.linear_conv_kernel_dim
    rows = len(slot_ids)
    # per_token: row i's checkpoints are rows i*kept .. of the verify's [batch * kept, ...],
    # checkpoint j the state after block token j * every. A row keeping `processed` tokens
    # needs the state after token processed - 1: the checkpoint at or before it, then the
    # tokens after that checkpoint (fewer than `every`) run again from it.
    checkpoints = strategy == "per_token" and not state.keeps_written_rows
    if checkpoints:
        every = state.every
        kept = kept_states(T, every)
        last = processed - 1
        at = last // every
        checkpoint_rows = torch.arange(rows, device=slots.device) * kept + at
        after = at * every + 1  # the first token after the checkpoint
        steps = min(every, T) - 1  # the most tokens any row runs again
    for layer in model.config.linear_layers:
        ops.conv_state_at(
            state.conv[layer], slots, state.verify_conv[layer][..., : kernel - 1 + T], processed
        )
        if strategy == "per_token" and not checkpoints:  # the references (NO_CHECKPOINTS)
            inputs = state.verify_inputs_of(layer, rows, T)
            written = state.verify_written_of(layer, rows, T)
            gated_delta_after(*inputs, written, processed, state.recurrent[layer], slots)
            continue
        if checkpoints:
            states = state.verify_states_of(layer, rows, T).flatten(0, 1)
            if steps == 0:  # every state kept: the one after the boundary is copied
                ops.copy_rows(state.recurrent[layer], slots, states, checkpoint_rows)
                continue
            inputs = state.verify_inputs_of(layer, rows, T)
            ops.gated_delta_resume(
                *inputs,
                states,
                checkpoint_rows,
                after,
                last - at * every,
                steps,
                state.recurrent[layer],
                slots,
            )
            continue
        _, final = ops.gated_delta(
            state.verify_q[layer][:, :T].index_select(0, slots),
            state.verify_k[layer][:, :T].index_select(0, slots),
            state.verify_v[layer][:, :T].index_select(0, slots),
            state.verify_g[layer][:, :T].index_select(0, slots),
            state.verify_beta[layer][:, :T].index_select(0, slots),
            state.saved_recurrent[layer].index_select(0, slots),
            valid_len=processed,
        )
        state.recurrent[layer].index_copy_(0, slots, final)
