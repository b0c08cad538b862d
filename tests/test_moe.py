"""The mixture-of-experts block (models/moe.py) and the Qwen3-MoE family around it: routing
in float32, the fixed order of each token's expert sum, a token's bits alone and in a batch,
the config rules (which layers are MoE), and both expert layouts of the checkpoint loader
with their errors. Logit parity with transformers: test_parity_transformers.py."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from reference_engine.checkpoint import SINGLE_FILE, load_target
from reference_engine.checkpoint.__main__ import main as checkpoint_main
from reference_engine.config import QWEN3_MOE, TargetConfig
from reference_engine.errors import CheckpointError, ConfigError
from reference_engine.kernels import TORCH
from reference_engine.kernels.reference import route_experts as route
from reference_engine.models import expected_shapes
from reference_engine.models.moe import SparseMoeBlock

TinyCheckpoint = Callable[..., Path]
HIDDEN, WIDTH, EXPERTS, TOP_K = 32, 16, 8, 3

# Qwen3-30B-A3B's config.json, as published
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "use_sliding_window": False,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def qwen3_moe(**changes: Any) -> dict[str, Any]:
    return {**copy.deepcopy(QWEN3_30B_A3B), **changes}


def random_block(seed: int = 0, shared: int = 0, renormalise: bool = True) -> SparseMoeBlock:
    block = SparseMoeBlock(HIDDEN, WIDTH, EXPERTS, TOP_K, renormalise, shared_intermediate_size=shared)
    gen = torch.Generator().manual_seed(seed)
    for p in block.parameters():
        p.data = torch.randn(p.shape, generator=gen, dtype=torch.float64) * p.shape[-1] ** -0.5
    return block.requires_grad_(False)


def tokens(n: int, seed: int = 1) -> torch.Tensor:  # [1, n, HIDDEN]
    return torch.randn(1, n, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ----------------------------------------------------------------------------- routing
def test_routing_takes_the_top_k_of_a_float32_softmax_renormalised_and_cast_back() -> None:
    logits = torch.randn(20, EXPERTS, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weights, experts = route(logits, TOP_K, renormalise=True)
    probs = torch.softmax(logits.float(), dim=-1)
    top, ids = probs.topk(TOP_K, dim=-1)
    assert weights.dtype == torch.float64
    assert torch.equal(experts, ids.sort(dim=-1).values)
    expected = (top / top.sum(-1, keepdim=True)).double()
    by_id = expected.gather(-1, ids.sort(dim=-1).indices)
    assert torch.equal(weights, by_id)
    unnormalised, _ = route(logits, TOP_K, renormalise=False)
    assert torch.equal(unnormalised, top.double().gather(-1, ids.sort(dim=-1).indices))
    assert not torch.allclose(unnormalised.sum(-1), torch.ones(20, dtype=torch.float64))


def test_a_near_tie_between_experts_is_decided_on_float32_probabilities() -> None:
    """Two logits that differ below float32 resolution: float64 would pick the larger, the
    float32 softmax (as transformers and the published models route) ties them and topk
    keeps its own order."""
    logits = torch.tensor([[0.0, 1.0, 1.0 + 1e-12, -1.0]], dtype=torch.float64)
    _, experts = route(logits, 1, renormalise=True)
    _, in_float32 = torch.softmax(logits.float(), -1).topk(1)
    _, in_float64 = torch.softmax(logits, -1).topk(1)
    assert experts.item() == in_float32.item() != in_float64.item()


def test_each_tokens_experts_come_in_ascending_id_order() -> None:
    logits = torch.randn(50, EXPERTS, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    _, experts = route(logits, TOP_K, renormalise=False)
    assert (experts[:, 1:] > experts[:, :-1]).all()


# ----------------------------------------------------------------------------- the sum
def one_expert(block: SparseMoeBlock, e: int, x: torch.Tensor) -> torch.Tensor:
    gate, up = TORCH.linear(x, block.experts.gate_up_proj[e]).chunk(2, dim=-1)
    return TORCH.linear(TORCH.silu_mul(gate, up), block.experts.down_proj[e])


def test_a_tokens_k_experts_are_summed_one_at_a_time_in_ascending_id_order() -> None:
    block = random_block()
    flat = tokens(40)[0]
    weights, experts = block.gate(flat)
    in_topk_order_differs = 0
    for t in range(flat.shape[0]):
        x = flat[t : t + 1]
        ys = [one_expert(block, e, x) * w for e, w in zip(experts[t], weights[t], strict=True)]
        ascending = ys[0]
        for y in ys[1:]:
            ascending = ascending + y
        assert torch.equal(block(x[None])[0], ascending), t
        by_weight = sorted(range(TOP_K), key=lambda j: -weights[t, j].item())
        other = ys[by_weight[0]]
        for j in by_weight[1:]:
            other = other + ys[j]
        in_topk_order_differs += not torch.equal(other, ascending)
    assert in_topk_order_differs  # the order is seen: another one gives other bits


def test_a_tokens_output_is_the_same_bits_alone_and_among_tokens_routed_elsewhere() -> None:
    block = random_block()
    pool = tokens(400, seed=7)[0]
    _, experts = block.gate(pool)
    mine = pool[0]
    taken = set(experts[0].tolist())
    others = [i for i in range(1, len(pool)) if not taken & set(experts[i].tolist())]
    assert len(others) >= 7
    batch = torch.stack([pool[i] for i in others[:3]] + [mine] + [pool[i] for i in others[3:7]])
    alone = block(mine[None, None])[0, 0]
    assert torch.equal(block(batch[None])[0, 3], alone)
    assert torch.equal(block(batch.view(2, 4, HIDDEN))[0, 3], alone)  # as [batch, T]


def test_the_shared_expert_adds_its_output_behind_a_sigmoid_gate() -> None:
    block = random_block(shared=24)
    routed_only = random_block()
    x = tokens(9)
    flat = x[0]
    shared = block.shared_expert(flat)
    gate = torch.sigmoid(flat @ block.shared_expert_gate.weight.T)
    routed = block.experts(flat, *block.gate(flat))
    assert torch.allclose(block(x)[0], routed + gate * shared, rtol=0, atol=1e-14)
    assert routed_only.shared_expert is None and "shared_expert_gate" not in dict(
        routed_only.named_parameters()
    )


# ----------------------------------------------------------------------------- config
def test_qwen3_30b_a3b_config_parses_every_moe_field() -> None:
    c = TargetConfig.from_hf(qwen3_moe())
    assert c.family == QWEN3_MOE and c.is_moe
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (128, 8, 768)
    assert c.norm_topk_prob and c.head_dim == 128 and c.intermediate_size == 6144
    assert c.moe_layers == tuple(range(48)) and c.dense_layers == ()
    assert c.qk_norm and not c.norm_offset and not c.is_hybrid


def test_norm_topk_prob_defaults_to_false_as_in_transformers() -> None:
    raw = qwen3_moe()
    del raw["norm_topk_prob"]
    assert not TargetConfig.from_hf(raw).norm_topk_prob


@pytest.mark.parametrize(
    ("step", "mlp_only", "moe"),
    [(1, [], (0, 1, 2, 3)), (2, [], (1, 3)), (2, [3], (1,)), (1, [0, 2], (1, 3)), (3, [], (2,))],
)
def test_moe_layers_follow_decoder_sparse_step_and_mlp_only_layers(
    step: int, mlp_only: list[int], moe: tuple[int, ...]
) -> None:
    c = TargetConfig.from_hf(
        qwen3_moe(num_hidden_layers=4, decoder_sparse_step=step, mlp_only_layers=mlp_only)
    )
    assert c.moe_layers == moe
    shapes = expected_shapes(c)
    for i in range(4):
        assert (f"model.layers.{i}.mlp.experts.gate_up_proj" in shapes) == (i in moe)
        assert (f"model.layers.{i}.mlp.gate_proj.weight" in shapes) == (i not in moe)


def test_moe_tensor_shapes_are_the_fused_layout_of_transformers() -> None:
    shapes = expected_shapes(TargetConfig.from_hf(qwen3_moe(num_hidden_layers=1)))
    assert shapes["model.layers.0.mlp.gate.weight"] == (128, 2048)
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (128, 2 * 768, 2048)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (128, 2048, 768)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32 * 128, 2048)
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (128,)


def test_an_all_moe_config_needs_no_intermediate_size() -> None:
    raw = qwen3_moe()
    del raw["intermediate_size"]
    assert TargetConfig.from_hf(raw).intermediate_size == 0


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (
            {"mlp_only_layers": [5], "intermediate_size": None},
            r"layers \[5\] have a dense MLP|required field 'intermediate_size' is missing",
        ),
        ({"num_experts_per_tok": 129}, r"num_experts_per_tok 129 must be between 1 and num_experts 128"),
        ({"num_experts": 0}, r"'num_experts' must be a positive integer, got 0"),
        ({"moe_intermediate_size": None}, r"required field 'moe_intermediate_size' is missing"),
        ({"mlp_only_layers": [48]}, r"mlp_only_layers \[48\] out of range for 48 layers"),
        ({"mlp_only_layers": ["3"]}, r"'mlp_only_layers' must be a list of layer indices, got \['3'\]"),
        ({"decoder_sparse_step": 0}, r"'decoder_sparse_step' must be a positive integer, got 0"),
        ({"use_sliding_window": True, "sliding_window": 4096}, r"use_sliding_window true is not supported"),
    ],
    ids=[
        "dense-layer-without-width",
        "top-k-above-experts",
        "no-experts",
        "no-moe-width",
        "mlp-only-out-of-range",
        "mlp-only-not-ints",
        "zero-sparse-step",
        "sliding-window",
    ],
)
def test_bad_qwen3_moe_field_is_rejected_with_its_value(change: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        TargetConfig.from_hf(qwen3_moe(**change))


# ----------------------------------------------------------------------------- loading
def rewrite(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(path / SINGLE_FILE))
    edit(tensors)
    save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})


def test_per_expert_tensors_load_into_the_fused_layout_in_expert_id_order(
    tiny_checkpoint: TinyCheckpoint,
) -> None:
    overrides = (("num_experts", 12),)  # ids 10 and 11 sort before 2 as text
    split = tiny_checkpoint("qwen3_moe", config_overrides=overrides)
    model = load_target(split, dtype=torch.float64)
    stored = load_file(str(split / SINGLE_FILE))
    experts = model.model.layers[0].mlp.experts
    for e in range(12):
        gate = stored[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"].double()
        up = stored[f"model.layers.0.mlp.experts.{e}.up_proj.weight"].double()
        assert torch.equal(experts.gate_up_proj[e], torch.cat([gate, up]))
        assert torch.equal(
            experts.down_proj[e], stored[f"model.layers.0.mlp.experts.{e}.down_proj.weight"].double()
        )


def test_a_missing_expert_tensor_is_named_with_the_fused_tensor_it_belongs_to(
    tiny_checkpoint: TinyCheckpoint, copy_checkpoint: Callable[[Path], Path]
) -> None:
    path = copy_checkpoint(tiny_checkpoint("qwen3_moe"))
    rewrite(path, lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    with pytest.raises(
        CheckpointError,
        match=r"missing tensor\(s\) model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight \(per-expert "
        r"layout of model\.layers\.1\.mlp\.experts\.gate_up_proj \[8, 64, 64\]\)",
    ):
        load_target(path)


def test_a_misshapen_expert_tensor_is_named_with_found_and_expected_shapes(
    tiny_checkpoint: TinyCheckpoint, copy_checkpoint: Callable[[Path], Path]
) -> None:
    path = copy_checkpoint(tiny_checkpoint("qwen3_moe"))
    name = "model.layers.0.mlp.experts.2.down_proj.weight"
    rewrite(path, lambda t: t.update({name: t[name].T.contiguous()}))
    with pytest.raises(
        CheckpointError,
        match=rf"tensor {name} has shape \[32, 64\], expected \[64, 32\] \(an expert of "
        r"model\.layers\.0\.mlp\.experts\.down_proj \[8, 64, 32\]\)",
    ):
        load_target(path)


def test_a_misshapen_fused_expert_tensor_is_named(
    tiny_checkpoint: TinyCheckpoint, copy_checkpoint: Callable[[Path], Path]
) -> None:
    path = copy_checkpoint(tiny_checkpoint("qwen3_moe", expert_layout="fused"))
    name = "model.layers.2.mlp.experts.gate_up_proj"
    rewrite(path, lambda t: t.update({name: t[name][:, :32].contiguous()}))  # the gate rows only
    with pytest.raises(
        CheckpointError, match=rf"tensor {name} has shape \[8, 32, 64\], expected \[8, 64, 64\]$"
    ):
        load_target(path)


def test_an_expert_beyond_num_experts_is_an_unexpected_tensor(
    tiny_checkpoint: TinyCheckpoint, copy_checkpoint: Callable[[Path], Path]
) -> None:
    path = copy_checkpoint(tiny_checkpoint("qwen3_moe"))
    extra = "model.layers.0.mlp.experts.8.gate_proj.weight"
    rewrite(path, lambda t: t.update({extra: t["model.layers.0.mlp.experts.0.gate_proj.weight"].clone()}))
    with pytest.raises(CheckpointError, match=rf"unexpected tensor\(s\) {re.escape(extra)}"):
        load_target(path)


def test_experts_in_both_layouts_at_once_are_refused(
    tiny_checkpoint: TinyCheckpoint, copy_checkpoint: Callable[[Path], Path]
) -> None:
    path = copy_checkpoint(tiny_checkpoint("qwen3_moe"))
    fused = load_file(str(tiny_checkpoint("qwen3_moe", expert_layout="fused") / SINGLE_FILE))
    name = "model.layers.0.mlp.experts.down_proj"
    rewrite(path, lambda t: t.update({name: fused[name]}))
    with pytest.raises(CheckpointError, match=rf"{name} and per-expert tensors under .* both present"):
        load_target(path)


def test_per_expert_tensors_in_a_dense_layer_are_unexpected(
    tiny_checkpoint: TinyCheckpoint, copy_checkpoint: Callable[[Path], Path]
) -> None:
    path = copy_checkpoint(tiny_checkpoint("qwen3_moe"))  # layer 3 is dense
    raw = json.loads((path / "config.json").read_text())
    assert raw["mlp_only_layers"] == [3]
    extra = "model.layers.3.mlp.experts.0.down_proj.weight"
    rewrite(path, lambda t: t.update({extra: t["model.layers.0.mlp.experts.0.down_proj.weight"].clone()}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) model\.layers\.3\.mlp\.experts\.0"):
        load_target(path)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_make_tiny_qwen3_moe_writes_the_chosen_expert_layout(tmp_path: Path, layout: str) -> None:
    out = tmp_path / layout
    assert (
        checkpoint_main(["make-tiny", "--arch", "qwen3_moe", "--out", str(out), "--expert-layout", layout])
        == 0
    )
    names = set(load_file(str(out / SINGLE_FILE)))
    assert ("model.layers.0.mlp.experts.gate_up_proj" in names) == (layout == "fused")
    assert ("model.layers.0.mlp.experts.7.up_proj.weight" in names) == (layout == "per_expert")
    assert "model.layers.3.mlp.gate_proj.weight" in names  # the dense last layer
    model = load_target(out)
    assert model.config.moe_layers == (0, 1, 2)
