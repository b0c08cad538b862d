"""The model runner's one decision (reference_engine/runtime/model_runner.py): when the
engine's forwards are captured as CUDA graphs."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from reference_engine.kernels import TORCH
from reference_engine.runtime.model_runner import graphs_possible

CUDA = torch.device("cuda")


def target(moe: bool) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(is_moe=moe))


def test_graphs_need_cuda_capturable_kernels_and_no_eager_flag() -> None:
    capturable = replace(TORCH, capturable=True)
    assert graphs_possible(CUDA, capturable, target(False), enforce_eager=False)
    assert not graphs_possible(torch.device("cpu"), capturable, target(False), enforce_eager=False)
    assert not graphs_possible(CUDA, replace(TORCH, capturable=False), target(False), enforce_eager=False)
    assert not graphs_possible(CUDA, capturable, target(False), enforce_eager=True)


def test_a_mixture_of_experts_target_runs_eagerly() -> None:
    """Its expert loop asks the host which experts have tokens: no capture can hold that."""
    assert not graphs_possible(CUDA, replace(TORCH, capturable=True), target(True), enforce_eager=False)
