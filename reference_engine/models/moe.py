"""The mixture-of-experts MLP block of Qwen3-MoE and Qwen3.5-MoE.

A router scores every expert for each token; the token goes through its k best experts
(SwiGLU MLPs) and their outputs are summed, each times its routing weight. Qwen3.5-MoE adds
a shared expert that every token goes through, scaled by sigmoid(shared_expert_gate(x)).

The routing and the experts run through the kernels table (`ops.route_experts`,
`ops.experts`; their contracts are in kernels/reference.py). The references route as
transformers does, bit for bit: the softmax over the router logits, the top-k and the
renormalisation in float32 whatever the model dtype, the weights then cast to the model
dtype, so a near-tie between two experts is decided on float32 probabilities, as the
published models were trained and as other engines route. A token's k expert outputs are
added in one fixed order, ascending expert id, one at a time: the order transformers' eager
loop adds them in, and one that does not depend on which other tokens share the step. On
CUDA the Triton kernels (kernels/moe.py) keep that order and never ask the host which experts
have tokens, so a step can be captured in a CUDA graph and a token's output is the same bits
alone or in any batch.

Weights keep the layout transformers 5 holds in memory (checkpoint/__init__.py also reads
the per-expert layout into it): `experts.gate_up_proj` [E, 2I, H], gate rows first, and
`experts.down_proj` [E, H, I], both (out, in) like nn.Linear.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import TORCH, Kernels
from .layers import MLP


class TopKRouter(nn.Module):
    """The router (`mlp.gate.weight` [E, H]): logits through the kernels' linear, then their
    `route_experts` (float32 softmax, top k, optional renormalisation)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalise: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.top_k = top_k
        self.renormalise = renormalise

    def forward(self, x: torch.Tensor, ops: Kernels = TORCH) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [tokens, hidden] -> (weights [tokens, k], expert ids [tokens, k])
        return ops.route_experts(ops.linear(x, self.weight), self.top_k, self.renormalise)


class Experts(nn.Module):
    """E SwiGLU experts stacked: down[e] @ (silu(gate[e] @ x) * up[e] @ x), run by the kernels'
    `experts` (the per-expert loop of the references, or the grouped products of
    kernels/moe.py)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(
        self,
        x: torch.Tensor,  # [tokens, hidden]
        weights: torch.Tensor,  # [tokens, k]
        experts: torch.Tensor,  # [tokens, k] ascending ids per token
        ops: Kernels = TORCH,
        census: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """sum over j of weights[t, j] * expert_{experts[t, j]}(x[t]), j = 0, 1, ... in turn,
        plus `residual` [tokens, hidden] when given (one more rounded add). Returns [tokens,
        hidden]."""
        return ops.experts(x, weights, experts, self.gate_up_proj, self.down_proj, census, residual)


class ExpertCensus:
    """How many distinct experts the MoE layers' steps route to, per step width (tokens a row:
    1 for a decode step, B for a verify, a prefill bucket's tokens for prefill), summed over
    layers and calls on the device, so that counting neither synchronises with the host nor
    breaks a CUDA graph. Each width's counter is a row of one buffer allocated up front: a
    graph captured with the census holds its row and adds to it at every replay."""

    def __init__(self, device: torch.device | str, widths: int = 64) -> None:
        self.counts = torch.zeros(widths, 2, dtype=torch.int64, device=device)
        self.rows: dict[int, int] = {}

    def counter(self, width: int) -> torch.Tensor | None:
        """The [distinct experts, calls] counter of a width (None past the buffer's rows)."""
        row = self.rows.setdefault(width, len(self.rows))
        return self.counts[row] if row < len(self.counts) else None

    def reset(self) -> None:
        self.counts.zero_()

    def mean_distinct(self, *widths: int) -> float | None:
        """Distinct experts per layer per call over the calls at any of `widths` (a speculative
        run's verifies come at several widths), None when no call ran at any of them."""
        distinct = calls = 0
        for width in widths:
            row = self.rows.get(width)
            if row is not None and row < len(self.counts):
                d, c = self.counts[row].tolist()
                distinct, calls = distinct + d, calls + c
        return distinct / calls if calls else None


def census_of(model: nn.Module) -> ExpertCensus | None:
    """The census `model`'s MoE blocks add to (None: a dense model, or no census set)."""
    return next((m.census for m in model.modules() if isinstance(m, SparseMoeBlock)), None)


def count_experts(model: nn.Module, census: ExpertCensus | None) -> None:
    """Every MoE block of `model` adds to `census` from its next forward on (None: stops).
    Set it before CUDA graphs are captured: a graph keeps what it was captured with."""
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.census = census


class SparseMoeBlock(nn.Module):
    """Router plus routed experts; with `shared_intermediate_size`, Qwen3.5-MoE's shared
    expert behind a sigmoid gate. Parameter names are the checkpoint's (`mlp.gate`,
    `mlp.experts`, `mlp.shared_expert`, `mlp.shared_expert_gate`)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalise: bool,
        shared_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, renormalise)
        self.experts = Experts(hidden_size, intermediate_size, num_experts)
        self.census: ExpertCensus | None = None
        self.shared_expert: MLP | None = None
        if shared_intermediate_size:
            self.shared_expert = MLP(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(
        self, x: torch.Tensor, ops: Kernels = TORCH, *, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: [batch, T, hidden] -> [batch, T, hidden]; `residual` (x's shape) + that when
        given: the layer's residual connection, added by the experts' slot sum where no shared
        expert comes between (one launch less a layer), after the shared expert's term else."""
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.gate(flat, ops)
        counter = self.census.counter(x.shape[1]) if self.census is not None else None
        if self.shared_expert is None:
            fused = None if residual is None else residual.reshape(flat.shape)
            return self.experts(flat, weights, experts, ops, counter, fused).view_as(x)
        out = self.experts(flat, weights, experts, ops, counter)
        shared = self.shared_expert(flat, ops)
        out = (out + torch.sigmoid(ops.linear(flat, self.shared_expert_gate.weight)) * shared).view_as(x)
        return out if residual is None else residual + out
