"""Training loops for the demo pair, on this package's model code.

The target trains as a causal LM over whole windows: one forward per batch with fresh
per-row state and the Gated DeltaNet layers run a chunk at a time (`chunked=True`; the
same rule as the engine's token-by-token recurrence, differentiable and fast).

The draft trains against the frozen target the way the engine uses it: the context is the
target's captured layers at positions before the anchor, the block is the anchor token
followed by mask tokens, and block slot j is trained to predict the target's greedy
choice for position anchor + j. Sequences are prompts from the corpus continued by the
target's own greedy decoding, which is what a draft sees when it serves.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..models.base import CausalLM
from ..models.dflash import DFlashDraft, DraftState
from ..state import TargetState

OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


@torch.no_grad()
def init_weights(model: torch.nn.Module, num_layers: int, seed: int) -> None:
    """GPT-style init (std 0.02, output projections scaled down by depth), Gated DeltaNet
    decay parameters as Qwen3.5 initialises them (A in [1, 16], dt in [1e-3, 1e-1]). Norm
    weights keep their constructed values. Drawn on the CPU from `seed`."""
    gen = torch.Generator().manual_seed(seed)

    def uniform(shape, low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=gen) * (high - low) + low

    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            value = uniform(p.shape, 1.0, 16.0).log()
        elif name.endswith("dt_bias"):
            dt = uniform(p.shape, math.log(1e-3), math.log(1e-1)).exp()
            value = dt + torch.log(-torch.expm1(-dt))  # softplus(value) == dt
        elif p.ndim == 1:
            continue
        elif name.endswith("conv1d.weight"):
            value = torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
        else:
            std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(OUTPUT_PROJECTIONS) else 0.02
            value = torch.randn(p.shape, generator=gen) * std
        p.copy_(value.to(p.dtype))


def sequence_forward(target: CausalLM, ids: torch.Tensor, capture_layers: tuple[int, ...] = ()):
    """Whole rows from position 0 with fresh state, chunked. ids: [batch, T]."""
    batch, T = ids.shape
    param = target.model.embed_tokens.weight
    state = TargetState(target.config, batch, T, param.dtype, param.device)
    positions = torch.arange(T, device=ids.device).expand(batch, T)
    slots = torch.arange(batch, device=ids.device)
    return target(ids, positions, slots, state, T, capture_layers, chunked=True)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def optimise(model: torch.nn.Module, steps: int, lr: float, loss_at: Callable[[int], torch.Tensor],
             log: Callable[[str], None], what: str, log_every: int = 50) -> list[float]:
    """AdamW with warm-up and cosine decay, gradient clipping at 1; returns the loss of every
    step. `loss_at(step)` builds the batch and returns its loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95),
                            fused=params[0].is_cuda)
    losses: list[float] = []
    start = time.perf_counter()
    warmup = max(1, min(100, steps // 10))
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        loss = loss_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            recent = losses[-log_every:]
            log(f"{what} step {step + 1}/{steps}  loss {sum(recent) / len(recent):.3f}  "
                f"{time.perf_counter() - start:.0f} s")
    return losses


def lm_loss(target: CausalLM, window: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over a batch of windows [batch, T + 1]."""
    logits = sequence_forward(target, window[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())


@torch.no_grad()
def greedy_continue(target: CausalLM, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Prompts [batch, P] continued by `new_tokens` greedy tokens, token by token as the
    engine decodes (lowest id on a tie). Returns [batch, P + new_tokens]."""
    batch, P = prompts.shape
    param = target.model.embed_tokens.weight
    total = P + new_tokens
    state = TargetState(target.config, batch, total, param.dtype, param.device)
    slots = torch.arange(batch, device=prompts.device)
    positions = torch.arange(P, device=prompts.device).expand(batch, P)
    out = target(prompts, positions, slots, state, P, last_only=True)
    tokens = [prompts]
    for pos in range(P, total):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # [batch, 1]
        tokens.append(nxt)
        if pos + 1 < total:
            position = torch.full((batch, 1), pos, device=prompts.device)
            out = target(nxt, position, slots, state, pos + 1)
    return torch.cat(tokens, 1)


def block_logits(draft: DFlashDraft, target: CausalLM, seqs: torch.Tensor,
                 anchors: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits and labels for blocks at `anchors` of `seqs`, as the engine drafts them.

    seqs: [n, T] token rows; anchors: [n, K] anchor positions (block positions
    anchor..anchor+B-1 must lie inside T). Returns logits [n*K, B-1, vocab] and labels
    [n*K, B-1]: block slot j's label is the target's greedy choice after position
    anchor+j-1, given the row's tokens up to there."""
    n, T = seqs.shape
    K = anchors.shape[1]
    cfg = draft.config
    with torch.no_grad():
        out = sequence_forward(target, seqs, cfg.target_layer_ids)
        greedy = out.logits.argmax(-1)  # [n, T]: the target's choice for position t + 1
        features = out.features.repeat_interleave(K, 0)  # [n*K, T, features]
    rows = n * K
    device = seqs.device
    state = DraftState(cfg, rows, T, features.dtype, device)
    slots = torch.arange(rows, device=device)
    # every position's context rows; a block overwrites its own and sees none past itself
    draft.append_context(features, torch.arange(T, device=device).expand(rows, T), slots, state)
    starts = anchors.flatten()  # [n*K]
    positions = starts[:, None] + torch.arange(block_size, device=device)  # [n*K, B]
    seq_rows = torch.arange(n, device=device).repeat_interleave(K)
    block = torch.full((rows, block_size), cfg.mask_token_id, device=device)
    block[:, 0] = seqs[seq_rows, starts]
    hidden = draft(target.embed(block) * cfg.input_embedding_scale, positions, slots, state, T)
    logits = draft.logits(hidden[:, 1:], target.lm_head_weight)
    labels = greedy[seq_rows[:, None], positions[:, :-1]]
    return logits, labels


def block_loss(draft: DFlashDraft, target: CausalLM, seqs: torch.Tensor, anchors: torch.Tensor,
               block_size: int, position_decay: float) -> torch.Tensor:
    """Cross-entropy of `block_logits`, block slot j weighted by exp(-(j-1)/decay): early
    slots matter most, since a rejection ends the accepted run."""
    logits, labels = block_logits(draft, target, seqs, anchors, block_size)
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    weights = torch.exp(-torch.arange(block_size - 1, device=seqs.device) / position_decay)
    return (losses.view(len(labels), -1) * weights).sum() / (weights.sum() * len(labels))
