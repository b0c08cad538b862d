"""DFlash speculative decoding of one request (`generate_speculative`): the batched engine
with one slot, sized to the request.

The step itself (draft -> verify -> accept -> commit, with the vocabulary: block, anchor,
accepted, bonus, acceptance length) is speculative_step.py; oracle.py forces scheduled acceptance
for tests and benchmarks.

Reference: DFlash (arXiv 2602.06036); z-lab `dflash_generate`, whose per-step acceptance
lengths (the first token, from prefill, not counted) this module reproduces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..models import CausalLM
from ..models.dflash import DFlashDraft
from .decode import GenerationResult, context_length
from .engine import Engine, EngineConfig
from .oracle import Proposer
from .request import SamplingParams, validate_prompt
from .sequence import StepRecord
from .state import TargetState


@dataclass
class SpecResult(GenerationResult):
    steps: list[StepRecord] = field(default_factory=list)


def generate_speculative(
    target: CausalLM,
    draft: DFlashDraft,
    prompt_ids: list[int],
    params: SamplingParams,
    config: EngineConfig,
    oracle: Proposer | None = None,
    generator: torch.Generator | None = None,
    on_commit: Callable[[TargetState, int], None] | None = None,
) -> SpecResult:
    """Speculative decoding of one request, lossless against plain decode: greedy output is
    the same token for token; sampled output has the same distribution. `config` gives the
    block size, commit strategy, numerics and context limit; the engine runs with one slot
    sized to this request, eagerly (one run would not pay for capturing graphs).

    `on_commit(state, length)` is called after each commit (state-equality gates); the
    request's slot is 0.
    """
    validate_prompt(
        prompt_ids, target.config.vocab_size, context_length(target, config.max_model_len), params.max_tokens
    )
    config = replace(
        config,
        max_num_seqs=1,
        max_model_len=len(prompt_ids) + params.max_tokens,
        prefill_chunk=len(prompt_ids),
        enforce_eager=True,
    )
    engine = Engine(target, draft, config)
    if on_commit is not None:
        engine.commit_observer = lambda seq, state, length: on_commit(state, length)
    engine.add_request("request", prompt_ids, params, oracle=oracle, generator=generator)
    while engine.has_unfinished():
        engine.step()
    seq = engine.collect("request")
    return SpecResult(seq.output_ids, seq.finish_reason, [s.acceptance_length for s in seq.steps], seq.steps)
