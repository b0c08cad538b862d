"""Choosing the next token for plain-decode rows: greedy, sampled, repetition penalty,
top logprobs. One host transfer per call."""

from __future__ import annotations

import torch

from .penalties import apply_penalties
from .sampling import greedy, probabilities, sample
from .sequence import Sequence


def apply_repetition_penalty(
    logits: torch.Tensor,
    seen: list[int],
    penalty: float,  # logits: [vocab]
) -> torch.Tensor:
    """The usual rule: a seen token's positive logit is divided by the penalty, a negative
    one multiplied."""
    if penalty == 1.0 or not seen:
        return logits
    ids = torch.tensor(sorted(set(seen)), device=logits.device)
    picked = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def choose_tokens(
    logits: torch.Tensor,  # [batch, vocab], one row per sequence
    seqs: list[Sequence],
) -> tuple[list[list[int]], list[list[dict[int, float]] | None]]:
    """One next token per row, as single-token lists; plus, for rows that asked, the top
    logprobs (the chosen token always included): the log-softmax of the row's logits after the
    repetition penalty, presence/frequency penalties and logit bias, before temperature, top-k
    and top-p. A greedy row's token is their argmax; a sampled row's came from the tempered,
    truncated distribution, whose probabilities these are not."""
    rows = []
    for i, seq in enumerate(seqs):
        params = seq.params
        row = apply_repetition_penalty(logits[i], seq.prompt_ids + seq.output_ids, params.repetition_penalty)
        row = apply_penalties(row, seq.output_ids, params)
        if params.greedy:
            rows.append((greedy(row), row))
        else:
            probs = probabilities(row, params.temperature, params.top_k, params.top_p)
            rows.append((sample(probs, seq.generator), row))
    tokens = torch.stack([t for t, _ in rows]).tolist()  # the host transfer
    logprobs: list[list[dict[int, float]] | None] = []
    for (_, row), seq, tok in zip(rows, seqs, tokens):
        k = seq.params.logprobs
        if k is None or not 0 <= tok < row.shape[-1]:  # no token: the engine fails this row
            logprobs.append(None)
            continue
        lp = torch.log_softmax(row.double(), dim=-1)
        top = lp.topk(k) if k else None
        entry = {int(tok): float(lp[tok])}
        if top is not None:
            entry.update(zip(top.indices.tolist(), top.values.tolist()))
        logprobs.append([entry])
    return [[t] for t in tokens], logprobs
