"""Fused projections (models/layers.FusedLinears): the linears that read one input run as one
matmul over their stacked weights, the parameters becoming views of that matrix. The engine
fuses on CUDA; here the fused model is checked against the unfused one on the CPU, through
the references and the Triton table (interpreted), and the bookkeeping: names, values, one
copy, a replaced parameter noticed. Bitwise equality of fused and separate products with the
exact kernels on the device: tests/test_kernels_gpu.py."""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():  # the Triton table runs interpreted (before any kernel import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.kernels import TORCH
from reference_engine.models import fuse_projections
from reference_engine.models.dflash import DraftState
from reference_engine.runtime.decode import new_state

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def forward_all(target, draft, ops) -> tuple[torch.Tensor, ...]:
    """A prefill with captured features, a decode step, the draft's context write and block
    pass: every fused layer (attention, MLP, Gated DeltaNet, the draft's context keys)."""
    prompt = torch.tensor([[5, 9, 3, 77, 12, 40, 8]], device=DEVICE)
    slots = torch.tensor([0], device=DEVICE)
    state = new_state(target, 16)
    positions = torch.arange(7, device=DEVICE)[None]
    out = target(prompt, positions, slots, state, 7, capture_layers=draft.config.target_layer_ids, ops=ops)
    step = target(prompt[:, :1], torch.tensor([[7]], device=DEVICE), slots, state, 8, ops=ops)
    dstate = DraftState(draft.config, 1, 16, torch.float32, DEVICE)
    draft.append_context(out.features, positions, slots, dstate, ops)
    block = target.embed(torch.tensor([[8, 1, 1, 1]], device=DEVICE))
    hidden = draft(block, torch.arange(7, 11, device=DEVICE)[None], slots, dstate, 11, ops=ops)
    return out.logits, step.logits, draft.logits(hidden, target.lm_head_weight, ops), dstate.k_cache[0]


@pytest.fixture(scope="module")
def pair(tiny_pair):
    target_dir, draft_dir = tiny_pair("qwen3_5", block_size=4)
    target = load_target(target_dir, dtype=torch.float32, device=DEVICE)
    return target, load_draft(draft_dir, target)


def fused_copy(target, draft):
    target, draft = copy.deepcopy(target), copy.deepcopy(draft)
    fuse_projections(target)
    fuse_projections(draft)
    return target, draft


def test_a_fused_model_keeps_its_parameters_names_and_values_in_one_copy(pair) -> None:
    target, draft = pair
    fused_target, _ = fused_copy(target, draft)
    before, after = target.state_dict(), fused_target.state_dict()
    assert list(before) == list(after)
    assert all(torch.equal(before[name], after[name]) for name in before)
    attn = next(layer.self_attn for layer in fused_target.model.layers if not layer.is_linear)
    stacked = attn.fused.weight
    assert attn.q_proj.weight.data_ptr() == stacked.data_ptr()  # views, no second copy
    assert attn.v_proj.weight.data_ptr() == stacked[-attn.v_proj.out_features].data_ptr()
    gdn = next(layer.linear_attn for layer in fused_target.model.layers if layer.is_linear)
    assert gdn.fused.live() and fused_target.model.layers[0].mlp.fused.live()


@pytest.mark.parametrize("table", ["torch", "triton"])
def test_fused_projections_give_the_unfused_outputs(pair, table: str) -> None:
    if table == "triton":
        pytest.importorskip("triton")
        from reference_engine.kernels.triton_ops import TRITON as ops
    else:
        ops = TORCH
    target, draft = pair
    want = forward_all(target, draft, ops)
    got = forward_all(*fused_copy(target, draft), ops)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-5), (g - w).abs().max()


def test_a_replaced_parameter_is_noticed_and_used(pair) -> None:
    target, draft = pair
    fused_target, fused_draft = fused_copy(target, draft)
    mlp = fused_target.model.layers[0].mlp
    base = forward_all(fused_target, fused_draft, TORCH)[0]
    mlp.up_proj.weight = torch.nn.Parameter(torch.zeros_like(mlp.up_proj.weight))  # not in place
    assert not mlp.fused.live()
    changed = forward_all(fused_target, fused_draft, TORCH)[0]
    assert not torch.allclose(changed, base)  # the new (zero) weight is what runs
    fuse_projections(fused_target)  # re-fuses that layer from the new parameters
    assert mlp.fused.live() and torch.equal(mlp.up_proj.weight, torch.zeros_like(mlp.up_proj.weight))
    assert torch.allclose(forward_all(fused_target, fused_draft, TORCH)[0], changed, atol=1e-6)


def test_a_fused_model_saves_and_loads_back(pair, tmp_path) -> None:
    """Its parameters are views of the stacked matrices (disjoint row ranges of one storage);
    the checkpoint writer writes each as its own tensor and they read back unchanged."""
    from reference_engine.checkpoint import write_safetensors

    target, draft = pair
    fused_target, _ = fused_copy(target, draft)
    write_safetensors(tmp_path, fused_target.state_dict())
    from safetensors.torch import load_file

    loaded = load_file(str(tmp_path / "model.safetensors"))
    want = target.state_dict()
    assert set(loaded) == set(want)
    assert all(torch.equal(loaded[name].to(want[name].device), want[name]) for name in want)
