"""Compute kernels and the numerics switch.

Every model forward calls its arithmetic through one `Kernels` table (linear, norms, SwiGLU,
causal conv, attention over the position-indexed cache, the gated delta rule, greedy
argmax, a mixture of experts' routing and expert products). Three tables exist:

- `TORCH` (reference.py): plain PyTorch. The reference every other kernel is tested
  against, the CPU path, and what a float64 model runs on CUDA.
- `TRITON` (triton_ops.py): batch- and verify-invariant Triton kernels, the `exact`
  numerics on CUDA: a token's results are the same bits whether it runs alone, in a batch,
  or inside a verify block of B, so DFlash equals plain greedy bit for bit in bfloat16.
- `VENDOR` (triton_ops.py): the `fast` numerics on CUDA: cuBLAS GEMMs, the Triton kernels
  for the rest (the experts' grouped products included: kernels/moe.py). A token's bits
  move with the batch (the GEMMs), as in serving engines.

`select(numerics, device, dtype)` picks one. This package imports only torch and triton.
"""

from __future__ import annotations

import torch

from .table import TORCH, Kernels

__all__ = ["EXACT_DTYPES", "NUMERICS", "TORCH", "Kernels", "default_numerics", "select"]

NUMERICS = ("exact", "fast")
EXACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def default_numerics(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> str:
    """`exact` on CUDA for the dtypes it runs (the gates' promise holds in bfloat16), else
    `fast`: the references, which is what a float64 model or the CPU runs anyway."""
    cuda = torch.device(device).type == "cuda"
    return "exact" if cuda and dtype in EXACT_DTYPES else "fast"


def select(numerics: str | None, device: torch.device | str, dtype: torch.dtype) -> Kernels:
    """The kernels for a model on `device` in `dtype` (numerics None: the default for both)."""
    numerics = default_numerics(device, dtype) if numerics is None else numerics
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    if torch.device(device).type != "cuda":
        return TORCH
    if dtype not in EXACT_DTYPES:
        if numerics == "fast":
            return TORCH
        raise ValueError(
            f"exact numerics runs bfloat16, float16 or float32 models, not {dtype}; use numerics 'fast'"
        )
    from .triton_ops import TRITON, VENDOR  # needs triton, present wherever CUDA torch is

    return VENDOR if numerics == "fast" else TRITON
