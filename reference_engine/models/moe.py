"""The mixture-of-experts MLP block of Qwen3-MoE and Qwen3.5-MoE.

A router scores every expert for each token; the token goes through its k best experts
(SwiGLU MLPs) and their outputs are summed, each times its routing weight. Qwen3.5-MoE adds
a shared expert that every token goes through, scaled by sigmoid(shared_expert_gate(x)).

Routing follows transformers bit for bit: the softmax over the router logits, the top-k and
the renormalisation run in float32 whatever the model dtype, and the weights are then cast
to the model dtype. A near-tie between two experts is decided on float32 probabilities, as
the published models were trained and as other engines route.

The sum over a token's k experts runs in one fixed order, ascending expert id, one expert at
a time: the order transformers' eager loop adds them in, and one that does not depend on
which other tokens share the batch. Each expert's matmuls run through the kernels table
(`ops.linear`), so with batch-invariant kernels a token's output is the same bits alone or
in any batch.

Weights keep the layout transformers 5 holds in memory (checkpoint/__init__.py also reads
the per-expert layout into it): `experts.gate_up_proj` [E, 2I, H], gate rows first, and
`experts.down_proj` [E, H, I], both (out, in) like nn.Linear.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import TORCH, Kernels
from .layers import MLP


def route(
    logits: torch.Tensor,  # [tokens, experts] router logits in the model dtype
    top_k: int,
    renormalise: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k experts and their weights: softmax in float32, top-k, optional
    renormalisation to sum 1 (still float32), cast back to the logits' dtype. Returns
    (weights [tokens, k] in the logits' dtype, expert ids [tokens, k]), each token's experts in
    ascending id order (the order their outputs are summed in)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(logits.dtype)
    experts, order = experts.sort(dim=-1)
    return weights.gather(-1, order), experts


class TopKRouter(nn.Module):
    """The router (`mlp.gate.weight` [E, H]): logits, then `route`."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalise: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.top_k = top_k
        self.renormalise = renormalise

    def forward(self, x: torch.Tensor, ops: Kernels = TORCH) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [tokens, hidden] -> (weights [tokens, k], expert ids [tokens, k])
        return route(ops.linear(x, self.weight), self.top_k, self.renormalise)


class Experts(nn.Module):
    """E SwiGLU experts stacked: down[e] @ (silu(gate[e] @ x) * up[e] @ x)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def expert(self, e: int, x: torch.Tensor, ops: Kernels) -> torch.Tensor:
        # x: [n, hidden] -> [n, hidden]
        gate, up = ops.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return ops.linear(ops.silu_mul(gate, up), self.down_proj[e])

    def forward(
        self,
        x: torch.Tensor,  # [tokens, hidden]
        weights: torch.Tensor,  # [tokens, k]
        experts: torch.Tensor,  # [tokens, k] ascending ids per token
        ops: Kernels = TORCH,
    ) -> torch.Tensor:
        """sum over j of weights[t, j] * expert_{experts[t, j]}(x[t]), j = 0, 1, ... in turn.
        Returns [tokens, hidden]."""
        tokens, k = experts.shape
        # every (token, slot) output first, then the sum slot by slot: each token's experts
        # are added in its own ascending-id order, whatever the other tokens route to
        weighted = x.new_empty(tokens, k, x.shape[-1])
        for e in experts.unique().tolist():  # host sync: which experts have tokens
            token, slot = (experts == e).nonzero(as_tuple=True)
            weighted[token, slot] = self.expert(e, x[token], ops) * weights[token, slot, None]
        out = weighted[:, 0]
        for j in range(1, k):
            out = out + weighted[:, j]
        return out


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
        self.shared_expert: MLP | None = None
        if shared_intermediate_size:
            self.shared_expert = MLP(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, ops: Kernels = TORCH) -> torch.Tensor:
        # x: [batch, T, hidden] -> [batch, T, hidden]
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.gate(flat, ops)
        out = self.experts(flat, weights, experts, ops)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat, ops)
            out = out + torch.sigmoid(ops.linear(flat, self.shared_expert_gate.weight)) * shared
        return out.view_as(x)
