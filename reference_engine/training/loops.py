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

import io
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models.base import CausalLM
from ..models.dflash import DFlashDraft, DraftState
from ..runtime.state import TargetState

OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


@torch.no_grad()
def init_weights(model: torch.nn.Module, num_layers: int, seed: int) -> None:
    """GPT-style init (std 0.02, output projections scaled down by depth), Gated DeltaNet
    decay parameters as Qwen3.5 initialises them (A in [1, 16], dt in [1e-3, 1e-1]). Norm
    weights keep their constructed values. A DFlash2 draft's convolutions start as the
    identity (base tap 0 at 1, the other taps and the dynamic weights at 0), so that it starts
    as a DFlash draft; its selector's codebooks and projection take the std 0.02 rule. Drawn
    on the CPU from `seed`."""
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
        elif name.endswith("base_kernel"):  # [2, taps, hidden]
            value = torch.zeros(p.shape)
            value[:, 0] = 1.0
        elif name.endswith("kernel_projection.weight"):
            value = torch.zeros(p.shape)
        elif name.endswith("conv1d.weight"):
            value = torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
        else:
            std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(OUTPUT_PROJECTIONS) else 0.02
            value = torch.randn(p.shape, generator=gen) * std
        p.copy_(value.to(p.dtype))


def sequence_forward(
    target: CausalLM, ids: torch.Tensor, capture_layers: tuple[int, ...] = (), raw_last_layer: bool = False
):
    """Whole rows from position 0 with fresh state, chunked. ids: [batch, T]."""
    batch, T = ids.shape
    param = target.model.embed_tokens.weight
    state = TargetState(target.config, batch, T, param.dtype, param.device)
    positions = torch.arange(T, device=ids.device).expand(batch, T)
    slots = torch.arange(batch, device=ids.device)
    return target(ids, positions, slots, state, T, capture_layers, raw_last_layer, chunked=True)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Interrupted(Exception):
    """Training stopped at its time budget after writing a checkpoint; the same command
    resumes it."""


