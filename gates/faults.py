"""Deliberate engine faults, for the gates' own tests: each gate is shown to catch one.

A fault replaces one attribute (a method of a class, or a function of a module, looked up
where the engine calls it) for the duration of a `with planted(name):` block; most replace
a phase method of `SpeculativeStep` (reference_engine/runtime/speculative_step.py). The production
code has no fault branches. `python -m gates.faulty_serve FAULT SERVE_ARGS...` starts our
server with one planted, for the HTTP gate.

    with planted("skip_state_rollback"):
        generate_speculative(...)   # every engine built or stepped inside is faulty
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from reference_engine.kernels import TORCH
from reference_engine.models import dflash2 as dflash2_module
from reference_engine.models.dflash import DFlashDraft, DraftState
from reference_engine.models.dflash2 import GroupedDynamicConv
from reference_engine.models.layers import SelfAttention
from reference_engine.runtime import decode as decode_module
from reference_engine.runtime import engine as engine_module
from reference_engine.runtime import speculative_step as speculative_step_module
from reference_engine.runtime import token_choice as token_choice_module
from reference_engine.runtime.kv_pool import CellAllocator
from reference_engine.runtime.model_runner import ModelRunner
from reference_engine.runtime.prefill import Prefill
from reference_engine.runtime.sampling import sample
from reference_engine.runtime.scheduler import Scheduler
from reference_engine.runtime.sequence import Phase, Sequence
from reference_engine.runtime.speculative_step import SpeculativeStep
from reference_engine.runtime.stats import SpecCounters
from reference_engine.serving import stop_strings as stop_strings_module
from reference_engine.serving.async_engine import AsyncEngine
from reference_engine.serving.engine_process import ProcessEngine
from reference_engine.serving.generation import Generation
from reference_engine.serving.metrics import RequestMetrics, ServerMetrics
from reference_engine.serving.stop_strings import StopStringText


# ------------------------------------------------------------------ the engine beside the server
def _totals_a_turn_late(correct):
    def receive(self, events, totals):
        late, self._late_totals = getattr(self, "_late_totals", None), totals
        return correct(self, events, late if totals is not None else None)

    return receive


def _dead_engine_leaves_streams(correct):
    def fail_everything(self, reason):
        return None

    return fail_everything


# ------------------------------------------------------------------ DFlash2 drafts
def _conv_across_rows(correct):
    def grouped_conv(x, base, delta):
        # the batch's blocks run as one sequence: a row's first taps read the row before it
        return correct(x.flatten(0, 1)[None], base, delta.flatten(0, 1)[None]).view_as(x)

    return grouped_conv


def _walk_from_first_row(correct):
    def walk_greedy(edges, candidates):
        return correct(edges[:, :, :1].expand_as(edges), candidates)  # every slot as if after candidate 0

    return walk_greedy


def _sampled_walk_from_first_row(correct):
    def sample_walk(candidates, edges, *args, **kwargs):
        return correct(candidates, edges[:, :1].expand_as(edges), *args, **kwargs)

    return sample_walk


def _top_k_highest_on_tie_in_batches(correct):
    def top_candidates(logits, k):
        if logits.shape[0] == 1:
            return correct(logits, k)
        # the lowest ids of the reversed vocabulary: the highest ids among the tie at the k-th value
        flipped, _ = correct(logits.flip(-1), k)
        ids = (logits.shape[-1] - 1 - flipped).flip(-1)  # ascending again
        return ids, logits.gather(-1, ids)

    return top_candidates


def _walk_last_on_tie(correct):
    def lowest_best(scores):
        return scores.shape[-1] - 1 - correct(scores.flip(-1))  # the last of equal scores

    return lowest_best


def _narrow_verify_one_key_short(correct):
    def verify(self, block, positions, slots, valid, kv_len, *args, **kwargs):
        if block.shape[1] < self.block_size:  # a plain step or a narrowed block
            kv_len -= 1  # the row that reaches furthest attends to one key fewer
        return correct(self, block, positions, slots, valid, kv_len, *args, **kwargs)

    return verify


def _full_verify_one_key_short(correct):
    def verify(self, block, positions, slots, valid, kv_len, *args, **kwargs):
        if block.shape[0] > 1 and block.shape[1] == self.block_size:  # a batch's whole blocks
            kv_len -= 1  # the row that reaches furthest attends to one key fewer
        return correct(self, block, positions, slots, valid, kv_len, *args, **kwargs)

    return verify


def _repetition_penalty_ignores_prompt(correct):
    def choose_tokens(logits, seqs):
        prompts = [seq.prompt_ids for seq in seqs]
        try:
            for seq in seqs:
                seq.prompt_ids = []  # the penalty sees the generated tokens alone
            return correct(logits, seqs)
        finally:
            for seq, prompt in zip(seqs, prompts):
                seq.prompt_ids = prompt

    return choose_tokens


def _frequency_counted_once(correct):
    def apply_penalties(logits, output_ids, params):
        return correct(logits, sorted(set(output_ids)), params)  # each generated token once

    return apply_penalties


def _abort_mid_prefill_keeps_slot(correct):
    def abort(self, request_id):
        seq = self.known.get(request_id)
        if seq is None or seq.phase is not Phase.PREFILL:
            return correct(self, request_id)
        del self.known[request_id]  # released only from the waiting queue or a decoding row
        seq.phase, seq.finish_reason = Phase.FINISHED, "abort"
        return seq

    return abort


def _abort_keeps_draft_context(correct):
    def abort(self, request_id):
        self.scheduler.abort(request_id)  # what its plain steps deferred for the draft stays

    return abort


def _abort_keeps_cells(correct):
    def release(self, seq):
        if seq.finish_reason is None:  # an abort releases before it sets its reason
            seq.cell = None  # the cells are forgotten, never freed
        return correct(self, seq)

    return release


# ------------------------------------------------------------------ stops, streams, seeds, fall backs
def _eos_despite_ignore_eos(correct):
    def stop_ids(model, params):
        return correct(model, replace(params, ignore_eos=False))  # the model's EOS always stops

    return stop_ids


def _finished_rows_keep_decoding(correct):
    def running(self):
        # a request its prefill's first token ended (a stop) runs the step's decode anyway
        return [s for s in self.active.values() if s.phase is Phase.RUNNING]

    return running


def _rows_draw_from_the_first_rows_generator(correct):
    def accept(self, rows, proposals, draft_probs, logits, target_tokens=None):
        generators = [seq.generator for seq in rows.seqs]
        first = next((g for g in generators if g is not None), None)
        for seq in rows.seqs:
            if seq.generator is not None:
                seq.generator = first  # every sampled row's acceptance draws from one stream
        try:
            return correct(self, rows, proposals, draft_probs, logits, target_tokens)
        finally:
            for seq, generator in zip(rows.seqs, generators):
                seq.generator = generator

    return accept


def _low_acceptance_judged_a_step_early(correct):
    def check_low_acceptance(self, seq):
        after = self.fallback_after_steps
        self.fallback_after_steps = max(after - 1, 1)  # the mean taken one step before the rule's
        try:
            return correct(self, seq)
        finally:
            self.fallback_after_steps = after

    return check_low_acceptance


def _forced_schedule_ignored(correct):
    def accept(self, rows, proposals, draft_probs, logits, target_tokens=None):
        oracles = [seq.oracle for seq in rows.seqs if seq.oracle is not None and seq.oracle.forced]
        for oracle in oracles:
            oracle.forced = False  # the scheduled counts compared, not taken
        try:
            return correct(self, rows, proposals, draft_probs, logits, target_tokens)
        finally:
            for oracle in oracles:
                oracle.forced = True

    return accept


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


def _commit_past_verified_width(correct):
    def accept(self, rows, proposals, draft_probs, logits, target_tokens=None):
        accepted, bonus = correct(self, rows, proposals, draft_probs, logits, target_tokens)
        # a row narrowed by the verify width that accepted all it verified also takes the
        # next draft slot, which no verify checked
        narrowed = (accepted == rows.n_t) & (rows.n_t < self.block_size - 1)
        return accepted + narrowed.to(accepted.dtype), bonus

    return accept


def _commit_wrong_slot(correct):
    def commit_state(self, slot_ids, rows, block, processed):
        return correct(self, slot_ids[1:] + slot_ids[:1], rows, block, processed)

    return commit_state


def _shared_positions(correct):
    def anchor_positions(self, seqs):
        starts = correct(self, seqs)
        return [starts[0]] * len(starts)

    return anchor_positions


# ------------------------------------------------------------------ exact ties
def _highest_id_wins(logits: torch.Tensor) -> torch.Tensor:
    """The logits [..., vocab] with each row's highest-id maximum raised by one ulp: any
    argmax of them breaks an exact tie toward the higher id."""
    last = logits.shape[-1] - 1 - logits.flip(-1).argmax(-1, keepdim=True)  # [..., 1]
    top = logits.gather(-1, last)
    return logits.clone().scatter_(-1, last, torch.nextafter(top, torch.full_like(top, torch.inf)))


def _plain_decode_highest_on_tie(correct):
    def greedy(logits):
        return correct(_highest_id_wins(logits))

    return greedy


def _first_token_highest_on_tie(correct):
    def recorded(self, seqs, ends, logits, outputs):
        return correct(self, seqs, ends, _highest_id_wins(logits), outputs)

    return recorded


def _batched_rows_highest_on_tie(correct):
    def choose_tokens(logits, seqs):
        if len(seqs) > 1:
            logits = torch.cat([logits[:1], _highest_id_wins(logits[1:])])
        return correct(logits, seqs)

    return choose_tokens


def _draft_highest_on_tie(correct):
    def proposals(self, hidden, lm_head_weight, ops=TORCH, *args, **kwargs):
        logits, _ = correct(self, hidden, lm_head_weight, ops, *args, **kwargs)
        return logits, ops.greedy(_highest_id_wins(logits))

    return proposals


def _verify_highest_on_tie(correct):
    def accept(self, rows, proposals, draft_probs, logits, target_tokens=None):
        return correct(self, rows, proposals, draft_probs, _highest_id_wins(logits))

    return accept


# ------------------------------------------------------------------ metrics
def _stop_counted_twice(correct):
    def finish(self, finish_reason):
        first = not self.finished
        correct(self, finish_reason)
        if first and finish_reason == "stop":
            self.metrics.requests.labels(finish_reason="stop").inc()

    return finish


def _hangup_not_aborted(correct):
    def close(self):
        if not self.counted.finished:
            self.counted.finish("abort")  # counted as an abort, but the engine runs it to its end

    return close


def _stop_string_leaves_request_running(correct):
    def tokens(self, outs):
        runner = self.server.lifecycle.runner
        runner.abort = lambda request_id: None  # the reply ends at the stop string, the request runs on
        try:
            return correct(self, outs)
        finally:
            del runner.abort

    return tokens


def _stop_token_text_in_reply(correct):
    def push(self, new_ids, final, stop_token=False):
        return correct(self, new_ids, final, False)  # the stop token's text decoded as any other's

    return push


def _abort_not_in_e2e(correct):
    def finish(self, finish_reason):
        if finish_reason != "abort" or self.finished:
            return correct(self, finish_reason)
        self.finish_reason = finish_reason
        self.metrics.requests.labels(finish_reason=finish_reason).inc()
        self.metrics.prompt_tokens.inc(self.prompt_tokens)

    return finish


def _accepted_counts_bonus(correct):
    def record(self, proposed, accepted, acceptance_length):
        correct(self, proposed, accepted, acceptance_length)
        self.accepted += 1

    return record


class _PositionsFromZero:
    """An engine whose per-position acceptance counts are keyed 0-based."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    @property
    def spec_totals(self) -> SpecCounters:
        spec = self._engine.spec_totals
        shifted = type(spec.accepted_per_position)({k - 1: v for k, v in spec.accepted_per_position.items()})
        return SpecCounters(spec.steps, spec.proposed, spec.accepted, spec.acceptance_lengths, shifted)


