"""The `exact` kernels table: every entry a batch- and verify-invariant Triton kernel with the
contract of its PyTorch reference (kernels/reference.py)."""

from __future__ import annotations

from .argmax import greedy
from .attention import attention
from .gated_delta import causal_conv, gated_delta
from .matmul import matmul
from .norms import gated_rms_norm, l2_norm, rms_norm, silu_mul
from .table import Kernels

TRITON = Kernels(
    name="triton",
    linear=matmul,
    rms_norm=rms_norm,
    gated_rms_norm=gated_rms_norm,
    l2_norm=l2_norm,
    silu_mul=silu_mul,
    causal_conv=causal_conv,
    attention=attention,
    gated_delta=gated_delta,
    greedy=greedy,
)
