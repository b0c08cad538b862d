"""The kernel tables of CUDA devices.

`TRITON`, the `exact` numerics: every entry a batch- and verify-invariant Triton kernel with
the contract of its PyTorch reference (kernels/reference.py).

`VENDOR`, the `fast` numerics: cuBLAS GEMMs (through the reference `linear`) and PyTorch's
argmax, every other kernel the Triton one (a mixture of experts' grouped products too, so
exact and fast differ in the dense projections alone). The GEMMs are the only kernels whose bits move
with the batch, and the only ones a vendor library runs faster at every row count; the other
Triton kernels take lengths from device tensors, so the fast numerics are captured as CUDA
graphs too, and exact vs fast compares the cost of invariant matrix products alone."""

from __future__ import annotations

from dataclasses import replace

from . import reference
from .argmax import greedy
from .attention import attention
from .gated_delta import causal_conv_step, gated_delta, gated_delta_inputs, gated_delta_resume
from .matmul import matmul
from .moe import experts, route_experts
from .norms import add_rms_norm, gated_rms_norm, rms_norm, silu_mul
from .rope import attention_inputs
from .rows import conv_state_at, copy_rows
from .table import Kernels

TRITON = Kernels(
    name="triton",
    linear=matmul,
    rms_norm=rms_norm,
    add_rms_norm=add_rms_norm,
    gated_rms_norm=gated_rms_norm,
    silu_mul=silu_mul,
    causal_conv_step=causal_conv_step,
    attention_inputs=attention_inputs,
    attention=attention,
    gated_delta_inputs=gated_delta_inputs,
    gated_delta=gated_delta,
    gated_delta_resume=gated_delta_resume,
    greedy=greedy,
    copy_rows=copy_rows,
    conv_state_at=conv_state_at,
    route_experts=route_experts,
    experts=experts,
    capturable=True,
)

VENDOR = replace(TRITON, name="vendor", linear=reference.linear, greedy=reference.greedy)