def _positions_off_by_one(correct):
    def on_step(self, totals):
        return correct(self, _PositionsFromZero(totals))

    return on_step


def _generation_tokens_per_delivery(correct):
    def delivered(self, count, time_s):
        return correct(self, min(count, 1), time_s)

    return delivered


# ------------------------------------------------------------------ sampling and the draft
def _full_block_bonus_from_last_draft_slot(correct):
    def accept_sampled(self, proposals, draft_probs, target_probs, generator):
        accepted, bonus = correct(self, proposals, draft_probs, target_probs, generator)
        n = proposals.shape[0]
        if int(accepted) == n:  # every proposal kept: the bonus comes from p_n, not p_{n-1}
            bonus = sample(target_probs[n - 1], generator)
        return accepted, bonus

    return accept_sampled


def _draft_q_at_temperature_one(correct):
    def propose(self, rows):
        params = [seq.params for seq in rows.seqs]
        for seq in rows.seqs:
            if not seq.params.greedy:
                seq.params = replace(seq.params, temperature=1.0)
        try:
            return correct(self, rows)
        finally:
            for seq, p in zip(rows.seqs, params):
                seq.params = p

    return propose


def _draft_context_from_next_row(correct):
    def context_features(self, features, width, n_t):
        return correct(self, features, width, n_t).roll(1, dims=0)  # alone: its own

    return context_features


