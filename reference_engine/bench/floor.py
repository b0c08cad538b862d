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

A step also reads each request's cache: with `context` (the mean number of positions a row's
query sees) the floor reads, per attention layer, the keys and values of `context` positions
(a sliding-window layer at most its window) for each of `rows` requests, and per Gated
DeltaNet layer each request's recurrent state, as one matrix a layer in the cache's own dtype
(`cache_matrices`). Without it the floor is the weights' alone, right for short contexts.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..config import LINEAR_ATTENTION, SLIDING_ATTENTION
from ..kernels.reference import accumulation_dtype
from ..models import CausalLM
from ..models.moe import SparseMoeBlock


@dataclass(frozen=True)
class Floor:
    ms_median: float
    ms_min: float
    ms_max: float
    bytes: int  # bytes read per step: weights, and the cache's with a context
    repeats: int
    experts_per_layer: float | None = None  # experts read per MoE layer (None: a dense model)
    cache_bytes: int = 0  # of `bytes`, the keys, values and recurrent states read

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


def cache_matrices(model: CausalLM, requests: int, context: int) -> list[torch.Tensor]:
    """What `requests` rows whose queries each see `context` positions read of their cache, one
    matrix a layer (random: only the bytes count): an attention layer's keys and values
    ([2 x requests x positions, kv_heads x head_dim], positions capped by a sliding window),
    a Gated DeltaNet layer's recurrent states ([requests x value heads x key dim, value dim],
    in the float32 they are kept in)."""
    config = model.config
    weight = model.model.embed_tokens.weight
    out = []
    for kind in config.layer_types:
        if kind == LINEAR_ATTENTION:
            rows = requests * config.linear_num_value_heads * config.linear_key_head_dim
            shape, dtype = (rows, config.linear_value_head_dim), accumulation_dtype(weight.dtype)
        else:
            seen = min(context, config.sliding_window) if kind == SLIDING_ATTENTION else context
            shape = (2 * requests * seen, config.num_key_value_heads * config.head_dim)
            dtype = weight.dtype
        out.append(torch.randn(shape, dtype=dtype, device=weight.device))
    return out


def weight_streaming_floor(
    model: CausalLM,
    repeats: int = 20,
    rows: int = 1,
    experts_per_layer: float | None = None,
    context: int = 0,
) -> Floor:
    """Median (and range) over `repeats` of the time to read every weight once with `rows`
    input rows (1 for a decode step of one request): one vendor matrix product per weight
    into a buffer of its own, nothing else in the chain; of a mixture of experts,
    `experts_per_layer` experts a layer; with `context`, the caches of `rows` requests whose
    queries see that many positions as well (module docstring)."""
    caches = cache_matrices(model, rows, context) if context else []
    weights = streamed_weights(model, experts_per_layer) + caches
    device = weights[0].device
    inputs = {
        (w.shape[1], w.dtype): torch.randn(rows, w.shape[1], dtype=w.dtype, device=device) for w in weights
    }
    outputs = [torch.empty(rows, w.shape[0], dtype=w.dtype, device=device) for w in weights]

    def chain() -> None:
        for w, out in zip(weights, outputs):  # a kernel in a graph runs: nothing can skip it
            torch.matmul(inputs[w.shape[1], w.dtype], w.t(), out=out)

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
        statistics.median(times),
        min(times),
        max(times),
        size,
        repeats,
        experts_per_layer if moe else None,
        sum(c.numel() * c.element_size() for c in caches),
    )


@dataclass(frozen=True)
class PrefillFloor:
    ms_median: float
    ms_min: float
    ms_max: float
    tokens: int
    flops: float  # of the products and the attention, per prompt
    repeats: int


def prefill_compute_floor(model: CausalLM, tokens: int, repeats: int = 3) -> PrefillFloor:
    """Median (and range) over `repeats` of the vendor's time for the arithmetic a prefill of
    one `tokens`-token prompt cannot skip: one product per weight matrix (as streamed_weights
    lists them, with k experts a MoE layer) over all the prompt's rows at once, the LM head
    over the last row only (a prefill samples one token), and per
    attention layer the fused causal attention of torch's scaled_dot_product_attention over
    the prompt (the flash kernel where it applies); a sliding-window layer's queries past its
    window see only the window's keys, so its first window runs causal and the rest as one
    unmasked product over a window of keys. Norms, rotary embedding, routing and the
    Gated DeltaNet recurrence are left out, so a prefill may not reach it on a hybrid model.
    A device figure: on the CPU it times the same products with the host clock."""
    config = model.config
    every = streamed_weights(model)
    # the head by identity: a tensor-parallel rank's holds only its slice of the vocabulary
    head = model.lm_head_weight
    weights = [w for w in every if w is not head]
    device, dtype = every[0].device, every[0].dtype
    rows = {w.shape[1]: torch.randn(tokens, w.shape[1], dtype=dtype, device=device) for w in every}
    outs = {w.shape[0]: torch.empty(tokens, w.shape[0], dtype=dtype, device=device) for w in weights}
    logits = torch.empty(1, head.shape[0], dtype=dtype, device=device)
    heads, dim = config.num_attention_heads, config.head_dim
    # per attention layer, how many of the prompt's first positions run causal; past a sliding
    # window each query sees that window's keys, one unmasked product
    windows = [
        min(tokens, config.sliding_window) if kind == SLIDING_ATTENTION else tokens
        for kind in config.layer_types
        if kind != LINEAR_ATTENTION
    ]
    q = torch.randn(1, heads, tokens, dim, dtype=dtype, device=device)
    k, v = torch.randn_like(q), torch.randn_like(q)  # kv heads repeated: the flash kernel's layout
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run() -> None:
        for w in weights:
            torch.matmul(rows[w.shape[1]], w.t(), out=outs[w.shape[0]])
        torch.matmul(rows[head.shape[1]][-1:], head.t(), out=logits)
        for window in windows:
            sdpa(q[:, :, :window], k[:, :, :window], v[:, :, :window], is_causal=True)
            if window < tokens:
                sdpa(q[:, :, window:], k[:, :, :window], v[:, :, :window])

    def clock() -> float:
        if device.type != "cuda":
            t0 = time.perf_counter()
            run()
            return 1000 * (time.perf_counter() - t0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    with torch.no_grad():
        clock()  # library handles, workspaces, kernel choice
        times = [clock() for _ in range(repeats)]
    products = sum(2.0 * tokens * w.numel() for w in weights) + 2.0 * head.numel()
    # causal over w positions: half of 4 w^2 H D; each later query against w keys: 4 w H D
    attention = sum(2.0 * w * w * heads * dim + 4.0 * (tokens - w) * w * heads * dim for w in windows)
    return PrefillFloor(
        statistics.median(times), min(times), max(times), tokens, products + attention, repeats
    )
