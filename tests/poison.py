"""A planted numerical failure for the isolation tests: a request whose prompt starts with
POISON gets NaN logits in every target forward once it has committed POISON_AFTER tokens
(prompt included), in whatever batch it runs. Testing only: the production step has no
such branch.

    with poisoned():
        engine.step()            # the marked request's rows turn NaN, no one else's
    python -m tests.poison SERVE_ARGS...   # our server with the poison planted
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from reference_engine.models import CausalLM
from reference_engine.runtime.engine import Engine

POISON = 13  # first prompt token of a poisoned request
POISON_AFTER = 5  # committed tokens (prompt + output) before its logits turn NaN

_slots: set[int] = set()


@contextmanager
def poisoned() -> Iterator[None]:
    forward, admit, release = CausalLM.forward, Engine._admit, Engine._release

    def poisoned_admit(self):
        admit(self)
        _slots.update(s.slot for s in self.active.values() if s.prompt_ids[0] == POISON)

    def poisoned_release(self, seq):
        _slots.discard(seq.slot)
        release(self, seq)

    def poisoned_forward(self, input_ids, positions, slots, state, *args, **kwargs):
        out = forward(self, input_ids, positions, slots, state, *args, **kwargs)
        for row, slot in enumerate(slots.tolist()):
            if slot in _slots and state.lengths[slot] >= POISON_AFTER:
                out.logits[row] = float("nan")
        return out

    CausalLM.forward, Engine._admit, Engine._release = (poisoned_forward, poisoned_admit,
                                                         poisoned_release)
    try:
        yield
    finally:
        CausalLM.forward, Engine._admit, Engine._release = forward, admit, release
        _slots.clear()


if __name__ == "__main__":
    from reference_engine.serving.server import main

    torch.set_num_threads(1)
    with poisoned():
        sys.exit(main(sys.argv[1:]))