def _plain_step_without_draft_context(correct):
    def context_features(self, features, width, n_t):
        out = correct(self, features, width, n_t)
        # a plain step (verify width 0) verifies the anchor alone: a block of one token
        return torch.zeros_like(out) if features.shape[1] == 1 else out

    return context_features


def _deferred_context_one_position_late(correct):
    def flush_context(self, seqs, only=False):
        # the context plain steps deferred is written one position after its own
        for entry in self.deferred.values():
            entry.first += 1
        return correct(self, seqs, only)

    return flush_context


def _deferred_group_from_first_start(correct):
    def flush_context(self, seqs, only=False):
        # rows owing as many positions are appended together, all from the first one's start
        groups: dict[int, list] = {}
        for seq in seqs:
            entry = self.deferred.get(id(seq))
            if entry is not None:
                groups.setdefault(len(entry.features), []).append(entry)
        for group in groups.values():
            for entry in group[1:]:
                entry.first = group[0].first
        return correct(self, seqs, only)

    return flush_context


def _plain_step_keeps_state_before_anchor(correct):
    def verify(self, rows, block, record=True):
        # a plain step (no record: its block is kept whole) puts the Gated DeltaNet state back
        # where it was before the anchor
        plain = not record and self.target.config.is_hybrid
        if plain:
            self.state.save_rows(rows.slot_ids)
        out = correct(self, rows, block, record)
        if plain:
            self.state.restore_rows(self.state.slot_rows(rows.slot_ids))
        return out

    return verify


def _draft_block_sees_padding(correct):
    def forward(
        self, block_embeds, positions, slots, state, kv_len, valid_len=None, ops=TORCH, *args, **kwargs
    ):
        return correct(self, block_embeds, positions, slots, state, kv_len, None, ops, *args, **kwargs)

    return forward


# ------------------------------------------------------------------ chunked prefill
def _decodes_wait_for_prefill(correct):
    def running(self):
        # prefill first: nothing decodes while a prompt is still prefilling
        if any(s.phase is Phase.PREFILL for s in self.active.values()):
            return []
        return correct(self)

    return running


def _prefill_past_token_budget(correct):
    def prefilling(self):
        return [s for s in self.active.values() if s.phase is Phase.PREFILL]

    return prefilling


# ------------------------------------------------------------------ pooled KV cache
def _prefill_groups_ignore_pool(correct):
    def prefill_groups(self, lengths):
        pool, self.state.pool = self.state.pool, None  # grouped as without a pool
        try:
            return correct(self, lengths)
        finally:
            self.state.pool = pool

    return prefill_groups


def _overlapping_runs(correct):
    def allocate(self, count):
        first = correct(self, count)
        before = [start for start in self.runs if first is not None and start < first]
        if before:  # from the middle of the run before it: both requests write those rows
            del self.runs[first]
            first = max(before) + self.runs[max(before)] // 2
            self.runs[first] = count
        return first

    return allocate


def _gap_one_cell_short(correct):
    def allocate(self, count):
        start = 0
        for first, length in sorted(self.runs.items()):
            if first - start >= count - 1:  # a gap one cell short taken too
                break
            start = first + length
        if start + count > self.cells:
            return None
        self.runs[start] = count
        return start

    return allocate


def _last_cell_unused(correct):
    def allocate(self, count):
        first = correct(self, count)
        if first is not None and first + count == self.cells:  # a run that ends at the pool's end
            del self.runs[first]
            return None
        return first

    return allocate


