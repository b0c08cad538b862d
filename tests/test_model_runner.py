"""The model runner's one decision (reference_engine/runtime/model_runner.py): when the
engine's forwards are captured as CUDA graphs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from reference_engine.kernels import TORCH
from reference_engine.runtime.model_runner import graphs_possible

CUDA = torch.device("cuda")


def test_graphs_need_cuda_capturable_kernels_and_no_eager_flag() -> None:
    capturable = replace(TORCH, capturable=True)
    assert graphs_possible(CUDA, capturable, enforce_eager=False)
    assert not graphs_possible(torch.device("cpu"), capturable, enforce_eager=False)
    assert not graphs_possible(CUDA, replace(TORCH, capturable=False), enforce_eager=False)
    assert not graphs_possible(CUDA, capturable, enforce_eager=True)


def test_the_references_are_not_capturable_and_the_triton_tables_are() -> None:
    """The references' expert loop asks the host which experts have tokens (so do other
    reference kernels); the Triton tables route and run experts on the device alone."""
    triton_ops = pytest.importorskip("reference_engine.kernels.triton_ops")
    assert not TORCH.capturable
    assert triton_ops.TRITON.capturable and triton_ops.VENDOR.capturable
    assert triton_ops.TRITON.experts is triton_ops.VENDOR.experts is not TORCH.experts
