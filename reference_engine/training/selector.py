"""The training loss of a DFlash2 draft's candidate selector (docs/dflash2.md, "Training").

At serving time the selector walks from the verified anchor: block slot j takes, among its K
candidates (the K best tokens of the draft's logits for that slot), the one with the best
edge from the token slot j - 1 took, `edge(p -> c) = <P[p] * project(h_j), S[c]> +
logits_j[c]`. Training teacher-forces the walk, as the published training code does
(NVIDIA-NeMo/Automodel `components/speculative/dflash/dflash2_core.py`, vllm-project/speculators
`models/dflash2/metrics.py`): slot j's predecessor is the true token of slot j - 1 (the anchor
for slot 1), the true tokens being the target's greedy choices, which is where the walk stands
whenever everything before slot j was accepted. Slot j's loss is the cross-entropy over its K
candidates of the edges out of that predecessor, the label the index of slot j's true token
among them. A slot whose true token is not a candidate carries no signal for the selector (no
walk can reach it) and is left out, as Automodel does; how often that happens is the
candidate recall. Slots weigh what they weigh in the token loss (`slot_weights`).

The gradient reaches the codebooks and the hidden projection, and, through the edges' unary
term and the hidden states, the rest of the draft, as in both sources.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.dflash2 import CandidateSelector, DFlash2Draft, top_candidates
from .loops import slot_weights


def teacher_forced_edges(
    selector: CandidateSelector,
    hidden: torch.Tensor,  # [rows, N, hidden] the final hidden states of slots 1..N
    candidates: torch.Tensor,  # [rows, N, K]
    unary: torch.Tensor,  # [rows, N, K] the candidates' draft logits
    predecessors: torch.Tensor,  # [rows, N] the token before each slot (the anchor for slot 1)
) -> torch.Tensor:
    """The edges out of one given predecessor per slot to the slot's candidates, [rows, N, K]:
    the row of `CandidateSelector.edges` that the predecessor's candidate index picks, for any
    predecessor token, candidate or not. Float32 or wider."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    projected = F.linear(hidden, selector.hidden_projection.weight).to(acc)  # [rows, N, rank]
    P = selector.predecessor_codebook[predecessors].to(acc) * projected  # [rows, N, rank]
    S = selector.successor_codebook[candidates].to(acc)  # [rows, N, K, rank]
    return (S * P[:, :, None]).sum(-1) + unary.to(acc)


def selector_loss(
    draft: DFlash2Draft,
    hidden: torch.Tensor,  # [rows, N, hidden] slots 1..N (block_hidden without slot 0)
    logits: torch.Tensor,  # [rows, N, vocab] the draft's logits for those slots
    labels: torch.Tensor,  # [rows, N] the true token of each slot (block_labels)
    anchors: torch.Tensor,  # [rows] each block's anchor token
    lengths: torch.Tensor | None,  # [rows] block lengths, None for full blocks
    position_decay: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selector's teacher-forced cross-entropy, weighted over the slots whose true token
    is among their candidates (0 when there are none), and the candidate recall: the share
    of the slots inside their blocks whose true token is a candidate."""
    rows, slots = labels.shape
    candidates, unary = top_candidates(logits, draft.config.selector_top_k)
    predecessors = torch.cat([anchors[:, None], labels[:, :-1]], dim=1)
    edges = teacher_forced_edges(draft.candidate_selector, hidden, candidates, unary, predecessors)
    found = candidates == labels[..., None]  # [rows, N, K], at most one per slot
    present = found.any(-1)
    losses = F.cross_entropy(edges.flatten(0, 1), found.flatten(0, 1).int().argmax(-1), reduction="none")
    inside = slot_weights(rows, slots, lengths, position_decay, losses.dtype, labels.device)
    weights = inside * present
    loss = (losses.view(rows, slots) * weights).sum() / weights.sum().clamp(min=1e-12)
    counted = inside > 0
    recall = (present & counted).sum() / counted.sum()
    return loss, recall.detach()