def _last_chunk_budgeted_without_its_block(correct):
    def prefilling(self):
        seqs = [s for s in self.active.values() if s.phase is Phase.PREFILL]
        if self.max_num_batched_tokens is None:
            return seqs
        left = self.max_num_batched_tokens - sum(self.decode_tokens(s) for s in self.running())
        chosen = []
        for seq in seqs:
            # a last chunk counted without the decode or verify block its request runs in the step
            tokens = min(self.prefill_chunk, len(seq.prompt_ids) - seq.prefilled)
            if chosen and tokens > left:
                continue
            chosen.append(seq)
            left -= tokens
        return chosen

    return prefilling


def _plain_step_for_any_greedy_row(correct):
    def call(self, seqs, width=None, same_rows_next=False):
        if width == 0 and any(s.params.greedy for s in seqs):  # all(): sampled rows draw
            return self.plain_step(seqs)
        return correct(self, seqs, width, same_rows_next)

    return call


def _plain_steps_counted_as_speculative(correct):
    def record(self, seq, commit, outputs, drafted=True):
        return correct(self, seq, commit, outputs, True)  # a plain step counted as drafted

    return record


def _proposed_counts_the_drafted_block(correct):
    def call(self, seqs, width=None, same_rows_next=False):
        drafted = [min(self.block_size - 1, s.remaining) for s in seqs]  # before the width cut
        commits = correct(self, seqs, width, same_rows_next)
        if not width:
            return commits
        return [c._replace(proposed=n) for c, n in zip(commits, drafted)]

    return call


def _draft_context_at_chunk_positions(correct):
    def prefill(self, ids, start, slot, speculative):
        if not speculative or start == 0:
            return correct(self, ids, start, slot, speculative)
        append = type(self.draft).append_context

        def shifted(features, positions, *args, **kwargs):
            # a later prompt chunk's draft context written at the chunk's own positions
            return append(self.draft, features, positions - start, *args, **kwargs)

        self.draft.append_context = shifted
        try:
            return correct(self, ids, start, slot, speculative)
        finally:
            del self.draft.append_context

    return prefill


def _stop_on_the_last_token_is_length(correct):
    def append(self, tokens):
        kept = correct(self, tokens)
        if self.finish_reason == "stop" and self.remaining == 0:
            self.finish_reason = "length"  # the budget checked before the stop
        return kept

    return append


# ------------------------------------------------------------------ step records and turns
def _turn_verify_one_key_short(correct):
    def turn_step(self, rows, table, written, W, k):
        nxt, block = correct(self, rows, table, written, W, k)
        # the furthest row's last block position is left out of what the verify reads
        nxt.kv_len = min(nxt.kv_len, int(nxt.positions.max()))
        return nxt, block

    return turn_step


def _turn_context_one_short(correct):
    def turn(self, seqs, width, steps, same_rows_next=False):
        if steps <= 1 or not self.turn_fits(seqs, width):
            return correct(self, seqs, width, steps, same_rows_next)
        commit = type(self).commit_eagerly

        def short(rows, block, out, processed, written):
            # the draft context of the block's last position is left out
            return commit(self, rows, block, out, processed, written - (written == block.shape[1]))

        self.commit_eagerly = short
        try:
            return correct(self, seqs, width, steps, same_rows_next)
        finally:
            del self.commit_eagerly

    return turn


def _accepted_past_row_draft(correct):
    def accept_greedy(self, proposals, target_tokens, n_t):
        # a shorter row's padding slots counted too, when their proposals match
        return correct(self, proposals, target_tokens, torch.full_like(n_t, proposals.shape[1]))

    return accept_greedy


def _turn_positions_one_behind(correct):
    def next_positions(self, processed, anchors_at, N, n):
        return correct(self, processed - 1, anchors_at, N, n)  # the next anchor one position early

    return next_positions


def _conv_drops_last_tap(correct):
    def grouped_conv(x, base, delta):
        base, delta = base.clone(), delta.clone()
        base[-1] = 0
        delta[:, :, -1] = 0
        return correct(x, base, delta)

    return grouped_conv


def _after_conv_reads_before_side(correct):
    def forward(self, x, delta, side):
        return correct(self, x, delta, 0)

    return forward


def _first_listed_stop_cuts(correct):
    def earliest(text, stops, start):
        for stop in stops:
            at = text.find(stop, start)
            if at >= 0:
                return at  # the first stop string listed, not the one that begins first
        return None

    return earliest


def _logit_bias_from_second_token(correct):
    def apply_penalties(logits, output_ids, params):
        return correct(logits, output_ids, params if output_ids else replace(params, logit_bias=()))

    return apply_penalties


def _draft_rows_are_slots(correct):
    def cache_rows(self, slots):
        return slots

    return cache_rows


# ------------------------------------------------------------------ model forwards
def _window_one_wide_past_the_prefix(correct):
    def forward(self, x, ctx, layer):
        if self.sliding_window is None or x.shape[1] == 1 or int(ctx.positions.min()) == 0:
            return correct(self, x, ctx, layer)
        window = self.sliding_window
        self.sliding_window = window + 1  # one key older than the window stays visible
        try:
            return correct(self, x, ctx, layer)
        finally:
            self.sliding_window = window

    return forward


# ------------------------------------------------------------------ numerical failure
def _greedy_takes_an_infinite_maximum(correct):
    def select(numerics, device, dtype):
        ops = correct(numerics, device, dtype)

        def greedy(logits):
            best, ids = logits.max(dim=-1)
            return torch.where(best.isnan(), logits.shape[-1], ids)  # +inf's id, or 0 for -inf

        return replace(ops, greedy=greedy)

    return select


def _failed_bonus_drafts_as_a_token(correct):
    def anchor_ids(self, bonus):
        return bonus  # a failed row's `vocab` goes on to index the embeddings

    return anchor_ids


