"""One request inside the engine: its prompt, progress, output, slot and statistics."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .oracle import Proposer
from .request import SamplingParams
from .stats import RecentAcceptance, SpecCounters
from .transfer import DeviceTokens


class StepRecord(NamedTuple):
    """One speculative step of one request (a named tuple: one is made per row of every
    step, in a third of a frozen dataclass's time)."""

    proposed: int  # draft tokens in the block (B - 1, fewer for a short final block)
    accepted: int  # a
    acceptance_length: int  # tokens this step committed: a + 1, cut at a stop or max_tokens
    drafted: tuple[int, ...] = ()  # the proposed draft tokens


class Phase(enum.Enum):
    WAITING = "waiting"  # admitted to the queue, no slot yet
    PREFILL = "prefill"  # has a slot, prompt partly run
    RUNNING = "running"  # decoding (plain or speculative)
    FINISHED = "finished"


# why a request left the speculative path
FALLBACK_LOGPROBS = "logprobs"
FALLBACK_SAMPLING = "sampling_option"
FALLBACK_LOW_ACCEPTANCE = "low_acceptance"
FALLBACK_PENALTIES = "penalties"  # presence/frequency penalty or logit bias


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stops: frozenset[int]
    arrival_s: float
    speculative: bool
    oracle: Proposer | None = None  # testing and benchmarks only (oracle.py)
    generator: torch.Generator | None = None
    phase: Phase = Phase.WAITING
    slot: int | None = None
    cell: int | None = None  # first cell of its run in a pooled KV cache (kv_pool.py)
    prefilled: int = 0  # prompt tokens run through the target so far
    output_ids: list[int] = field(default_factory=list)
    # the first token while it is still on its way from the device (prefill.py): it counts
    # as generated, the step after the prefill takes it from the device, and the engine
    # emits it once that step has read its results (Engine.emit_first)
    pending: tuple[DeviceTokens, int] | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    fallback_reason: str | None = None
    # the counters of `steps`, brought up to date when read (`spec`): most requests are read
    # once, at their end, and a step need not count each row twice (the engine's totals too)
    _spec: SpecCounters = field(default_factory=SpecCounters, init=False, repr=False)
    recent: RecentAcceptance = field(default_factory=RecentAcceptance)  # what the verify width reads
    steps: list[StepRecord] = field(default_factory=list)
    first_token_s: float | None = None
    finished_s: float | None = None
    error: str | None = None  # why the engine failed this request (finish_reason "error")

    @property
    def generated(self) -> int:
        """Tokens generated so far, a first token still on the device included."""
        return len(self.output_ids) + (self.pending is not None)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - self.generated

    def append(self, tokens: list[int]) -> list[int]:
        """Append newly committed tokens, cut at the first stop and at max_tokens; returns
        the tokens kept and sets finish_reason when the request is done."""
        kept = []
        for token in tokens[: self.remaining]:
            kept.append(token)
            if token in self.stops:
                self.finish_reason = "stop"
                break
        self.output_ids.extend(kept)
        if self.finish_reason is None and self.remaining == 0:
            self.finish_reason = "length"
        return kept

    @property
    def spec(self) -> SpecCounters:
        """The request's speculative counters, over every step in `steps`."""
        spec = self._spec
        if spec.steps < len(self.steps):
            for step in self.steps[spec.steps :]:
                spec.record(step.proposed, step.accepted, step.acceptance_length)
        return spec

    def record_step(self, proposed: int, accepted: int, committed: int, drafted: list[int]) -> None:
        self.recent.record(proposed, accepted)
        self.steps.append(StepRecord(proposed, accepted, committed, tuple(drafted)))

    def __reduce__(self) -> tuple:
        """Pickled with its step records as plain tuples, rebuilt as StepRecords on loading (the
        same sequence): a named tuple pickles through Python calls a record, and a finished
        request crosses to the server's process with a record per step (at c16 on the demo
        pair its records were two thirds of the cost of pickling it)."""
        state = self.__dict__.copy()
        state["steps"] = [tuple(step) for step in self.steps]
        return (sequence_from_state, (state,))


def sequence_from_state(state: dict) -> Sequence:
    """A pickled Sequence again (Sequence.__reduce__): its fields, its step records as tuples."""
    seq = Sequence.__new__(Sequence)
    state["steps"] = [tuple.__new__(StepRecord, step) for step in state["steps"]]
    seq.__dict__.update(state)
    return seq
