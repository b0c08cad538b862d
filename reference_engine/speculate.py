"""One batched DFlash step for the engine's speculative requests.

Rows are requests at different positions with different remaining budgets: row i drafts
n_i = min(B - 1, remaining_i) tokens; shorter rows are padded to the longest, and padding
never counts: the draft's block attention stops at each row's last real token, the verify
forward leaves the Gated DeltaNet state alone on padded tokens (`valid_len`), and a row
never accepts past n_i. One draft forward, one verify forward, then per-row acceptance and
commit (commit.py), all without a host sync until the one transfer of the results.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .commit import commit_hybrid, needs_snapshot, verify_record
from .sampling import accept_greedy, accept_sampled, greedy, probabilities, sample
from .sequence import Sequence

if TYPE_CHECKING:
    from .engine import Engine, StepOutput


def speculate(engine: Engine, seqs: list[Sequence], outputs: list[StepOutput]) -> None:
    target, draft, state, dstate = engine.target, engine.draft, engine.state, engine.draft_state
    dcfg, timer, device = draft.config, engine.timer, engine.device
    strategy, fault = engine.config.commit_strategy, engine.config.fault
    B = engine.block_size
    b = len(seqs)
    n = [min(B - 1, s.remaining) for s in seqs]
    N = max(n)
    starts = [state.lengths[s.slot] for s in seqs]  # positions of the anchors
    slot_ids = [s.slot for s in seqs]
    slots = torch.tensor(slot_ids, device=device)
    if fault == "shared_positions":
        starts = [starts[0]] * b
    positions = torch.tensor(starts, device=device)[:, None] + torch.arange(N + 1, device=device)
    n_t = torch.tensor(n, device=device)
    valid = n_t + 1
    kv_len = max(starts) + N + 1

    with timer.phase("draft"):
        block = torch.tensor([[s.output_ids[-1]] + [dcfg.mask_token_id] * N for s in seqs],
                             device=device)
        hidden = draft(target.embed(block) * dcfg.input_embedding_scale, positions, slots,
                       dstate, kv_len, valid_len=valid)
        draft_logits = draft.logits(hidden[:, 1:], target.lm_head_weight)  # [b, N, vocab]
        proposals = greedy(draft_logits)  # [b, N]
        draft_probs = [None] * b
        for i, seq in enumerate(seqs):
            if seq.oracle is not None:
                guess = seq.oracle.propose(seq.spec.steps, len(seq.output_ids), n[i])
                proposals[i, : n[i]] = torch.tensor(guess, device=device)
            elif not seq.params.greedy:
                p = seq.params
                draft_probs[i] = probabilities(draft_logits[i, : n[i]], p.temperature, p.top_k,
                                               p.top_p)
                proposals[i, : n[i]] = sample(draft_probs[i], seq.generator)
        block[:, 1:] = proposals

    with timer.phase("verify"):
        if target.config.is_hybrid and needs_snapshot(strategy):
            for slot in slot_ids:
                state.save(slot)
        out = target(block, positions, slots, state, kv_len,
                     capture_layers=dcfg.target_layer_ids,
                     valid_len=valid, record=verify_record(strategy, target))

    with timer.phase("accept"):
        target_tokens = greedy(out.logits)  # [b, N + 1]
        accepted, _ = accept_greedy(proposals, target_tokens)
        cap = n_t - 1 if fault == "never_accept_full_block" else n_t
        accepted = torch.minimum(accepted, cap)  # padding is never accepted
        for i, seq in enumerate(seqs):
            if seq.oracle is not None and seq.oracle.forced:  # benchmarks only
                accepted[i] = seq.oracle.scheduled(seq.spec.steps, n[i])
        bonus_at = (accepted + 1).clamp(max=n_t) if fault == "wrong_bonus_position" else accepted
        bonus = target_tokens.gather(1, bonus_at[:, None])[:, 0]
        for i, seq in enumerate(seqs):
            if not seq.params.greedy:
                p = seq.params
                target_probs = probabilities(out.logits[i, : n[i] + 1], p.temperature, p.top_k,
                                             p.top_p)
                a_i, bonus_i = accept_sampled(proposals[i : i + 1, : n[i]], draft_probs[i][None],
                                              target_probs[None], seq.generator)
                if fault == "bonus_ignores_residual":
                    bonus_i = sample(target_probs[a_i], seq.generator)
                accepted[i], bonus[i] = a_i[0], bonus_i[0]
        # the one host transfer of the step
        flat = torch.cat([accepted, bonus, proposals.flatten()]).tolist()
        acc_list, bonus_list = flat[:b], flat[b : 2 * b]
        drafted = [flat[2 * b + i * N : 2 * b + i * N + n[i]] for i in range(b)]

    with timer.phase("commit"):
        processed = n_t + 1 if fault == "skip_length_rollback" else accepted + 1
        kept = [n_i + 1 for n_i in n] if fault == "skip_length_rollback" else \
            [a + 1 for a in acc_list]
        if fault != "skip_state_rollback":
            commit_slots = slot_ids[1:] + slot_ids[:1] if fault == "commit_wrong_slot" \
                else slot_ids
            commit_hybrid(strategy, target, state, commit_slots, block, positions, processed,
                          kv_len)
        width = max(kept)
        rows = torch.arange(width, device=device)
        if fault == "feature_off_by_one":  # each position gets the next position's row
            rows = torch.minimum(rows + 1, n_t[:, None])
            features = out.features.gather(
                1, rows[..., None].expand(-1, -1, out.features.shape[-1]))
        else:
            features = out.features[:, :width]
        draft.append_context(features, positions[:, :width], slots, dstate)

    for i, seq in enumerate(seqs):
        a = acc_list[i]
        state.lengths[seq.slot] = starts[i] + kept[i]
        dstate.lengths[seq.slot] = starts[i] + kept[i]
        if engine.commit_observer is not None:
            engine.commit_observer(seq, state, starts[i] + kept[i])
        before = len(seq.output_ids)
        engine._emit(seq, drafted[i][:a] + [bonus_list[i]], outputs)
        committed = len(seq.output_ids) - before
        seq.record_step(n[i], a, committed, drafted[i])
        engine.spec_totals.record(n[i], a, committed)
        engine.check_low_acceptance(seq)
