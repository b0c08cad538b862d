"""Parts shared by every model: RMSNorm, RoPE, the SwiGLU MLP and cached attention.

The arithmetic runs through a kernels table (reference_engine/kernels): the forward context
carries it (`ctx.ops`); modules called without one use the PyTorch references. Precision
policy (kernels/reference.py): half-precision models accumulate norms, softmax and recurrent
state in float32; float32 and float64 models stay in their own dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from ..config import Llama3RopeScaling
from ..kernels import TORCH, Kernels


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * w, or * (1 + w) when `offset` (Qwen3.5)."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor, ops: Kernels = TORCH) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.offset)

    def add(
        self, x: torch.Tensor, residual: torch.Tensor, ops: Kernels = TORCH
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + residual), x + residual) in one pass."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps, self.offset)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm (no offset) times silu(z): the Gated DeltaNet output norm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor, ops: Kernels = TORCH) -> torch.Tensor:
        return ops.gated_rms_norm(x, z, self.weight, self.eps)


class FusedLinears:
    """Linears that read the same input, computed by one matmul over their weights stacked by
    rows. Each linear's weight (and bias) becomes a view of its rows of the stacked matrix, so
    the model keeps one copy and its parameters keep their names and values; a parameter
    replaced afterwards (not updated in place) is noticed, and the linears then run one by
    one again. Splitting a matmul by output columns changes no element's sum, so with the
    exact kernels the outputs are the bits of the separate products."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        biases = [lin.bias for lin in linears]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            raise ValueError("FusedLinears: either every linear has a bias or none does")
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        self.weight = torch.cat([lin.weight.detach() for lin in linears])
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        start = 0
        for lin, size in zip(linears, self.sizes):
            grad = lin.weight.requires_grad
            lin.weight = nn.Parameter(self.weight[start : start + size], requires_grad=grad)
            if self.bias is not None:
                lin.bias = nn.Parameter(self.bias[start : start + size], requires_grad=grad)
            start += size

    def live(self) -> bool:
        """Whether every linear's weight is still its view of the stacked matrix."""
        start = 0
        for lin, size in zip(self.linears, self.sizes):
            if lin.weight.data_ptr() != self.weight[start].data_ptr():
                return False
            start += size
        return True

    def __call__(self, x: torch.Tensor, ops: Kernels, first: int = 0) -> list[torch.Tensor]:
        """The outputs of linears[first:], as column views of one product."""
        skip = sum(self.sizes[:first])
        bias = self.bias[skip:] if self.bias is not None else None
        return list(ops.linear(x, self.weight[skip:], bias).split(self.sizes[first:], dim=-1))


def run_linears(
    linears: list[nn.Linear], fused: FusedLinears | None, x: torch.Tensor, ops: Kernels, first: int = 0
) -> list[torch.Tensor]:
    """The outputs of linears[first:] for x: one product when `fused` is live, else one each."""
    if fused is not None and fused.live():
        return fused(x, ops, first)
    return [ops.linear(x, lin.weight, lin.bias) for lin in linears[first:]]