class Checkpoint:
    """A training loop's state (model, optimizer, step, losses, best weights, the batch
    generator) in `folder/name.ckpt.<i>` parts of at most `part_bytes` each, the index
    `name.ckpt.json` written last, so a half-written checkpoint is never read."""

    def __init__(self, folder: Path, name: str, part_bytes: int = 15 << 20) -> None:
        self.folder, self.name, self.part_bytes = Path(folder), name, part_bytes
        self.index = self.folder / f"{name}.ckpt.json"

    def save(self, state: dict) -> None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.index.unlink(missing_ok=True)
        parts = max(1, -(-len(data) // self.part_bytes))
        for i in range(parts):
            (self.folder / f"{self.name}.ckpt.{i}").write_bytes(
                data[i * self.part_bytes : (i + 1) * self.part_bytes]
            )
        self.index.write_text(json.dumps({"parts": parts, "bytes": len(data), "step": state["step"]}) + "\n")

    def load(self) -> dict | None:
        if not self.index.exists():
            return None
        parts = json.loads(self.index.read_text())["parts"]
        data = b"".join((self.folder / f"{self.name}.ckpt.{i}").read_bytes() for i in range(parts))
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)

    def remove(self) -> None:
        self.index.unlink(missing_ok=True)
        for part in self.folder.glob(f"{self.name}.ckpt.*"):
            part.unlink()


def optimise(
    model: torch.nn.Module,
    steps: int,
    lr: float,
    loss_at: Callable[[int], torch.Tensor | dict[str, torch.Tensor]],
    log: Callable[[str], None],
    what: str,
    log_every: int = 50,
    validate: Callable[[], float] | None = None,
    validate_every: int = 100,
    checkpoint: Checkpoint | None = None,
    checkpoint_every: int = 500,
    generator: torch.Generator | None = None,
    deadline: float | None = None,
) -> dict:
    """AdamW with warm-up and cosine decay, gradient clipping at 1. `loss_at(step)` builds
    the batch and returns its loss, or a dict of the loss ("loss") and other terms to record
    per step (each in `terms`, a list per name, the way `losses` records the loss). With
    `validate` (lower is better), the weights at the best validation point are kept. With
    `checkpoint`, the loop resumes from it when one is there, saves one every
    `checkpoint_every` steps and, past `deadline` (time.perf_counter()), saves one and raises
    `Interrupted`; `generator` (the batch sampler's) is saved and restored with it, so a
    resumed run draws the same batches.
    Returns {"losses", "terms", "best_step", "best_score"}."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        fused=params[0].is_cuda,
    )
    losses: list[float] = []
    terms: dict[str, list[float]] = {}
    best = {"best_step": steps, "best_score": None}
    best_state = None
    first = 0
    saved = checkpoint.load() if checkpoint is not None else None
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        first, losses, best, best_state = (saved["step"], saved["losses"], saved["best"], saved["best_state"])
        terms = saved.get("terms", {})
        if generator is not None:
            generator.set_state(saved["generator"])
        log(f"{what}: resumed at step {first}/{steps}")

    def save(step: int) -> None:
        checkpoint.save(
            {
                "step": step,
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "losses": losses,
                "terms": terms,
                "best": best,
                "best_state": best_state,
                "generator": generator.get_state() if generator is not None else None,
            }
        )

    start = time.perf_counter()
    warmup = max(1, min(100, steps // 10))
    for step in range(first, steps):
        if (
            checkpoint is not None
            and step > first
            and (step % checkpoint_every == 0 or (deadline is not None and time.perf_counter() > deadline))
        ):
            save(step)
            if deadline is not None and time.perf_counter() > deadline:
                raise Interrupted(
                    f"{what}: stopped at step {step}/{steps} at the time budget; "
                    f"checkpoint in {checkpoint.folder}"
                )
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        loss = loss_at(step)
        if isinstance(loss, dict):
            for name, value in loss.items():
                if name != "loss":
                    terms.setdefault(name, []).append(value.item())
            loss = loss["loss"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        note = ""
        if validate is not None and ((step + 1) % validate_every == 0 or step + 1 == steps):
            with torch.no_grad():
                score = validate()
            note = f"  validation {score:.3f}"
            if best["best_score"] is None or score < best["best_score"]:
                best = {"best_step": step + 1, "best_score": score}
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if (step + 1) % log_every == 0 or step + 1 == steps or note:
            recent = losses[-log_every:]
            log(
                f"{what} step {step + 1}/{steps}  loss {sum(recent) / len(recent):.3f}{note}  "
                f"{time.perf_counter() - start:.0f} s"
            )
    if best_state is not None:
        model.load_state_dict(best_state)
        log(f"{what}: kept the weights of step {best['best_step']} (validation {best['best_score']:.3f})")
    return {"losses": losses, "terms": terms, **best}


def loss_curve(losses: list[float], points: int = 10) -> list[tuple[int, float]]:
    """(step, mean loss of the steps since the previous point) at `points` even steps."""
    if not losses:
        return []
    ends = sorted({max(1, round(len(losses) * (i + 1) / points)) for i in range(points)})
    curve, begin = [], 0
    for end in ends:
        window = losses[begin:end]
        curve.append((end, sum(window) / len(window)))
        begin = end
    return curve


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


@torch.no_grad()
def target_views(
    target: CausalLM,
    seqs: torch.Tensor,
    layers: tuple[int, ...],
    raw_last_layer: bool = False,
    batch: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the draft learns from, for every row of `seqs` [n, T]: the target's features at
    `layers` [n, T, len(layers) * hidden] (the last layer's after the final norm unless
    `raw_last_layer`) and its greedy choice after each position [n, T]."""
    features, greedy = [], []
    for begin in range(0, len(seqs), batch):
        out = sequence_forward(target, seqs[begin : begin + batch], layers, raw_last_layer)
        features.append(out.features)
        greedy.append(out.logits.argmax(-1))
    return torch.cat(features), torch.cat(greedy)


def block_hidden(
    draft: DFlashDraft,
    target: CausalLM,
    seqs: torch.Tensor,
    features: torch.Tensor,
    anchors: torch.Tensor,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """The draft's final hidden states for blocks at `anchors` of `seqs`, as the engine
    drafts them.

    seqs: [n, T] token rows; features: their `target_views` features [n, T, F]; anchors:
    [n, K] anchor positions (positions anchor..anchor+B-1 inside T); lengths: [n*K] block
    lengths <= B (shorter blocks see only themselves, as the engine's final blocks and
    smaller block sizes do), None for all B. Returns [n*K, B, hidden]: slot 0 holds the
    anchor, slot j proposes the token at anchor + j. The context is every position before
    the anchor."""
    n, T = seqs.shape
    K = anchors.shape[1]
    cfg = draft.config
    B = cfg.block_size
    rows = n * K
    device = seqs.device
    state = DraftState(cfg, rows, T, features.dtype, device)
    slots = torch.arange(rows, device=device)
    # every position's context rows; a block overwrites its own and sees none past itself
    draft.append_context(
        features.repeat_interleave(K, 0), torch.arange(T, device=device).expand(rows, T), slots, state
    )
    positions = anchors.flatten()[:, None] + torch.arange(B, device=device)  # [n*K, B]
    block = torch.full((rows, B), cfg.mask_token_id, device=device)
    block[:, 0] = anchor_tokens(seqs, anchors)
    embedded = target.embed(block) * cfg.input_embedding_scale
    return draft(embedded, positions, slots, state, T, valid_len=lengths)


def block_logits(
    draft: DFlashDraft,
    target: CausalLM,
    seqs: torch.Tensor,
    features: torch.Tensor,
    anchors: torch.Tensor,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draft logits for blocks at `anchors` of `seqs` (arguments as `block_hidden`):
    [n*K, B-1, vocab], slot j proposing the token at anchor + j."""
    hidden = block_hidden(draft, target, seqs, features, anchors, lengths)
    return draft.logits(hidden[:, 1:], target.lm_head_weight)


def anchor_tokens(seqs: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """The token at each anchor, the block's slot 0: seqs [n, T], anchors [n, K] -> [n*K]."""
    return seqs.gather(1, anchors).flatten()


def block_labels(greedy: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """The target's greedy token for each block slot: slot j of the block at anchor p is
    the target's choice after position p + j - 1. greedy: [n, T]; returns [n*K, B-1]."""
    K = anchors.shape[1]
    positions = anchors.flatten()[:, None] + torch.arange(block_size - 1, device=anchors.device)
    return greedy.repeat_interleave(K, 0).gather(1, positions)


def block_loss(
    logits: torch.Tensor, labels: torch.Tensor, lengths: torch.Tensor | None, position_decay: float
) -> torch.Tensor:
    """Cross-entropy per block slot, weighted by `slot_weights`."""
    rows, slots = labels.shape
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    weights = slot_weights(rows, slots, lengths, position_decay, losses.dtype, labels.device)
    return (losses.view(rows, slots) * weights).sum() / weights.sum()


def slot_weights(
    rows: int,
    slots: int,
    lengths: torch.Tensor | None,
    position_decay: float,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The loss weight of each block slot [rows, slots]: slot j weighs exp(-(j-1)/decay)
    (early slots matter most: a rejection ends the accepted run); slots past a block's
    length weigh 0."""
    index = torch.arange(slots, device=device, dtype=dtype)
    weights = torch.exp(-index / position_decay).expand(rows, slots)
    if lengths is not None:
        weights = weights * (index < (lengths - 1)[:, None])
    return weights
