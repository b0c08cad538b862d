"""The weight-streaming floor of a decode step: the time to read every weight matrix of the
target once, measured on the device in the same process as the step it is compared with.

A decode step at small batch must stream all of the target's weights from memory at least
once, so no engine's step is faster than this. The floor is measured, not computed from a
datasheet: one matrix-vector product per weight matrix (the LM head included; an embedding
read only through its lookup is not), chained in one CUDA graph so that launch gaps do not
count, timed by CUDA events over replays. On the CPU the same chain is timed by the host
clock (the figure is then a CPU streaming time, rarely a useful floor).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..models import CausalLM


@dataclass(frozen=True)
class Floor:
    ms_median: float
    ms_min: float
    ms_max: float
    bytes: int  # weight bytes read per step
    repeats: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.ms_median / 1e6


def streamed_weights(model: CausalLM) -> list[torch.Tensor]:
    """Every weight matrix a decode step reads whole: the 2-D parameters, the input embedding
    only when it doubles as the LM head."""
    embed = model.model.embed_tokens.weight
    out = [p for p in model.parameters() if p.dim() == 2 and p is not embed]
    if model.config.tie_word_embeddings:
        out.append(embed)
    return out


def weight_streaming_floor(model: CausalLM, repeats: int = 20, rows: int = 1) -> Floor:
    """Median (and range) over `repeats` of the time to read every weight once with `rows`
    input rows (1 for a decode step of one request)."""
    weights = streamed_weights(model)
    device = weights[0].device
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype, device=device)
              for w in weights}
    sink = torch.zeros((), dtype=torch.float32, device=device)

    def chain() -> None:
        for w in weights:  # the output is reduced so that no product can be skipped
            sink.add_(torch.nn.functional.linear(inputs[w.shape[1]], w)[0, 0].float())

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
    return Floor(statistics.median(times), min(times), max(times), size, repeats)
