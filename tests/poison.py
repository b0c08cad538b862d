"""A planted numerical failure for the isolation tests: a request whose prompt starts with
POISON gets NaN logits in every target forward once it has committed POISON_AFTER tokens
(prompt included), in whatever batch it runs. Testing only: the production step has no
such branch.

    with poisoned():
        engine.step()            # the marked request's rows turn NaN, no one else's
    python -m tests.poison SERVE_ARGS...   # our server with the poison (and KILL) planted
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from reference_engine.models import CausalLM
from reference_engine.runtime.prefill import Prefill
from reference_engine.runtime.scheduler import Scheduler

POISON = 13  # first prompt token of a poisoned request
POISON_AFTER = 5  # committed tokens (prompt + output) before its logits turn NaN
KILL = 14  # first prompt token of a request that kills the engine thread (`killing()`)


class EngineKilled(BaseException):
    """Not an Exception: nothing in the engine catches it, so the engine thread dies."""


_slots: set[int] = set()


@contextmanager
def poisoned() -> Iterator[None]:
    forward, admit, release = CausalLM.forward, Scheduler.admit, Scheduler._release

    def poisoned_admit(self):
        admitted = admit(self)
        _slots.update(s.slot for s in admitted if s.prompt_ids[0] == POISON)
        return admitted

    def poisoned_release(self, seq):
        _slots.discard(seq.slot)
        release(self, seq)

    def poisoned_forward(self, input_ids, positions, slots, state, *args, **kwargs):
        out = forward(self, input_ids, positions, slots, state, *args, **kwargs)
        for row, slot in enumerate(slots.tolist()):
            if slot in _slots and state.lengths[slot] >= POISON_AFTER:
                out.logits[row] = float("nan")
        return out

    CausalLM.forward, Scheduler.admit, Scheduler._release = (
        poisoned_forward,
        poisoned_admit,
        poisoned_release,
    )
    try:
        yield
    finally:
        CausalLM.forward, Scheduler.admit, Scheduler._release = forward, admit, release
        _slots.clear()


@contextmanager
def killing() -> Iterator[None]:
    """A request whose prompt starts with KILL takes the engine thread down at its prefill."""
    prefill = Prefill.one

    def killing_prefill(self, seq, outputs):
        if seq.prompt_ids[0] == KILL:
            raise EngineKilled("planted")
        return prefill(self, seq, outputs)

    Prefill.one = killing_prefill
    try:
        yield
    finally:
        Prefill.one = prefill


if __name__ == "__main__":
    from reference_engine.serving.server import main

    with poisoned(), killing():
        sys.exit(main(sys.argv[1:]))
