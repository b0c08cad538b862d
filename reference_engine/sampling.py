"""Token choice: greedy with the lowest-id tie rule (speculative acceptance joins later)."""

from __future__ import annotations

import torch


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last axis; on an exact tie the lowest token id wins, on every backend.

    logits: [..., vocab] -> [...] (int64). No host synchronisation.
    """
    vocab = logits.shape[-1]
    best = logits.max(dim=-1, keepdim=True).values
    ids = torch.arange(vocab, device=logits.device)
    return torch.where(logits == best, ids, vocab).min(dim=-1).values
