"""Deliberate engine faults, for the gates' own tests: each gate is shown to catch one.

A fault replaces one attribute (a method of a class, or a function of a module, looked up
where the engine calls it) for the duration of a `with planted(name):` block; most replace
a phase method of `SpeculativeStep` (reference_engine/runtime/speculate.py). The production
code has no fault branches. `python -m gates.faulty_serve FAULT SERVE_ARGS...` starts our
server with one planted, for the HTTP gate.

    with planted("skip_state_rollback"):
        generate_speculative(...)   # every engine built or stepped inside is faulty
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from reference_engine.runtime.sampling import sample
from reference_engine.runtime.speculate import SpeculativeStep


@dataclass(frozen=True)
class Fault:
    description: str
    method: str  # the attribute of `owner` it replaces
    wrap: Callable[[Callable], Callable]  # the correct attribute -> the faulty one
    owner: Any = SpeculativeStep  # a class or a module


def _skip_state_rollback(correct):
    def commit_state(self, slot_ids, rows, block, processed):
        return None  # the Gated DeltaNet state keeps the whole verified block
    return commit_state


def _skip_length_rollback(correct):
    def processed(self, rows, accepted):
        return rows.n_t + 1  # rejected positions stay committed
    return processed


def _feature_off_by_one(correct):
    def context_features(self, features, width, n_t):
        rows = torch.minimum(torch.arange(width, device=features.device) + 1, n_t[:, None])
        return features.gather(1, rows[..., None].expand(-1, -1, features.shape[-1]))
    return context_features


def _wrong_bonus_position(correct):
    def bonus_index(self, accepted, n_t):
        return (accepted + 1).clamp(max=n_t)
    return bonus_index


def _never_accept_full_block(correct):
    def accept_greedy(self, proposals, target_tokens, n_t):
        return torch.minimum(correct(self, proposals, target_tokens, n_t), n_t - 1)
    return accept_greedy


def _bonus_ignores_residual(correct):
    def accept_sampled(self, proposals, draft_probs, target_probs, generator):
        accepted, _ = correct(self, proposals, draft_probs, target_probs, generator)
        return accepted, sample(target_probs[accepted], generator)  # p, not norm(p - q)
    return accept_sampled


def _commit_wrong_slot(correct):
    def commit_state(self, slot_ids, rows, block, processed):
        return correct(self, slot_ids[1:] + slot_ids[:1], rows, block, processed)
    return commit_state


def _shared_positions(correct):
    def anchor_positions(self, seqs):
        starts = correct(self, seqs)
        return [starts[0]] * len(starts)
    return anchor_positions


FAULTS: dict[str, Fault] = {
    "skip_state_rollback": Fault("hybrid: keep the Gated DeltaNet state of the whole verified "
                                 "block", "commit_state", _skip_state_rollback),
    "skip_length_rollback": Fault("keep every verified position as committed, rejected ones too",
                                  "processed", _skip_length_rollback),
    "feature_off_by_one": Fault("feed the draft, for each committed position, the next one's "
                                "features", "context_features", _feature_off_by_one),
    "wrong_bonus_position": Fault("take the bonus from the target's choice one slot too far",
                                  "bonus_index", _wrong_bonus_position),
    "never_accept_full_block": Fault("reject the last draft token even when it matches",
                                     "accept_greedy", _never_accept_full_block),
    "bonus_ignores_residual": Fault("sampling: draw a rejected slot's replacement from p, not "
                                    "p - q", "accept_sampled", _bonus_ignores_residual),
    "commit_wrong_slot": Fault("engine: commit each row's state into the next row's slot",
                               "commit_state", _commit_wrong_slot),
    "shared_positions": Fault("engine: give every row of a batched step the first row's "
                              "positions", "anchor_positions", _shared_positions),
}


@contextmanager
def planted(name: str | None) -> Iterator[None]:
    """Plant fault `name` until the block ends (None: no fault): every engine built or
    stepped inside the block runs with it."""
    if name is None:
        yield
        return
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}, expected one of {', '.join(FAULTS)}")
    fault = FAULTS[name]
    correct = getattr(fault.owner, fault.method)
    setattr(fault.owner, fault.method, fault.wrap(correct))
    try:
        yield
    finally:
        setattr(fault.owner, fault.method, correct)
