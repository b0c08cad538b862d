"""The kernels table type, and the table of PyTorch references."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import reference


@dataclass(frozen=True)
class Kernels:
    """One implementation of every kernel the models call (signatures: reference.py)."""

    name: str
    linear: Callable
    rms_norm: Callable
    add_rms_norm: Callable
    gated_rms_norm: Callable
    silu_mul: Callable
    causal_conv_step: Callable
    attention_inputs: Callable
    attention: Callable
    gated_delta_inputs: Callable
    gated_delta: Callable
    gated_delta_resume: Callable
    greedy: Callable
    copy_rows: Callable
    conv_state_at: Callable
    route_experts: Callable
    experts: Callable
    # every kernel takes positions and lengths from device tensors (no host value bounds a
    # loop or a slice), so a forward through the table can be captured as a CUDA graph
    capturable: bool = False


TORCH = Kernels(
    name="torch",
    linear=reference.linear,
    rms_norm=reference.rms_norm,
    add_rms_norm=reference.add_rms_norm,
    gated_rms_norm=reference.gated_rms_norm,
    silu_mul=reference.silu_mul,
    causal_conv_step=reference.causal_conv_step,
    attention_inputs=reference.attention_inputs,
    attention=reference.attention,
    gated_delta_inputs=reference.gated_delta_inputs,
    gated_delta=reference.gated_delta,
    gated_delta_resume=reference.gated_delta_resume,
    greedy=reference.greedy,
    copy_rows=reference.copy_rows,
    conv_state_at=reference.conv_state_at,
    route_experts=reference.route_experts,
    experts=reference.experts,
)
