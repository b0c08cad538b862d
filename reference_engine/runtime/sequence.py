"""One request inside the engine: its prompt, progress, output, slot and statistics."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .oracle import Proposer
from .request import SamplingParams
from .stats import RecentAcceptance, SpecCounters


@dataclass(frozen=True)
class StepRecord:
    """One speculative step of one request."""

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
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    fallback_reason: str | None = None
    spec: SpecCounters = field(default_factory=SpecCounters)
    recent: RecentAcceptance = field(default_factory=RecentAcceptance)  # what the verify width reads
    steps: list[StepRecord] = field(default_factory=list)
    first_token_s: float | None = None
    finished_s: float | None = None
    error: str | None = None  # why the engine failed this request (finish_reason "error")

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

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

    def record_step(self, proposed: int, accepted: int, committed: int, drafted: list[int]) -> None:
        self.spec.record(proposed, accepted, committed)
        self.recent.record(proposed, accepted)
        self.steps.append(StepRecord(proposed, accepted, committed, tuple(drafted)))
