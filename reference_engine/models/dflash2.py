"""The DFlash2 block-diffusion draft (`DFlash2DraftModel`, docs/dflash2.md).

DFlash's draft (dflash.py: the context, the block, the KV rows) with two additions:

- A grouped dynamic depthwise convolution inside the block around each attention and MLP
  sublayer. From the sublayer's normed input x one projection makes per-token, per-group tap
  weights for both sides; the input is convolved before the sublayer and its output after:
  `out[i, c] = sum_t (base[t, c] + delta[i, t, g(c)]) * x[i - t, c]`, g(c) = c // group size,
  taps reaching before the block's first token read zero. A block slot thereby sees the slots
  before it without another pass.
- The candidate selector, in place of each slot's own argmax: the K best tokens of the
  target head per slot (the unary scores), transitions scored by a low-rank bigram between
  adjacent slots' candidates, `edge(p -> c) = <P[p] * project(h), S[c]> + unary[c]` with
  h the hidden state of the successor's slot and P, S the predecessor and successor
  codebooks, and the path walked greedily from the verified anchor: slot 1's predecessor is
  the anchor, slot j's the candidate slot j - 1 chose.

Tie rules (docs/dflash2.md, "Ties"): the candidate set keeps the lowest ids among logits
tied at the K-th value; candidates sit in ascending id order, so the walk's lowest-index
rule for tied edges picks the lowest token id, as greedy does everywhere in the engine.

The arithmetic is batch-invariant, so a row's proposals do not depend on the other rows: the
projections run through the kernels table, the convolution is elementwise, and the rank sum
of the edges is a fixed pairwise tree of elementwise adds in float32 (or wider) rather than
a batched matmul whose reduction order a library may choose by shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import SLIDING_ATTENTION, DraftConfig
from ..kernels import TORCH, Kernels
from .dflash import DFlashDraft
from .layers import MLP, ForwardContext, Phase, RMSNorm, SelfAttention, untimed


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half precision accumulates in float32; float32 and float64 stay as they are."""
    return torch.promote_types(dtype, torch.float32)


