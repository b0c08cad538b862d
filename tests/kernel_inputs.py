"""Inputs the kernel tests share: seeded random tensors on the device the tests run on."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def delta_inputs(batch: int = 2, T: int = 4, heads: int = 3, dk: int = 16, dv: int = 40):
    """The gated delta rule's q, k, v, g, beta and initial state: unit q and k, decays below 1."""
    q = torch.nn.functional.normalize(rand(batch, T, heads, dk), dim=-1)
    k = torch.nn.functional.normalize(rand(batch, T, heads, dk, seed=1), dim=-1)
    v = rand(batch, T, heads, dv, seed=2)
    g = -rand(batch, T, heads, seed=3).abs()
    beta = torch.sigmoid(rand(batch, T, heads, seed=4))
    state = rand(batch, heads, dk, dv, seed=5)
    return q, k, v, g, beta, state
