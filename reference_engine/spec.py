"""DFlash speculative decoding for one request: draft -> verify -> accept -> commit.

Vocabulary (DESIGN.md): the block holds B tokens, the anchor (last committed token, not yet
run through the target) and B-1 draft tokens. The target verifies the whole block in one
forward. `accepted` = a is the longest prefix of draft tokens equal to the target's own
choices (greedy) or kept by speculative sampling; the `bonus` is the target's token after
that prefix. A step commits a + 1 tokens: its acceptance length (bonus included). The
target then holds the anchor and the a accepted tokens; the bonus is the next anchor.
Target features of the processed positions extend the draft's context.

Reference: DFlash (arXiv 2602.06036); z-lab `dflash_generate`, whose per-step acceptance
lengths (the first token, from prefill, not counted) this module reproduces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .commit import check_strategy, commit_hybrid, needs_snapshot, verify_record
from .config import DraftConfig
from .decode import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationResult,
    context_length,
    first_token,
    prefill,
    stop_ids,
    stop_position,
)
from .errors import ConfigError
from .models import CausalLM
from .models.dflash import DFlashDraft, DraftState
from .request import SamplingParams, validate_prompt
from .sampling import accept_greedy, accept_sampled, greedy, probabilities, sample
from .state import TargetState


# Deliberate faults, for testing only: each gate is shown to catch one of them. Never set
# outside tests; an engine with a fault is wrong by construction.
FAULTS = {
    "skip_state_rollback": "hybrid: keep the Gated DeltaNet state of the whole verified block",
    "skip_length_rollback": "keep every verified position as committed, rejected ones too",
    "feature_off_by_one": "feed the draft, for each committed position, the next one's features",
    "wrong_bonus_position": "take the bonus from the target's choice one slot too far",
    "never_accept_full_block": "reject the last draft token even when it matches",
    "bonus_ignores_residual": "sampling: draw a rejected slot's replacement from p, not p - q",
    "commit_wrong_slot": "engine: commit each row's state into the next row's slot",
    "padding_leak": "engine: let padded block tokens update the Gated DeltaNet state",
}


@dataclass(frozen=True)
class SpecOptions:
    block_size: int
    commit_strategy: str = "replay"
    fault: str | None = None  # testing only: one of FAULTS

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ConfigError(f"block size must be >= 2, got {self.block_size}")
        check_strategy(self.commit_strategy)
        if self.fault is not None and self.fault not in FAULTS:
            raise ConfigError(f"unknown fault '{self.fault}', expected one of {', '.join(FAULTS)}")

    def check_draft(self, draft: DraftConfig) -> None:
        if self.block_size > draft.block_size:
            raise ConfigError(
                f"block size {self.block_size} is larger than the draft supports "
                f"({draft.block_size})"
            )


@dataclass(frozen=True)
class StepStats:
    proposed: int  # draft tokens in the block (B - 1, fewer for a short final block)
    accepted: int  # a
    acceptance_length: int  # tokens this step committed: a + 1, cut at a stop or max_tokens
    drafted: tuple[int, ...] = ()  # the proposed draft tokens


@dataclass
class SpecResult(GenerationResult):
    steps: list[StepStats] = field(default_factory=list)


class OracleProposer:
    """Replaces the draft's proposals so that each step accepts a scheduled count.

    The draft model still runs (its cost is real); only its tokens are swapped. Built from
    the target's plain greedy continuation computed beforehand: step i proposes the true
    next tokens for its first `schedule[i % len(schedule)]` slots and a wrong token in the
    next slot, so that a lossless engine accepts exactly that many ("corrupt position j"
    is the entry j - 1). Greedy only.
    """

    def __init__(self, continuation: Sequence[int], schedule: Sequence[int], vocab_size: int):
        if not schedule or any(k < 0 for k in schedule):
            raise ConfigError(f"oracle schedule must be non-empty counts >= 0, got {schedule}")
        self.continuation = list(continuation)
        self.schedule = list(schedule)
        self.vocab_size = vocab_size

    def propose(self, step: int, generated: int, n: int) -> list[int]:
        """Draft tokens for block slots 1..n when `generated` tokens are out (the anchor is
        continuation[generated - 1])."""
        truth = self.continuation[generated : generated + n]
        filler = (truth[-1] if truth else self.continuation[-1]) + 1
        truth += [filler % self.vocab_size] * (n - len(truth))
        k = min(self.schedule[step % len(self.schedule)], n)
        if k < n:
            truth[k] = (truth[k] + 1) % self.vocab_size  # wrong for sure
        return truth


def _check_pair(target: CausalLM, draft: DFlashDraft, options: SpecOptions) -> None:
    draft.config.check_target(target.config)
    options.check_draft(draft.config)


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
) -> SpecResult:
    """Speculative decoding of one request, lossless against plain decode: greedy output is
    the same token for token; sampled output has the same distribution.

    `on_commit(state, length)` is called after each commit (state-equality gates).
    """
    _check_pair(target, draft, options)
    if oracle is not None and not params.greedy:
        raise ConfigError("the oracle proposer is greedy-only (temperature 0)")
    context = context_length(target, max_model_len)
    validate_prompt(prompt_ids, target.config.vocab_size, context, params.max_tokens)
    dcfg = draft.config
    B = options.block_size
    strategy = options.commit_strategy
    weight = target.model.embed_tokens.weight
    device, dtype = weight.device, weight.dtype
    max_len = len(prompt_ids) + params.max_tokens + B
    state = TargetState(target.config, 1, max_len, dtype, device, B, strategy)
    dstate = DraftState(dcfg, 1, max_len, dtype, device)
    slot = 0
    slots = torch.tensor([slot], device=device)
    stops = stop_ids(target, params)
    record = verify_record(strategy, target)

    logits, features = prefill(target, state, slot, prompt_ids, dcfg.target_layer_ids)
    draft.append_context(features[None], torch.arange(len(prompt_ids), device=device)[None],
                         slots, dstate)
    output = [first_token(logits, params, generator)]
    result = SpecResult(output, FINISH_LENGTH)
    if output[0] in stops:
        result.finish_reason = FINISH_STOP
        return result

    while len(output) < params.max_tokens:
        start = state.lengths[slot]  # position of the anchor, output[-1]
        n = min(B - 1, params.max_tokens - len(output))  # a shorter final block
        positions = torch.arange(start, start + n + 1, device=device)[None]
        kv_len = start + n + 1

        # draft: anchor + n mask tokens -> n proposals
        block = torch.tensor([[output[-1]] + [dcfg.mask_token_id] * n], device=device)
        hidden = draft(target.embed(block) * dcfg.input_embedding_scale, positions, slots,
                       dstate, kv_len)
        draft_logits = draft.logits(hidden[:, 1:], target.lm_head_weight)  # [1, n, vocab]
        draft_probs = None
        if oracle is not None:
            proposals = torch.tensor([oracle.propose(len(result.steps), len(output), n)],
                                     device=device)
        elif params.greedy:
            proposals = greedy(draft_logits)
        else:
            draft_probs = probabilities(draft_logits, params.temperature, params.top_k,
                                        params.top_p)
            proposals = sample(draft_probs, generator)
        block[:, 1:] = proposals

        # verify: the target over the whole block
        if target.config.is_hybrid and needs_snapshot(strategy):
            state.save(slot)
        out = target(block, positions, slots, state, kv_len,
                     capture_layers=dcfg.target_layer_ids, record=record)
        fault = options.fault
        if params.greedy:
            target_tokens = greedy(out.logits)  # [1, n + 1]
            accepted, bonus = accept_greedy(proposals, target_tokens)
            if fault == "never_accept_full_block":
                accepted = accepted.clamp(max=n - 1)
                bonus = target_tokens.gather(1, accepted[:, None])[:, 0]
            if fault == "wrong_bonus_position":
                bonus = target_tokens[:, (accepted + 1).clamp(max=n)][0]
        else:
            target_probs = probabilities(out.logits, params.temperature, params.top_k,
                                         params.top_p)
            accepted, bonus = accept_sampled(proposals, draft_probs, target_probs, generator)
            if fault == "bonus_ignores_residual":
                bonus = sample(target_probs[:, accepted[0]], generator)
        # the one host sync of the step
        a, bonus_token, *drafted = torch.cat([accepted, bonus, proposals[0]]).tolist()
        committed = drafted[:a] + [bonus_token]

        # commit: target state to the accepted boundary, draft context extended
        processed = n + 1 if fault == "skip_length_rollback" else a + 1
        if fault != "skip_state_rollback":
            commit_hybrid(strategy, target, state, [slot], block, positions,
                          torch.full_like(accepted, processed), kv_len)
        state.lengths[slot] = start + processed
        features = out.features[:, :processed]
        if fault == "feature_off_by_one":  # each position gets the next position's row
            late = (torch.arange(processed, device=device) + 1).clamp(max=n)
            features = out.features[:, late]
        draft.append_context(features, positions[:, :processed], slots, dstate)
        dstate.lengths[slot] = start + processed
        if on_commit is not None:
            on_commit(state, start + processed)

        cut = stop_position(committed, stops)
        if cut is not None:
            committed = committed[: cut + 1]
        committed = committed[: params.max_tokens - len(output)]
        output.extend(committed)
        result.acceptance_lengths.append(len(committed))
        result.steps.append(StepStats(n, a, len(committed), tuple(drafted)))
        if cut is not None and len(committed) == cut + 1:
            result.finish_reason = FINISH_STOP
            return result
    return result