def grouped_conv(
    x: torch.Tensor,  # [batch, B, hidden] one block per row
    base: torch.Tensor,  # [taps, hidden] static tap weights
    delta: torch.Tensor,  # [batch, B, taps, groups] dynamic tap weights of each output token
) -> torch.Tensor:
    """The grouped dynamic depthwise convolution over each row's block, [batch, B, hidden]:
    tap t of token i reads token i - t (zero before the block's first token) with weight
    base[t, c] + delta[i, t, c // group size]. Summed over taps in order, in float32 for
    half-precision inputs, rounded once."""
    batch, length, hidden = x.shape
    taps, groups = delta.shape[-2:]
    acc = _accumulation_dtype(x.dtype)
    blocks = x.to(acc).unflatten(-1, (groups, hidden // groups))  # [batch, B, groups, group size]
    weight = base.to(acc).view(taps, groups, -1) + delta.to(acc)[..., None]  # [batch, B, taps, g, gs]
    out = weight[:, :, 0] * blocks
    for t in range(1, min(taps, length)):
        shifted = F.pad(blocks[:, :-t], (0, 0, 0, 0, t, 0))  # token i - t, zeros before the block
        out = out + weight[:, :, t] * shifted
    return out.flatten(-2).to(x.dtype)


class GroupedDynamicConv(nn.Module):
    """The convolution pair around one sublayer: `base_kernel` [2, taps, hidden] (side 0
    before the sublayer, side 1 after) and `kernel_projection`, which makes both sides'
    dynamic weights from the sublayer's input."""

    def __init__(self, hidden_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        self.taps, self.groups = taps, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def kernels(self, x: torch.Tensor, ops: Kernels = TORCH) -> torch.Tensor:
        """Both sides' dynamic weights from the sublayer input x [batch, B, hidden]:
        [batch, B, 2, taps, groups]."""
        delta = ops.linear(x, self.kernel_projection.weight)
        return delta.unflatten(-1, (2, self.taps, self.groups))

    def forward(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        return grouped_conv(x, self.base_kernel[side], delta[:, :, side])


class DFlash2DecoderLayer(nn.Module):
    """A Qwen3 layer of the draft with each sublayer wrapped in its convolution pair. Whether
    the block attends causally is the checkpoint's (`is_causal`; DraftConfig.layer_causal)."""

    def __init__(self, config: DraftConfig, layer: int) -> None:
        super().__init__()
        sliding = config.layer_types[layer] == SLIDING_ATTENTION
        self.self_attn = SelfAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.rms_norm_eps,
            norm_offset=False,
            gated=False,
            bias=config.attention_bias,
            sliding_window=config.sliding_window if sliding else None,
            causal=config.layer_causal(layer),
        )
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention_conv = GroupedDynamicConv(
            config.hidden_size, config.conv_kernel_size, config.conv_group_size
        )
        self.mlp_conv = GroupedDynamicConv(
            config.hidden_size, config.conv_kernel_size, config.conv_group_size
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        """Each convolution (its dynamic weights included) is a part of the `conv` phase, so
        that a timed forward reports what the convolution adds to a DFlash layer."""
        ops, phase = ctx.ops, ctx.phase
        normed = self.input_layernorm(x, ops)
        with phase("conv"):
            delta = self.attention_conv.kernels(normed, ops)
            convolved = self.attention_conv(normed, delta, 0)
        attended = self.self_attn(convolved, ctx, layer)
        with phase("conv"):
            attended = self.attention_conv(attended, delta, 1)
        normed, x = self.post_attention_layernorm.add(x, attended, ops)  # residual add + norm
        with phase("conv"):
            delta = self.mlp_conv.kernels(normed, ops)
            convolved = self.mlp_conv(normed, delta, 0)
        out = self.mlp(convolved, ops)
        with phase("conv"):
            out = self.mlp_conv(out, delta, 1)
        return x + out


# ----------------------------------------------------------------------------- selector
def top_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best tokens of each row of logits [..., vocab], lowest ids first among those
    tied at the k-th value: (ids [..., k] in ascending id order, their logits [..., k]).
    No host synchronisation, and the set does not depend on how topk orders ties."""
    kth = logits.topk(k, dim=-1).values[..., -1:]
    above = logits > kth
    tied = logits == kth
    room = k - above.sum(-1, keepdim=True)  # tied tokens still to take, lowest ids first
    chosen = above | (tied & (tied.cumsum(-1, dtype=torch.int32) <= room))  # exactly k per row
    ids = chosen.to(torch.int8).topk(k, dim=-1).indices.sort(dim=-1).values
    return ids, logits.gather(-1, ids)


def rank_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension by a fixed pairwise tree (zero-padded to a power of two),
    so that every element's sum has one order whatever the shape around it."""
    width = x.shape[-1]
    padded = 1 << (width - 1).bit_length()
    if padded != width:
        x = F.pad(x, (0, padded - width))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def lowest_best(scores: torch.Tensor) -> torch.Tensor:
    """Index of the largest entry of each row [..., K], the lowest index among exact ties
    (a row with no finite maximum gives K - 1, a valid index)."""
    K = scores.shape[-1]
    best = scores.max(dim=-1, keepdim=True).values
    index = torch.arange(K, device=scores.device).expand_as(scores)
    return torch.where(scores == best, index, K).min(dim=-1).values.clamp(max=K - 1)


def walk_greedy(
    edges: torch.Tensor,  # [batch, N, K, K] edge(p -> c) per slot
    candidates: torch.Tensor,  # [batch, N, K]
) -> torch.Tensor:
    """The greedy path from the anchor, [batch, N]: at slot j the best successor of the
    candidate slot j - 1 chose (slot 1's predecessors are all the anchor, so its row 0 stands
    for every row)."""
    batch, N, K, _ = edges.shape
    previous = torch.zeros(batch, dtype=torch.int64, device=edges.device)
    tokens = []
    for j in range(N):
        row = edges[:, j].gather(1, previous[:, None, None].expand(batch, 1, K))[:, 0]  # [batch, K]
        previous = lowest_best(row)
        tokens.append(candidates[:, j].gather(1, previous[:, None])[:, 0])
    return torch.stack(tokens, dim=1)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def edges(
        self,
        hidden: torch.Tensor,  # [batch, N, hidden] the draft slots' final hidden states
        candidates: torch.Tensor,  # [batch, N, K]
        unary: torch.Tensor,  # [batch, N, K] the candidates' draft logits
        anchors: torch.Tensor,  # [batch] each row's anchor token
        ops: Kernels = TORCH,
    ) -> torch.Tensor:
        """Transition scores edge(p -> c) = <P[p] * project(h_j), S[c]> + unary[c] between the
        predecessors of slot j (the anchor for slot 1, else slot j - 1's candidates) and slot
        j's candidates: [batch, N, K, K], float32 or wider."""
        K = candidates.shape[-1]
        acc = _accumulation_dtype(hidden.dtype)
        projected = ops.linear(hidden, self.hidden_projection.weight).to(acc)  # [batch, N, rank]
        predecessors = torch.cat([anchors[:, None, None].expand(-1, 1, K), candidates[:, :-1]], dim=1)
        P = self.predecessor_codebook[predecessors].to(acc) * projected[:, :, None]  # [batch, N, K, rank]
        S = self.successor_codebook[candidates].to(acc)  # [batch, N, K, rank]
        return rank_sum(P[:, :, :, None] * S[:, :, None]) + unary.to(acc)[:, :, None]


class DFlash2Draft(DFlashDraft):
    """DFlash's draft with DFlash2DecoderLayer layers and the candidate selector."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__(config)
        self.candidate_selector = CandidateSelector(
            config.hidden_size, config.vocab_size, config.selector_rank, config.selector_top_k
        )

    def build_layer(self, config: DraftConfig, layer: int) -> nn.Module:
        return DFlash2DecoderLayer(config, layer)

    def proposals(
        self,
        hidden: torch.Tensor,
        lm_head_weight: torch.Tensor,
        ops: Kernels = TORCH,
        anchors: torch.Tensor | None = None,
        phase: Phase = untimed,
        width: int | None = None,
        hold: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """DFlash's per-slot logits [batch, W, vocab] (the selector's unary scores), the
        selector's greedy path [batch, W], and what a sampled walk needs: the candidates
        [batch, W, K] and the edges [batch, W, K, K] (runtime/walk.py), for the draft slots
        1..W (`width`, every slot when None; `hold` as DFlash's). The walk goes from the
        anchor one slot at a time, each slot's edges reading its own hidden state and the
        slot before it, so the first W slots' path does not depend on the slots after them.
        The `selector` phase is what the selector adds to DFlash's logits: the top-K, the
        edges, the greedy walk."""
        if anchors is None:
            raise ValueError(
                "a DFlash2 draft's proposals need the block's anchors (the selector starts from them)"
            )
        logits = self.slot_logits(hidden, lm_head_weight, ops, width, hold)[:, 1:]
        with phase("selector"):
            candidates, unary = top_candidates(logits, self.config.selector_top_k)
            slots = hidden[:, 1 : logits.shape[1] + 1]
            edges = self.candidate_selector.edges(slots, candidates, unary, anchors, ops)
            tokens = walk_greedy(edges, candidates)
        return logits, tokens, candidates, edges
