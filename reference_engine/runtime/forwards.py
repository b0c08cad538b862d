"""The typed inputs and outputs of the engine's forwards, eager or replayed from a CUDA graph
(graphs.py), so that no caller indexes a dictionary by name.

A replayed output's tensors are views of its graph's static buffers: valid until that graph
replays again, which is after the step has used them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import cache

import torch

from ..models import ForwardOutput


class _Rows:
    def _each(self, pick):
        """The same output with `pick` applied to each of its tensors (along their rows)."""
        picked = {}
        for name in _field_names(type(self)):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                picked[name] = pick(value)
        return replace(self, **picked)

    def rows(self, at: torch.Tensor):
        """The same output for the rows `at` [k] (indices), copied out of the buffers."""
        return self._each(lambda t: t.index_select(0, at))

    def head(self, rows: int):
        """The same output for the first `rows` rows (a bucket's padding rows dropped); itself
        when it has no other rows (a full bucket: a step's every replay asks)."""
        if all(t.shape[0] == rows for t in self._tensors()):
            return self
        return self._each(lambda t: t[:rows])

    def _tensors(self) -> list[torch.Tensor]:
        values = (getattr(self, name) for name in _field_names(type(self)))
        return [v for v in values if isinstance(v, torch.Tensor)]


@cache
def _field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names, looked up once (`fields` builds them anew at every call,
    and a step slices a few outputs)."""
    return tuple(f.name for f in fields(cls))


@dataclass
class StepInputs:
    """What a forward of a step reads; a graph's are its static input buffers."""

    ids: torch.Tensor  # [rows, width] token ids
    positions: torch.Tensor  # [rows, width]
    slots: torch.Tensor  # [rows]
    valid: torch.Tensor  # [rows] tokens of each row that count (the rest is padding)
    packed: torch.Tensor | None = None  # a graph's: one buffer behind the four (graphs.packed_inputs)
    processed: torch.Tensor | None = None  # commit: block tokens each row keeps [rows]


@dataclass
class Logits(_Rows):
    """A prefill chunk's or a decode step's next-token logits."""

    logits: torch.Tensor  # [rows, vocab]
    tokens: torch.Tensor | None = None  # [rows] the greedy argmax, when the forward took it


@dataclass
class DraftHidden(_Rows):
    """The draft's forward over the blocks before its LM head (a captured draft's body, whose
    head runs at the verify width: graphs.py)."""

    hidden: torch.Tensor  # [b, B, hidden] final-normed


@dataclass
class Proposals(_Rows):
    """The draft's forward over the blocks."""

    logits: torch.Tensor  # [b, W, vocab] for draft slots 1..W (W = N unless the step verifies fewer)
    tokens: torch.Tensor  # [b, W] greedy proposals
    # DFlash2: the selector's candidates [b, W, K] and edges [b, W, K, K], for a sampled walk
    candidates: torch.Tensor | None = None
    edges: torch.Tensor | None = None


@dataclass
class Verified(_Rows, ForwardOutput):
    """The target's verify forward over the blocks: logits [b, N + 1, vocab], the draft's
    context features, and the greedy argmax of the logits when the forward took it."""

    tokens: torch.Tensor | None = None  # [b, N + 1]