def fuse_projections(model: nn.Module) -> None:
    """Give every layer that reads one input through several linears (attention's q, k, v;
    the MLP's gate and up; Gated DeltaNet's four input projections) one matmul for them
    (FusedLinears). Parameters keep their names and values; calling it again re-fuses only
    layers whose parameters were replaced since."""
    for module in model.modules():
        fused = getattr(module, "fused", None)
        if hasattr(module, "fuse") and (fused is None or not fused.live()):
            module.fuse()


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); `bias` on all three (Llama's mlp_bias)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.fused: FusedLinears | None = None

    def fuse(self) -> None:
        """Compute gate and up projections by one matmul from now on (FusedLinears)."""
        self.fused = FusedLinears([self.gate_proj, self.up_proj])

    def forward(
        self, x: torch.Tensor, ops: Kernels = TORCH, *, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)), plus `residual` when given (the layer's residual
        connection, as a mixture of experts takes it: models/moe.SparseMoeBlock)."""
        gate, up = run_linears([self.gate_proj, self.up_proj], self.fused, x, ops)
        out = ops.linear(ops.silu_mul(gate, up), self.down_proj.weight, self.down_proj.bias)
        return out if residual is None else residual + out


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.x RoPE frequencies: those of long wavelength (past original / low_freq_factor)
    divided by `factor`, those of short wavelength (under original / high_freq_factor) kept,
    the band between interpolated smoothly. The float32 operations of transformers'
    `_compute_llama3_parameters`, in its order, so the frequencies are its bits."""
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    original = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """RoPE over the first `rotary_dim` dims of each head (rotate-half layout).

    Angles are computed in float32 whatever the model dtype, as the published checkpoints
    were trained and as other engines compute them. `scaling`: Llama 3.x frequencies.
    """

    def __init__(self, rotary_dim: int, theta: float, scaling: Llama3RopeScaling | None = None) -> None:
        super().__init__()
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
        inv_freq = 1.0 / (theta**exponents)
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rotary_dim = rotary_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        # positions: [batch, T] -> cos, sin: [batch, T, 1, rotary_dim]
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class SelfAttention(nn.Module):
    """Causal GQA attention with q_norm/k_norm (unless `qk_norm` is False: Llama) and RoPE
    over a position-indexed cache.

    `gated` is the Qwen3.5 variant: q_proj emits query and gate interleaved per head
    ([heads, 2 * head_dim], query first), and the output is multiplied by sigmoid(gate).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        norm_offset: bool,
        gated: bool,
        bias: bool = False,
        sliding_window: int | None = None,
        causal: bool = True,
        qk_norm: bool = True,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.gated = gated
        self.sliding_window = sliding_window
        self.causal = causal
        q_out = num_heads * head_dim * (2 if gated else 1)
        self.q_proj = nn.Linear(hidden_size, q_out, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps, offset=norm_offset)
            self.k_norm = RMSNorm(head_dim, eps, offset=norm_offset)
        self.fused: FusedLinears | None = None

    def fuse(self) -> None:
        """Compute the q, k and v projections by one matmul from now on (FusedLinears)."""
        self.fused = FusedLinears([self.q_proj, self.k_proj, self.v_proj])

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(*t.shape[:2], -1, self.head_dim)

    def _norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float, bool]:
        """(q_norm weight, k_norm weight, eps, offset) for the kernels' `attention_inputs`;
        without per-head norms (Llama) no weights, and the inputs are only rotated."""
        if not self.qk_norm:
            return None, None, 0.0, False
        return self.q_norm.weight, self.k_norm.weight, self.k_norm.eps, self.k_norm.offset

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        """Write this step's keys and values at their positions, then attend over the slot's
        cache. The cache is indexed by position, so rolling a request back needs no copy: a
        later write overwrites the rejected rows, which no query reads before then."""
        batch, T, _ = x.shape
        ops = ctx.ops
        q, k, v = run_linears([self.q_proj, self.k_proj, self.v_proj], self.fused, x, ops)
        q = q.view(batch, T, self.num_heads, -1)
        gate = None
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
            gate = gate.reshape(batch, T, -1)
        k_cache, v_cache = ctx.state.k_cache[layer], ctx.state.v_cache[layer]
        q = ops.attention_inputs(
            q,
            self._heads(k),
            self._heads(v),
            *self._norms(),
            ctx.cos,
            ctx.sin,
            k_cache,
            v_cache,
            ctx.cache_slots,
            ctx.positions,
        )
        out = ops.attention(
            q,
            k_cache,
            v_cache,
            ctx.cache_slots,
            ctx.positions,
            ctx.kv_len,
            self.head_dim**-0.5,
            self.causal,
            self.sliding_window,
            ctx.valid_len,
        ).reshape(batch, T, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return ops.linear(out, self.o_proj.weight, self.o_proj.bias)

    def write_kv(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> None:
        """Write this layer's keys and values for x at ctx.positions, attending to nothing
        (the DFlash draft's context rows, computed from target features)."""
        k, v = run_linears([self.q_proj, self.k_proj, self.v_proj], self.fused, x, ctx.ops, first=1)
        k_cache, v_cache = ctx.state.k_cache[layer], ctx.state.v_cache[layer]
        _, k_weight, eps, offset = self._norms()
        ctx.ops.attention_inputs(
            None,
            self._heads(k),
            self._heads(v),
            None,
            k_weight,
            eps,
            offset,
            ctx.cos,
            ctx.sin,
            k_cache,
            v_cache,
            ctx.cache_slots,
            ctx.positions,
        )


# a part of a forward timed as its own phase: name -> a context manager around the part
# (runtime/stats.PhaseTimer.parts); a forward nobody times runs its parts `untimed`
Phase = Callable[[str], AbstractContextManager]
_UNTIMED = nullcontext()


def untimed(name: str) -> AbstractContextManager:
    return _UNTIMED


class ForwardContext:
    """What every layer of one forward pass needs besides its input."""

    def __init__(
        self,
        state,  # TargetState (typed loosely to keep this module free of state imports)
        slots: torch.Tensor,  # [batch]
        positions: torch.Tensor,  # [batch, T]
        kv_len: int,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        valid_len: torch.Tensor | None = None,  # [batch] real tokens per row, None: all T
        record: str | None = None,  # keep verify inputs/states for a commit strategy
        chunked: bool = False,  # Gated DeltaNet by the PyTorch chunked form (training; full rows)
        ops: Kernels = TORCH,
        phase: Phase = untimed,
    ) -> None:
        if chunked and (valid_len is not None or record is not None):
            raise ValueError("a chunked forward takes full rows and records nothing")
        self.chunked = chunked
        self.ops = ops
        self.phase = phase
        self.state = state
        self.valid_len = valid_len
        self.record = record
        self.slots = slots
        # the attention caches' rows of the slots (a pooled cache maps them, runtime/kv_pool.py)
        rows = getattr(state, "cache_rows", None)
        self.cache_slots = slots if rows is None else rows(slots)
        self.positions = positions
        self.kv_len = kv_len
        self.rotary = rotary
        self.cos, self.sin = rotary.cos_sin(positions, dtype)
