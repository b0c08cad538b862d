"""DFlash speculative decoding for one request (`generate_speculative`), its options, and the
oracle proposer that forces scheduled acceptance for tests and benchmarks.

The step itself (draft -> verify -> accept -> commit, with the vocabulary: block, anchor,
accepted, bonus, acceptance length) is speculate.py; this module runs the batched engine
with one slot.

Reference: DFlash (arXiv 2602.06036); z-lab `dflash_generate`, whose per-step acceptance
lengths (the first token, from prefill, not counted) this module reproduces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..config import DraftConfig
from ..errors import ConfigError
from ..models import CausalLM
from ..models.dflash import DFlashDraft
from .commit import check_strategy
from .decode import GenerationResult, context_length
from .engine import Engine, EngineConfig
from .request import SamplingParams, validate_prompt
from .sequence import StepRecord
from .state import TargetState


@dataclass(frozen=True)
class SpecOptions:
    block_size: int
    commit_strategy: str = "replay"

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ConfigError(f"block size must be >= 2, got {self.block_size}")
        check_strategy(self.commit_strategy)

    def check_draft(self, draft: DraftConfig) -> None:
        if self.block_size > draft.block_size:
            raise ConfigError(
                f"block size {self.block_size} is larger than the draft supports "
                f"({draft.block_size})"
            )


@dataclass
class SpecResult(GenerationResult):
    steps: list[StepRecord] = field(default_factory=list)


class OracleProposer:
    """Replaces the draft's proposals so that each step accepts a scheduled count.

    The draft model still runs (its cost is real); only its tokens are swapped. Built from
    the target's plain greedy continuation computed beforehand: step i proposes the true
    next tokens for its first `schedule[i % len(schedule)]` slots and a wrong token in the
    next slot, so that a lossless engine accepts exactly that many ("corrupt position j"
    is the entry j - 1). Greedy only.

    `forced=True` is for benchmarks on random bfloat16 weights, where a continuation
    computed by plain decode does not survive the verify kernels' different rounding (one
    flipped near-tie and every later proposal is wrong): the engine then takes the
    scheduled count as accepted instead of comparing. Every step does the same work as a
    real one (draft, verify, acceptance, commit of a + 1 tokens), so costs are right, but
    the output is not checked against plain decode. The gates never force.
    """

    def __init__(self, continuation: Sequence[int], schedule: Sequence[int], vocab_size: int,
                 forced: bool = False):
        if not schedule or any(k < 0 for k in schedule):
            raise ConfigError(f"oracle schedule must be non-empty counts >= 0, got {schedule}")
        self.continuation = list(continuation)
        self.schedule = list(schedule)
        self.vocab_size = vocab_size
        self.forced = forced

    def scheduled(self, step: int, n: int) -> int:
        """Draft tokens step `step` should accept when it drafts n."""
        return min(self.schedule[step % len(self.schedule)], n)

    @classmethod
    def for_mean_acceptance(cls, continuation: Sequence[int], mean_length: float,
                            block_size: int, vocab_size: int,
                            forced: bool = False) -> OracleProposer:
        """A schedule whose mean acceptance length (bonus included) is `mean_length`: the
        accepted counts floor(m) and floor(m) + 1 interleaved evenly, m = mean_length - 1."""
        if not 1.0 <= mean_length <= block_size:
            raise ConfigError(
                f"oracle acceptance length must be in [1, {block_size}] for block size "
                f"{block_size}, got {mean_length}"
            )
        m = mean_length - 1
        low, frac = int(m), m - int(m)
        period = 20
        schedule = [low + int((k + 1) * frac + 1e-9) - int(k * frac + 1e-9) for k in range(period)]
        return cls(continuation, schedule, vocab_size, forced)

    def propose(self, step: int, generated: int, n: int) -> list[int]:
        """Draft tokens for block slots 1..n when `generated` tokens are out (the anchor is
        continuation[generated - 1])."""
        truth = self.continuation[generated : generated + n]
        last = truth[-1] if truth else (self.continuation[-1] if self.continuation else 0)
        filler = last + 1
        truth += [filler % self.vocab_size] * (n - len(truth))
        k = self.scheduled(step, n)
        if k < n:
            truth[k] = (truth[k] + 1) % self.vocab_size  # wrong for sure
        return truth


def generate_speculative(
    target: CausalLM,
    draft: DFlashDraft,
    prompt_ids: list[int],
    params: SamplingParams,
    options: SpecOptions,
    oracle: OracleProposer | None = None,
    generator: torch.Generator | None = None,
    max_model_len: int | None = None,
    on_commit: Callable[[TargetState, int], None] | None = None,
    numerics: str | None = None,
) -> SpecResult:
    """Speculative decoding of one request, lossless against plain decode: greedy output is
    the same token for token; sampled output has the same distribution. Runs the batched
    engine with one slot, sized to this request.

    `on_commit(state, length)` is called after each commit (state-equality gates); the
    request's slot is 0.
    """
    draft.config.check_target(target.config)
    options.check_draft(draft.config)
    if oracle is not None and not params.greedy:
        raise ConfigError("the oracle proposer is greedy-only (temperature 0)")
    validate_prompt(prompt_ids, target.config.vocab_size,
                    context_length(target, max_model_len), params.max_tokens)
    config = EngineConfig(
        max_num_seqs=1,
        max_model_len=len(prompt_ids) + params.max_tokens,
        block_size=options.block_size,
        commit_strategy=options.commit_strategy,
        prefill_chunk=len(prompt_ids),
        numerics=numerics,
        enforce_eager=True,  # one request, one run: capturing graphs would not pay off
    )
    engine = Engine(target, draft, config)
    if on_commit is not None:
        engine.commit_observer = lambda seq, state, length: on_commit(state, length)
    engine.add_request("request", prompt_ids, params, oracle=oracle, generator=generator)
    while engine.has_unfinished():
        engine.step()
    seq = engine.collect("request")
    return SpecResult(seq.output_ids, seq.finish_reason, [s.acceptance_length for s in seq.steps],
                      seq.steps)
