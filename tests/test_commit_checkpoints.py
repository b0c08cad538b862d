"""The `per_token` commit on the Triton recurrence (run by the interpreter on the CPU): a verify
that keeps checkpoints every few tokens, then `commit_hybrid`, leaves every slot's Gated
DeltaNet state with the bits a verify keeping every token's state leaves (on the GPU where there
is one, its compiled kernel). Block widths below,
at and above the spacing; rows that keep different counts; a step whose verify ran a padded
bucket (a row on the spare slot) and whose commit runs the real rows only, as an eager commit
after a replayed graph does."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_target
from reference_engine.kernels import TORCH
from reference_engine.kernels import gated_delta as triton_delta
from reference_engine.models import CausalLM
from reference_engine.runtime.commit import commit_hybrid
from reference_engine.runtime.state import TargetState

pytestmark = pytest.mark.kernels

# the references everywhere but the recurrence, which is the Triton kernel's
OPS = replace(TORCH, gated_delta=triton_delta.gated_delta, gated_delta_resume=triton_delta.gated_delta_resume)
SLOTS, SPARE, BLOCK = 4, 4, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 9, 3, 77, 12], [40, 8, 1, 2, 3, 4, 5, 6, 7], [7, 7, 1], [300, 2, 9, 11, 4, 6, 8]]


@pytest.fixture(scope="module")
def hybrid(qwen3_5_checkpoint: Path) -> CausalLM:
    return load_target(qwen3_5_checkpoint, dtype=torch.float32, device=DEVICE)


def prefilled(model: CausalLM, every: int) -> TargetState:
    state = TargetState(model.config, SLOTS + 1, 96, torch.float32, DEVICE, BLOCK, "per_token", every=every)
    for slot, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt], device=DEVICE)
        positions = torch.arange(len(prompt), device=DEVICE)[None]
        model(ids, positions, torch.tensor([slot], device=DEVICE), state, len(prompt), ops=OPS)
        state.lengths[slot] = len(prompt)
    return state


def speculative_step(
    model: CausalLM, state: TargetState, slots: list[int], processed: list[int], T: int, pad: int
) -> None:
    """A verify of T tokens for `slots` (plus `pad` rows on the spare slot), then the commit of
    the real rows keeping `processed` tokens each."""
    rows = slots + [SPARE] * pad
    starts = torch.tensor([state.lengths[s] if s != SPARE else 0 for s in rows], device=DEVICE)
    ids = torch.arange(len(rows) * T, device=DEVICE).view(len(rows), T)
    block = (ids * 37 + 11) % model.config.vocab_size
    positions = starts[:, None] + torch.arange(T, device=DEVICE)
    kv_len = int(starts.max()) + T
    valid = torch.full((len(rows),), T, device=DEVICE)
    at = torch.tensor(rows, device=DEVICE)
    model(block, positions, at, state, kv_len, valid_len=valid, record="per_token", ops=OPS)
    n = len(slots)
    kept = torch.tensor(processed, device=DEVICE)
    live = torch.tensor(slots, device=DEVICE)
    commit_hybrid("per_token", model, state, live, block[:n], positions[:n], kept, kv_len, OPS)
    for slot, p in zip(slots, processed):
        state.lengths[slot] += p


@pytest.mark.parametrize(("T", "every"), [(1, 3), (8, 3), (3, 8), (9, 8), (16, 8)])
def test_checkpoints_every_few_tokens_commit_the_bits_of_every_tokens_state(
    hybrid: CausalLM, T: int, every: int
) -> None:
    states = {kept: prefilled(hybrid, kept) for kept in (1, every)}
    steps = [  # (slots, processed, padding rows)
        ([0, 1, 2, 3], [T, 1, (T + 1) // 2, max(1, T - 1)], 0),
        ([2, 0, 3], [1, T, max(1, T - 2)], 1),  # rows in another order, a padded bucket
        ([1, 3], [(T + 2) // 3, T], 2),
    ]
    for slots, processed, pad in steps:
        for state in states.values():
            speculative_step(hybrid, state, slots, processed, T, pad)
    assert states[every].every == every
    for layer in hybrid.config.linear_layers:
        want, got = states[1].recurrent[layer][:SLOTS], states[every].recurrent[layer][:SLOTS]
        assert torch.equal(got, want), f"layer {layer}: {(got - want).abs().max().item():.3g}"