FAULTS: dict[str, Fault] = {
    "skip_state_rollback": Fault(
        "hybrid: keep the Gated DeltaNet state of the whole verified block",
        "commit_state",
        _skip_state_rollback,
    ),
    "skip_length_rollback": Fault(
        "keep every verified position as committed, rejected ones too", "processed", _skip_length_rollback
    ),
    "feature_off_by_one": Fault(
        "feed the draft, for each committed position, the next one's features",
        "context_features",
        _feature_off_by_one,
    ),
    "wrong_bonus_position": Fault(
        "take the bonus from the target's choice one slot too far", "bonus_index", _wrong_bonus_position
    ),
    "never_accept_full_block": Fault(
        "reject the last draft token even when it matches", "accept_greedy", _never_accept_full_block
    ),
    "bonus_ignores_residual": Fault(
        "sampling: draw a rejected slot's replacement from p, not p - q",
        "accept_sampled",
        _bonus_ignores_residual,
    ),
    "commit_past_verified_width": Fault(
        "verify width: count one draft slot past the verified width as accepted",
        "accept",
        _commit_past_verified_width,
    ),
    "plain_step_without_draft_context": Fault(
        "verify width: a plain step (width 0) hands the draft zeros for the anchor's context",
        "context_features",
        _plain_step_without_draft_context,
    ),
    "deferred_context_one_position_late": Fault(
        "verify width: the context plain steps deferred reaches the draft one position late",
        "flush_context",
        _deferred_context_one_position_late,
    ),
    "deferred_group_from_first_start": Fault(
        "verify width: rows whose plain steps deferred as many positions get their context "
        "written from the first such row's start",
        "flush_context",
        _deferred_group_from_first_start,
    ),
    "plain_step_keeps_state_before_anchor": Fault(
        "verify width: a plain step (width 0) leaves the Gated DeltaNet state where it was before the anchor",
        "verify",
        _plain_step_keeps_state_before_anchor,
    ),
    "commit_wrong_slot": Fault(
        "engine: commit each row's state into the next row's slot", "commit_state", _commit_wrong_slot
    ),
    "shared_positions": Fault(
        "engine: give every row of a batched step the first row's positions",
        "anchor_positions",
        _shared_positions,
    ),
    "plain_decode_highest_on_tie": Fault(
        "plain decode alone: break exact ties toward the higher id",
        "greedy",
        _plain_decode_highest_on_tie,
        decode_module,
    ),
    "first_token_highest_on_tie": Fault(
        "engine: the first token after prefill breaks exact ties toward the higher id",
        "recorded",
        _first_token_highest_on_tie,
        Prefill,
    ),
    "batched_rows_highest_on_tie": Fault(
        "engine: every row of a plain batch but the first breaks exact ties toward the higher id",
        "choose_tokens",
        _batched_rows_highest_on_tie,
        engine_module,
    ),
    "draft_highest_on_tie": Fault(
        "the draft proposes the higher id of an exact tie", "proposals", _draft_highest_on_tie, DFlashDraft
    ),
    "verify_highest_on_tie": Fault(
        "the verify breaks exact ties toward the higher id", "accept", _verify_highest_on_tie
    ),
    "plain_step_for_any_greedy_row": Fault(
        "verify width: a plain step (width 0) takes the greedy path when any row is greedy, "
        "its sampled rows given the argmax",
        "__call__",
        _plain_step_for_any_greedy_row,
    ),
    "plain_steps_counted_as_speculative": Fault(
        "verify width: a plain step (width 0) is recorded as a speculative step that drafted nothing",
        "_record_speculative",
        _plain_steps_counted_as_speculative,
        engine_module.Engine,
    ),
    "proposed_counts_the_drafted_block": Fault(
        "verify width: a narrowed step records the draft tokens of the whole block as verified, "
        "not those it verified (acceptance statistics)",
        "__call__",
        _proposed_counts_the_drafted_block,
    ),
    "draft_context_at_chunk_positions": Fault(
        "chunked prefill: a later prompt chunk's draft context is written at positions counted "
        "from the chunk's start",
        "prefill",
        _draft_context_at_chunk_positions,
        ModelRunner,
    ),
    "stop_on_the_last_token_is_length": Fault(
        'requests: a stop token that is also the max_tokens-th token ends the request as "length"',
        "append",
        _stop_on_the_last_token_is_length,
        Sequence,
    ),
    "narrow_verify_one_key_short": Fault(
        "verify width: a verify narrower than the block (a plain step or a narrowed one) attends "
        "to one key fewer than its furthest row holds",
        "verify",
        _narrow_verify_one_key_short,
        ModelRunner,
    ),
    "full_verify_one_key_short": Fault(
        "batches: a verify of whole blocks attends to one key fewer than its furthest row holds "
        "(only its last block slot, the bonus after a whole accepted block, loses a key)",
        "verify",
        _full_verify_one_key_short,
        ModelRunner,
    ),
    "repetition_penalty_ignores_prompt": Fault(
        "sampling: the repetition penalty of a decode step sees the generated tokens, not the prompt",
        "choose_tokens",
        _repetition_penalty_ignores_prompt,
        engine_module,
    ),
    "frequency_counted_once": Fault(
        "sampling: the frequency penalty counts each generated token once, however often it came",
        "apply_penalties",
        _frequency_counted_once,
        token_choice_module,
    ),
    "abort_mid_prefill_keeps_slot": Fault(
        "scheduler: a request aborted between two prompt chunks keeps its slot (it is finished "
        "later, counted, and its id stays taken)",
        "abort",
        _abort_mid_prefill_keeps_slot,
        Scheduler,
    ),
    "abort_keeps_cells": Fault(
        "scheduler: an aborted request's pooled KV cells are never freed",
        "_release",
        _abort_keeps_cells,
        Scheduler,
    ),
    "abort_keeps_draft_context": Fault(
        "engine: an aborted request's deferred draft context (from its plain steps) is never "
        "dropped, and the engine holds it after the request has gone (lossless)",
        "abort",
        _abort_keeps_draft_context,
        engine_module.Engine,
    ),
    "stop_counted_twice": Fault(
        "metrics: a request that ends on a stop is counted twice",
        "finish",
        _stop_counted_twice,
        RequestMetrics,
    ),
    "hangup_not_aborted": Fault(
        "server: a client that hangs up mid-stream is counted as an abort, but its request is "
        "left running in the engine to its last token",
        "close",
        _hangup_not_aborted,
        Generation,
    ),
    "stop_string_leaves_request_running": Fault(
        "server: a request a stop string ends is answered, but left running in the engine to its last token",
        "_tokens",
        _stop_string_leaves_request_running,
        Generation,
    ),
    "stop_token_text_in_reply": Fault(
        "server: the stop token that ends a request (EOS, a stop_token_ids entry) adds its text to the reply",
        "push",
        _stop_token_text_in_reply,
        StopStringText,
    ),
    "abort_not_in_e2e": Fault(
        "metrics: an aborted request is left out of the e2e latency histogram",
        "finish",
        _abort_not_in_e2e,
        RequestMetrics,
    ),
    "accepted_counts_bonus": Fault(
        "statistics: accepted counts the bonus token", "record", _accepted_counts_bonus, SpecCounters
    ),
    "positions_off_by_one": Fault(
        "metrics: per-position acceptance labelled from 0", "on_step", _positions_off_by_one, ServerMetrics
    ),
    "totals_a_turn_late": Fault(
        "metrics: each turn's engine totals applied with the next turn's outputs (a client has "
        "its tokens before the counters have their step)",
        "receive",
        _totals_a_turn_late,
        AsyncEngine,
    ),
    "dead_engine_leaves_streams": Fault(
        "server: an engine process that dies leaves the requests in flight waiting",
        "fail_everything",
        _dead_engine_leaves_streams,
        ProcessEngine,
    ),
    "generation_tokens_per_delivery": Fault(
        "metrics: one generation token counted per delivery, however many a step carried",
        "delivered",
        _generation_tokens_per_delivery,
        RequestMetrics,
    ),
    "full_block_bonus_from_last_draft_slot": Fault(
        "sampling: after a fully accepted block, draw the bonus from the target's distribution "
        "at the last draft slot instead of the slot after it",
        "accept_sampled",
        _full_block_bonus_from_last_draft_slot,
    ),
    "draft_q_at_temperature_one": Fault(
        "sampling: the draft's q and its proposals at temperature 1, whatever the request's "
        "(lossless: costs acceptance only)",
        "propose",
        _draft_q_at_temperature_one,
    ),
    "draft_context_from_next_row": Fault(
        "batches: each row's new draft context is the previous row's features (lossless: "
        "costs acceptance only)",
        "context_features",
        _draft_context_from_next_row,
    ),
    "draft_block_sees_padding": Fault(
        "batches: the draft's block attention also sees the padding of rows with fewer draft "
        "slots (lossless: costs acceptance only)",
        "forward",
        _draft_block_sees_padding,
        DFlashDraft,
    ),
    "decodes_wait_for_prefill": Fault(
        "scheduling: requests already decoding get no token while a prompt prefills (lossless: "
        "costs their inter-token latency only)",
        "running",
        _decodes_wait_for_prefill,
        Scheduler,
    ),
    "prefill_past_token_budget": Fault(
        "scheduling: every prefilling request runs a chunk each step, past max_num_batched_tokens "
        "(lossless: costs the step's latency only)",
        "prefilling",
        _prefill_past_token_budget,
        Scheduler,
    ),
    "dflash2_conv_across_rows": Fault(
        "DFlash2: the convolution's taps cross the block boundary into the previous row's block "
        "(lossless: costs acceptance only)",
        "grouped_conv",
        _conv_across_rows,
        dflash2_module,
    ),
    "dflash2_walk_ignores_predecessor": Fault(
        "DFlash2: the greedy walk scores every slot from its first candidate, not the one chosen "
        "before it (lossless: costs acceptance only)",
        "walk_greedy",
        _walk_from_first_row,
        dflash2_module,
    ),
    "dflash2_sampled_walk_ignores_predecessor": Fault(
        "DFlash2: the sampled walk draws every slot from the edges of its first candidate "
        "(lossless, q and draws agree: costs acceptance only)",
        "sample_walk",
        _sampled_walk_from_first_row,
        speculative_step_module,
    ),
    "dflash2_top_k_highest_on_tie_in_batches": Fault(
        "DFlash2: in a batch of more than one row, the candidates keep the highest ids among "
        "logits tied at the K-th value (lossless: costs acceptance only)",
        "top_candidates",
        _top_k_highest_on_tie_in_batches,
        dflash2_module,
    ),
    "kv_pool_overlapping_runs": Fault(
        "pooled KV cache: a request's run starts in the middle of the run before it (two live "
        "requests write the same rows)",
        "allocate",
        _overlapping_runs,
        CellAllocator,
    ),
    "kv_pool_gap_one_cell_short": Fault(
        "pooled KV cache: a run is placed in a free gap one cell shorter than it (its last cell is "
        "the first of the live run after it)",
        "allocate",
        _gap_one_cell_short,
        CellAllocator,
    ),
    "kv_pool_last_cell_unused": Fault(
        "pooled KV cache: a run that would end at the pool's last cell is refused (a request that "
        "needs the whole pool waits for ever)",
        "allocate",
        _last_cell_unused,
        CellAllocator,
    ),
    "last_chunk_budgeted_without_its_block": Fault(
        "scheduling: a prompt's last chunk is fitted to max_num_batched_tokens without the decode "
        "or verify block its request runs in the same step (lossless: costs the step's latency only)",
        "prefilling",
        _last_chunk_budgeted_without_its_block,
        Scheduler,
    ),
    "prefill_padding_past_cells": Fault(
        "pooled KV cache: batched first prefills grouped across token buckets, so a short prompt "
        "is padded to a longer one's bucket and writes past the cells its request holds",
        "prefill_groups",
        _prefill_groups_ignore_pool,
        ModelRunner,
    ),
    "dflash2_walk_last_on_tie": Fault(
        "DFlash2: the greedy walk takes the last of equal edge scores, the highest id of an exact "
        "tie, on every path (lossless: costs acceptance only)",
        "lowest_best",
        _walk_last_on_tie,
        dflash2_module,
    ),
    "turn_verify_one_key_short": Fault(
        "turns of several steps: a step after a turn's first verifies with one key fewer than its "
        "furthest row's block holds (on the demo pair the output stays plain greedy's)",
        "turn_step",
        _turn_verify_one_key_short,
    ),
    "turn_context_one_short": Fault(
        "turns of several steps: a step's commit leaves out the draft context of its block's last "
        "position (a row that accepted its whole block drafts next without it; lossless: costs "
        "acceptance only)",
        "turn",
        _turn_context_one_short,
    ),
    "accepted_past_row_draft": Fault(
        "batches: a row with fewer draft tokens than the block also accepts its padding slots "
        "where their proposals match (lossless: cut at max_tokens; the records only)",
        "accept_greedy",
        _accepted_past_row_draft,
    ),
    "turn_positions_one_behind": Fault(
        "turns of several steps: each step after a turn's first lays its block out one position "
        "before where the step before it left the row",
        "next_positions",
        _turn_positions_one_behind,
    ),
    "dflash2_conv_drops_last_tap": Fault(
        "DFlash2: the grouped convolution leaves out its last tap (lossless: costs acceptance only)",
        "grouped_conv",
        _conv_drops_last_tap,
        dflash2_module,
    ),
    "dflash2_after_conv_reads_before_side": Fault(
        "DFlash2: the convolution after each sublayer runs the before side's tap table (lossless: "
        "costs acceptance only)",
        "forward",
        _after_conv_reads_before_side,
        GroupedDynamicConv,
    ),
    "stop_string_first_listed_cuts": Fault(
        "server: when a token completes two stop strings, the text is cut at the first one listed, "
        "not at the one that begins first",
        "earliest",
        _first_listed_stop_cuts,
        stop_strings_module,
    ),
    "logit_bias_from_second_token": Fault(
        "token choice: a request's logit bias applies from its second token on (the first, chosen "
        "from the prefill's logits, goes unbiased)",
        "apply_penalties",
        _logit_bias_from_second_token,
        token_choice_module,
    ),
    "pooled_draft_rows_are_slots": Fault(
        "pooled KV cache: the draft's context keys and values go to the rows of the slot ids, not "
        "to the request's cells (lossless: costs acceptance only)",
        "cache_rows",
        _draft_rows_are_slots,
        DraftState,
    ),
    "eos_ends_an_output_that_ignores_eos": Fault(
        "stops: the model's EOS ends a request that asks to ignore EOS (plain decode, which shares "
        "the stop set, ends there too)",
        "stop_ids",
        _eos_despite_ignore_eos,
        engine_module,
    ),
    "finished_rows_keep_decoding": Fault(
        "scheduling: a request whose first token (from its prefill) is a stop still decodes in that "
        "step, and streams a token after its finished output",
        "running",
        _finished_rows_keep_decoding,
        Scheduler,
    ),
    "sampled_rows_draw_from_the_first_rows_generator": Fault(
        "sampling: every sampled row's acceptance draws from the first sampled row's generator (the "
        "distribution stays right; a seeded request's tokens depend on its batch neighbours)",
        "accept",
        _rows_draw_from_the_first_rows_generator,
    ),
    "low_acceptance_judged_a_step_early": Fault(
        "fall back: a request's low acceptance is judged one step before fallback_after_steps",
        "check_low_acceptance",
        _low_acceptance_judged_a_step_early,
        Scheduler,
    ),
    "forced_schedule_ignored": Fault(
        "benchmarks: a forced oracle's scheduled counts are compared with the target's choices, not "
        "taken (on random weights nothing is accepted; the benchmark measures another acceptance)",
        "accept",
        _forced_schedule_ignored,
    ),
    "sliding_window_one_wide_past_the_prefix": Fault(
        "models: a forward of several tokens after a cached prefix (a verify, a later prompt chunk) "
        "sees one key past a sliding layer's window (prefill from the start and decode steps do not)",
        "forward",
        _window_one_wide_past_the_prefix,
        SelfAttention,
    ),
    "greedy_takes_an_infinite_maximum": Fault(
        "numerical failure: the engine's greedy fails a row holding a NaN only; a row whose maximum "
        "is +inf commits that token, a row of -inf throughout token 0",
        "select",
        _greedy_takes_an_infinite_maximum,
        engine_module,
    ),
    "failed_bonus_drafts_as_a_token": Fault(
        "numerical failure: a failed row's bonus (`vocab`, not a token) anchors the next step of a "
        "turn and the draft queued ahead, an embedding index out of range",
        "anchor_ids",
        _failed_bonus_drafts_as_a_token,
    ),
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


# ------------------------------------------------------------------ lying HTTP candidates
# For the HTTP gate (gates/test_http_equivalence.py): gates/lying_server.py forwards to an
# honest server and applies one of these to what it answers; `harness compare` must fail on
# each with one of the verdicts in `expect` ("mismatch:WHAT" names what differed).
from . import lying_server as _liar  # noqa: E402

LIES: dict[str, _liar.Lie] = {
    "text_wrong_ids_right": _liar.Lie(
        "the right token ids with one character of the text changed",
        ("mismatch:text",),
        answer=_liar.change_text,
    ),
    "ids_wrong_text_right": _liar.Lie(
        "the right text with the first token id changed", ("mismatch:ids_text",), answer=_liar.change_first_id
    ),
    "withheld_ids": _liar.Lie(
        "the token ids and the usage its server kind returns, withheld (the text stays right)",
        ("missing_ids",),
        answer=_liar.withhold_ids,
    ),
    "another_token": _liar.Lie(
        "another first token, text and usage in step with it",
        ("mismatch:token",),
        answer=_liar.other_first_token,
    ),
    "one_token_short": _liar.Lie(
        "stop one token early (ids, text and usage agree)", ("mismatch:length",), answer=_liar.drop_last_token
    ),
    "one_token_long": _liar.Lie(
        "one token more than the honest answer (ids, text and usage agree)",
        ("mismatch:length",),
        answer=_liar.repeat_last_token,
    ),
    "wrong_reasoning": _liar.Lie(
        "a chat reply with the right content and ids and another reasoning_content (added where "
        "the honest reply has none)",
        ("mismatch:reasoning",),
        answer=_liar.change_reasoning,
    ),
    "added_tool_call": _liar.Lie(
        "a chat reply with the right content and ids and a tool call the honest reply does not make",
        ("mismatch:tool_calls",),
        answer=_liar.add_tool_call,
    ),
    "wrong_finish_reason": _liar.Lie(
        "the right tokens with the other finish_reason",
        ("mismatch:finish_reason",),
        answer=_liar.flip_finish_reason,
    ),
    "usage_off_by_one": _liar.Lie(
        "usage.completion_tokens one more than the tokens sent",
        ("inconsistent_answer",),
        answer=_liar.usage_one_more,
    ),
    "usage_a_chunk_late": _liar.Lie(
        "a stream whose running usage (continuous_usage_stats) counts each chunk's tokens one "
        "chunk late (the final usage right)",
        ("inconsistent_answer",),
        events=_liar.usage_a_chunk_late,
    ),
    "wrong_prompt_tokens": _liar.Lie(
        "the right answer, claiming one prompt token more", ("mismatch:prompt",), answer=_liar.prompt_one_more
    ),
    "answers_another_prompt": _liar.Lie(
        "answer a different prompt (text or ids changed on the way)",
        ("mismatch:prompt",),
        request=_liar.other_prompt,
    ),
    "stale_answer": _liar.Lie(
        "send the answer to the request before (a slot mix-up)", ("mismatch",), reply=_liar.stale_answer
    ),
    "empty_choices": _liar.Lie(
        "HTTP 200 with choices: []",
        ("empty_choices",),
        body=_liar.empty_choices_body,
        events=_liar.empty_choices_events,
    ),
    "error_object": _liar.Lie(
        "HTTP 200 with an error object (a stream: an error event)",
        ("error_object",),
        body=_liar.error_body,
        events=_liar.error_events,
    ),
    "refuses_token_id_prompts": _liar.Lie(
        "hide its server kind from the probe and refuse token-id prompts with HTTP 400 (taken "
        "for a text-only server, it would be judged on its text prompts alone)",
        ("unsent",),
        refuse=_liar.refuse_token_id_prompts,
        get=_liar.hide_server_kind,
        args=("--server-kind", "auto"),
    ),
    "not_json": _liar.Lie("HTTP 200 with an HTML page", ("malformed_body",), reply=_liar.not_json),
    "cut_short": _liar.Lie(
        "the body cut in half (a stream: ended before its finish_reason)",
        ("malformed_body", "truncated_stream"),
        body=_liar.cut_body,
        events=_liar.cut_stream,
    ),
    "http_500": _liar.Lie("HTTP 500", ("http_500",), reply=_liar.http_500),
    "two_choices": _liar.Lie(
        "two choices where one was asked for",
        ("malformed_body",),
        body=_liar.two_choices_body,
        events=_liar.two_choices_events,
    ),
    "split_choices": _liar.Lie(
        "a stream whose token chunks after the first are sent as choice 1 (the honest tokens, "
        "in order, as two choices)",
        ("malformed_body",),
        events=_liar.split_choices_events,
    ),
    "null_text": _liar.Lie(
        "a text that is not a string",
        ("malformed_body",),
        body=_liar.null_text_body,
        events=_liar.null_text_events,
    ),
    "duplicated_chunk": _liar.Lie(
        "a stream with its first token chunk sent twice",
        ("inconsistent_answer", "mismatch"),
        events=_liar.duplicate_chunk,
    ),
    "missing_chunk": _liar.Lie(
        "a stream without its first token chunk", ("inconsistent_answer", "mismatch"), events=_liar.drop_chunk
    ),
    "tokens_after_finish": _liar.Lie(
        "a stream with a token chunk after the finish_reason",
        ("malformed_body",),
        events=_liar.tokens_after_finish,
    ),
    "two_chunks_one_event": _liar.Lie(
        "a stream whose first two token chunks are two data: lines of one event (no blank line "
        "between them: a client reads one data text, two JSON objects joined by a newline)",
        ("malformed_body",),
        events=_liar.two_chunks_in_one_event,
    ),
}
