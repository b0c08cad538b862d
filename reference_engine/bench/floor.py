"""The weight-streaming floor of a decode step: the time to read every weight matrix of the
target once, measured on the device in the same process as the step it is compared with.

A decode step at small batch must stream all of the target's weights from memory at least
once, so no engine's step is faster than this. The floor is measured, not computed from a
datasheet: one matrix-vector product per weight matrix (the LM head included; an embedding
read only through its lookup is not; a stack of fused projections is one matrix), each into a
buffer of its own and nothing else, chained in one CUDA graph so that launch gaps do not
count, timed by CUDA events over replays. On the CPU the same chain is timed by the host
clock (the figure is then a CPU streaming time, rarely a useful floor).

A mixture-of-experts step reads only the experts its rows route to: the floor reads, besides
the attention, router and shared-expert matrices, `experts_per_layer` experts of every MoE
layer (gate-and-up and down each), the mean number of distinct experts the step's layers
chose, counted by the engine benchmark's census (models/moe.ExpertCensus) in the same run.
They are read as two matrices a layer, the first n experts of each stack (one contiguous
block): the bytes of any n experts, without the launch gap of a product per expert matrix,
which on a small expert costs more than its bytes (a floor must not be slower than a step).
It grows with the rows of a step: a decode step of one token reads k experts a layer, a
verify of B tokens up to B x k of them. Without a count the floor reads k a layer, the least
any step reads.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..models import CausalLM
from ..models.moe import SparseMoeBlock


@dataclass(frozen=True)
class Floor:
    ms_median: float
    ms_min: float
    ms_max: float
    bytes: int  # weight bytes read per step
    repeats: int
    experts_per_layer: float | None = None  # experts read per MoE layer (None: a dense model)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.ms_median / 1e6


def streamed_weights(model: CausalLM, experts_per_layer: float | None = None) -> list[torch.Tensor]:
    """Every weight matrix a decode step reads whole, as the engine stores them: a stack of
    fused projections (models/layers.FusedLinears) as one matrix, the other 2-D parameters,
    the input embedding only when it doubles as the LM head, and of every MoE layer the
    first round(`experts_per_layer`) experts of each expert stack as one matrix (default k:
    module docstring)."""
    embed = model.model.embed_tokens.weight
    stacks, covered = [], set()
    for module in model.modules():
        fused = getattr(module, "fused", None)
        if fused is not None and fused.live():
            stacks.append(fused.weight)
            covered.update(id(linear.weight) for linear in fused.linears)
        if isinstance(module, SparseMoeBlock):
            n = module.gate.top_k if experts_per_layer is None else round(experts_per_layer)
            if n:  # n experts' bytes, read as one matrix per stack (module docstring: why)
                gate_up, down = module.experts.gate_up_proj[:n], module.experts.down_proj[:n]
                stacks += [gate_up.reshape(-1, gate_up.shape[-1]), down.reshape(-1, down.shape[-1])]
    out = stacks + [p for p in model.parameters() if p.dim() == 2 and p is not embed and id(p) not in covered]
    if model.config.tie_word_embeddings:
        out.append(embed)
    return out


def weight_streaming_floor(
    model: CausalLM, repeats: int = 20, rows: int = 1, experts_per_layer: float | None = None
) -> Floor:
    """Median (and range) over `repeats` of the time to read every weight once with `rows`
    input rows (1 for a decode step of one request): one vendor matrix product per weight
    into a buffer of its own, nothing else in the chain; of a mixture of experts,
    `experts_per_layer` experts a layer (module docstring)."""
    weights = streamed_weights(model, experts_per_layer)
    device = weights[0].device
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype, device=device) for w in weights}
    outputs = [torch.empty(rows, w.shape[0], dtype=w.dtype, device=device) for w in weights]

    def chain() -> None:
        for w, out in zip(weights, outputs):  # a kernel in a graph runs: nothing can skip it
            torch.matmul(inputs[w.shape[1]], w.t(), out=out)

    times = []
    with torch.no_grad():
        if device.type == "cuda":
            chain()  # library handles and workspaces before the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain()
            graph.replay()
            torch.cuda.synchronize(device)
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        else:
            chain()
            for _ in range(repeats):
                t0 = time.perf_counter()
                chain()
                times.append(1000 * (time.perf_counter() - t0))
    size = sum(w.numel() * w.element_size() for w in weights)
    moe = any(isinstance(m, SparseMoeBlock) for m in model.modules())
    if moe and experts_per_layer is None:
        experts_per_layer = float(model.config.num_experts_per_tok)
    return Floor(
        statistics.median(times), min(times), max(times), size, repeats, experts_per_layer if moe else None
    )
