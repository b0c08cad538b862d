"""The DFlash2 selector's walk at temperature > 0 (docs/dflash2.md, "Sampling").

The greedy walk lives with the selector (models/dflash2.py). A sampled row instead draws
slot by slot along the path: slot j's distribution is the request's sampling distribution
(temperature, top-k, top-p) over the edge scores from the candidate slot j - 1 drew to slot
j's K candidates, zero on every other token. That distribution is the q the lossless verify
needs: each proposal is drawn from exactly it, given the proposals before it, which is all
speculative sampling asks of a draft (accept_sampled in sampling.py).
"""

from __future__ import annotations

import torch

from .sampling import probabilities, sample


def sample_walk(
    candidates: torch.Tensor,  # [n, K] one row's candidates per draft slot
    edges: torch.Tensor,  # [n, K, K] edge(p -> c) per slot
    vocab_size: int,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one row's n proposals along the selector's path from the anchor. Returns
    (proposals [n], q [n, vocab]: the distribution each proposal was drawn from). No host
    synchronisation: the drawn candidate's index stays on the device."""
    n, K = candidates.shape
    previous = torch.zeros(1, dtype=torch.int64, device=candidates.device)  # slot 1: the anchor's row
    scores = torch.full((n, vocab_size), float("-inf"), dtype=edges.dtype, device=edges.device)
    tokens, probs = [], []
    for j in range(n):
        scores[j].scatter_(0, candidates[j], edges[j].index_select(0, previous)[0])
        q = probabilities(scores[j], temperature, top_k, top_p)
        token = sample(q, generator)
        # the successor's row of the next slot; a row that drew no valid token walks on from 0
        previous = (candidates[j] == token).to(torch.int64).argmax()[None]
        tokens.append(token)
        probs.append(q)
    return torch.stack(tokens), torch.stack(probs)
