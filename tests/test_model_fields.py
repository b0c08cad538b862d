"""The model code against independent implementations where the other tests' checkpoints
leave a field at a value that hides it: norm epsilons far from the published 1e-6, a Llama
with attention biases but no MLP biases, heads wider than hidden / heads, drafts whose
sliding window is shorter than their context. Also: the features a target captures for its
draft, the check of a draft against its target on load, a loaded Llama draft's scaled RoPE,
what the tiny writers promise of their weights, and one DFlash2 layer against its
specification written out plainly.

Targets are compared with transformers (tests/test_parity_transformers.py's harness, float64),
drafts with z-lab's `dflash` package (`DFlashDraftModel`, `DFlash2DraftModel`) on the same
files: the block's final hidden states for one context and one block of random inputs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.checkpoint.synthetic import make_tiny_draft
from reference_engine.models.dflash import DraftState

from .test_parity_transformers import REL_TOL, Shape, relative_error, run_both

F64 = torch.float64


# ----------------------------------------------------------------------------- targets
def overrides(*pairs: tuple[str, Any]) -> tuple[tuple[str, Any], ...]:
    return (("config_overrides", pairs),)


FIELD_SHAPES = [
    # an epsilon near the mean square of the normed vectors: every norm's epsilon shows
    pytest.param(Shape("qwen3", 64, 3, 7, False, overrides(("rms_norm_eps", 0.5))), id="qwen3-eps"),
    pytest.param(Shape("llama", 64, 2, 7, False, overrides(("rms_norm_eps", 0.5))), id="llama-eps"),
    # the Gated DeltaNet output norm reads the config's epsilon too (not FLA's 1e-5 default)
    pytest.param(Shape("qwen3_5", 64, 4, 7, False, overrides(("rms_norm_eps", 0.05))), id="qwen3_5-eps"),
    pytest.param(
        Shape("qwen3_5_moe", 64, 2, 7, False, overrides(("rms_norm_eps", 0.5))), id="qwen3_5_moe-eps"
    ),
    # biases on q, k, v and o but none on the MLP (`attention_bias` and `mlp_bias` apart)
    pytest.param(
        Shape("llama", 64, 2, 8, False, (("bias", True), *overrides(("mlp_bias", False)))),
        id="llama-attention-bias-only",
    ),
    # heads of 32 dims while hidden / heads is 16: the published Qwen3-0.6B and 4B shape
    pytest.param(Shape("qwen3", 64, 2, 9, False, overrides(("head_dim", 32))), id="qwen3-head_dim"),
]


@pytest.mark.parametrize("shape", FIELD_SHAPES)
def test_targets_match_transformers_with_fields_the_published_values_hide(
    shape: Shape, tiny_checkpoint: Callable[..., Path]
) -> None:
    """Prefill and decode logits equal transformers' on a checkpoint whose `rms_norm_eps`,
    bias fields or `head_dim` differ from the values the other parity checkpoints carry, so
    a norm that keeps a hard-coded epsilon, one bias flag read for the other, or a head size
    taken as hidden_size / num_attention_heads shows."""
    trace = run_both(shape.checkpoint(tiny_checkpoint), shape, F64)
    err = max(
        relative_error(trace.ours_prefill, trace.hf_prefill),
        relative_error(trace.ours_decode, trace.hf_decode),
    )
    assert err <= REL_TOL[F64], f"relative error {err:.3g} > {REL_TOL[F64]}"
    assert trace.ours_tokens == trace.hf_tokens


# ----------------------------------------------------------------------------- drafts
CONTEXT, BLOCK = 13, 8


def draft_variant(root: Path, target_dir: Path, arch: str, edit: dict[str, Any], layers: int = 2) -> Path:
    """A tiny draft of `arch` for the target, with `edit` applied to its config.json (fields
    that change no tensor shape)."""
    out = root / f"{arch}-{'-'.join(edit) or 'plain'}"
    make_tiny_draft(out, target_dir, block_size=BLOCK, layers=layers, arch=arch, seed=3)
    raw = json.loads((out / "config.json").read_text())
    raw.update(edit)
    (out / "config.json").write_text(json.dumps(raw))
    return out


def our_block_hidden(
    draft, features: torch.Tensor, embeds: torch.Tensor, context: int = CONTEXT
) -> torch.Tensor:
    """Our draft's final hidden states of one block after a context of `context` positions."""
    state = DraftState(draft.config, 1, context + BLOCK, F64)
    slot = torch.tensor([0])
    draft.append_context(features, torch.arange(context)[None], slot, state)
    return draft(embeds, torch.arange(context, context + BLOCK)[None], slot, state, context + BLOCK)


DRAFT_VARIANTS = [
    ("dflash", {}),
    ("dflash", {"rms_norm_eps": 0.3}),
    # the legacy rule: a sliding layer attends causally inside the block, within its window
    (
        "dflash",
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 5,
            "use_sliding_window": True,
        },
    ),
    ("dflash2", {}),
    ("dflash2", {"rms_norm_eps": 0.3}),
    ("dflash2", {"sliding_window": 5}),
    ("dflash2", {"is_causal": True}),
]


@pytest.mark.parametrize(
    "arch,edit",
    DRAFT_VARIANTS,
    ids=[f"{arch}-{'-'.join(f'{k}' for k in edit) or 'plain'}" for arch, edit in DRAFT_VARIANTS],
)
@torch.inference_mode()
def test_draft_block_hidden_states_equal_zlabs_reference_draft(
    arch: str, edit: dict[str, Any], tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """The draft's final hidden states for a block after a context equal those of z-lab's
    reference model on the same files (their forward over the context features and the
    block's embeddings at positions 0..C+B-1): the context projection and its norm, the
    context keys at their positions, the block attention (bidirectional, causal, or inside
    a sliding window shorter than the context), each norm's epsilon, and for DFlash2 the
    convolution pair around every sublayer (which side's weights, from which input)."""
    dflash_model = pytest.importorskip("dflash.model", reason="z-lab's dflash package is not installed")
    target_dir = tiny_checkpoint("qwen3", layers=4, hidden=64)
    draft_dir = draft_variant(tmp_path, target_dir, arch, edit)
    target = load_target(target_dir, dtype=F64)
    draft = load_draft(draft_dir, target)
    reference_class = dflash_model.DFlash2DraftModel if arch == "dflash2" else dflash_model.DFlashDraftModel
    reference = reference_class.from_pretrained(draft_dir, dtype=F64).eval()
    gen = torch.Generator().manual_seed(5)
    features = torch.randn(1, CONTEXT, draft.config.num_features * 64, generator=gen, dtype=F64)
    embeds = torch.randn(1, BLOCK, 64, generator=gen, dtype=F64)
    ours = our_block_hidden(draft, features, embeds)
    theirs = reference(
        position_ids=torch.arange(CONTEXT + BLOCK)[None], noise_embedding=embeds, target_hidden=features
    )
    # their norms run in float32 even in a float64 model (as transformers'), ours in float64:
    # the two agree to about 1e-7 of the scale
    assert relative_error(ours, theirs) < 1e-5


@torch.inference_mode()
def test_a_loaded_llama_draft_rotates_with_its_scaled_rope(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """A Llama 3.x draft loaded from its files takes its config's RoPE scaling, as its target
    does and as the draft built from the same config: its block's hidden states after a
    context past the scaling's original length equal z-lab's reference draft on the same files
    (a loaded draft with plain theta frequencies is off by a tenth of the scale)."""
    target_dir = tiny_checkpoint("llama", layers=4, hidden=64)
    draft_dir = draft_variant(tmp_path, target_dir, "dflash", {})
    target = load_target(target_dir, dtype=F64)
    draft = load_draft(draft_dir, target)
    assert draft.config.rope_scaling is not None
    assert torch.equal(draft.rotary.inv_freq, target.rotary.inv_freq)
    dflash_model = pytest.importorskip("dflash.model", reason="z-lab's dflash package is not installed")
    reference = dflash_model.DFlashDraftModel.from_pretrained(draft_dir, dtype=F64).eval()
    context = draft.config.rope_scaling.original_max_position_embeddings + 40
    gen = torch.Generator().manual_seed(6)
    features = torch.randn(1, context, draft.config.num_features * 64, generator=gen, dtype=F64)
    embeds = torch.randn(1, BLOCK, 64, generator=gen, dtype=F64)
    ours = our_block_hidden(draft, features, embeds, context)
    theirs = reference(
        position_ids=torch.arange(context + BLOCK)[None], noise_embedding=embeds, target_hidden=features
    )
    assert relative_error(ours, theirs) < 1e-5


# ----------------------------------------------------------------------------- features
@pytest.mark.parametrize("capture", [(2, 0, 2), (3, 1)])
@torch.inference_mode()
def test_captured_features_are_the_listed_layers_outputs_in_the_drafts_order(
    capture: tuple[int, ...], tiny_checkpoint: Callable[..., Path]
) -> None:
    """The features a target hands its draft are the outputs of the layers the draft lists,
    concatenated in the draft's order with repeats kept (the published spread repeats a
    layer of a shallow target): transformers' hidden state after layer i for every listed i."""
    transformers = pytest.importorskip("transformers")
    from reference_engine.runtime.decode import new_state

    path = tiny_checkpoint("qwen3", layers=5, hidden=64)
    ours = load_target(path, dtype=F64)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=F64, attn_implementation="eager").eval()
    T = 9
    ids = torch.arange(7, 7 + T)[None]
    out = ours(ids, torch.arange(T)[None], torch.tensor([0]), new_state(ours, T), T, capture_layers=capture)
    # hidden_states[i + 1] is layer i's output (the last one is normed: not asked for here)
    hidden = hf(input_ids=ids, output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[i + 1] for i in capture], dim=-1)
    assert out.features.shape == (1, T, len(capture) * 64)
    assert relative_error(out.features, expected) < 1e-6


# ----------------------------------------------------------------------------- loading
def test_loading_a_draft_beside_a_target_it_was_not_built_for_is_refused(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """A draft built for a 4-layer target has every tensor shape a 5-layer target of the same
    width and vocabulary would need, so only the check against the target can refuse it:
    load_draft names the layer counts rather than pairing the two."""
    from reference_engine.errors import ConfigError

    four = tiny_checkpoint("qwen3", layers=4, hidden=64)
    five = load_target(tiny_checkpoint("qwen3", layers=5, hidden=64), dtype=F64)
    draft_dir = make_tiny_draft(tmp_path / "draft", four, block_size=BLOCK)
    load_draft(draft_dir, load_target(four, dtype=F64))  # its own target takes it
    with pytest.raises(ConfigError, match="4-layer target.*5 layers"):
        load_draft(draft_dir, five)


# ----------------------------------------------------------------------------- tiny writers
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@torch.inference_mode()
def test_a_tied_tiny_target_does_not_echo_its_input(arch: str, tiny_checkpoint: Callable[..., Path]) -> None:
    """Tied tiny checkpoints draw the embedding at the scale of a projection (the embedding
    is the LM head too): at unit scale the fed token's own logit would dominate and every
    greedy step would repeat the token it was fed, so tests on tied models would compare
    constant outputs. Here the next token differs from the fed one at most steps."""
    from reference_engine.runtime.decode import decode_step, new_state

    model = load_target(tiny_checkpoint(arch, layers=2, hidden=64, tie_word_embeddings=True), dtype=F64)
    steps = 24
    state = new_state(model, steps + 1)
    fed = torch.randint(0, model.config.vocab_size, (steps,), generator=torch.Generator().manual_seed(0))
    echoed = 0
    for token in fed.tolist():
        echoed += int(decode_step(model, state, 0, token).argmax()) == token
    assert echoed <= steps // 4, f"{echoed} of {steps} greedy steps echoed the fed token"


def test_tiny_hybrid_norm_weights_follow_each_norms_convention(tiny_checkpoint: Callable[..., Path]) -> None:
    """A tiny Qwen3.5 stores its (1 + w) norms' weights near 0 and the Gated DeltaNet output
    norm's (a plain w, no offset) near 1, so that every norm starts near the identity: drawn
    near 0, the gated norm would scale every linear-attention layer's output down tenfold and
    the hybrid tests would mostly exercise the attention layers."""
    from safetensors.torch import load_file

    tensors = load_file(tiny_checkpoint("qwen3_5", layers=4, hidden=64) / "model.safetensors")
    gated = [t for name, t in tensors.items() if name.endswith("linear_attn.norm.weight")]
    offset = [
        t for name, t in tensors.items() if name.endswith("layernorm.weight") or name.endswith("_norm.weight")
    ]
    assert gated and offset
    assert all(abs(t.mean().item() - 1.0) < 0.1 for t in gated)
    assert all(abs(t.mean().item()) < 0.1 for t in offset)


# ----------------------------------------------------------------------------- DFlash2 layer
@torch.inference_mode()
def test_a_dflash2_layer_wraps_each_sublayer_in_its_convolution_pair(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """One DFlash2 layer against docs/dflash2.md written out with plain operations: around
    each sublayer f (attention, then the MLP), from its normed input x, `delta =
    kernel_projection(x)` viewed [2, taps, groups] (side 0, then side 1), `y =
    f(conv(x, base[0], delta[0]))`, `out = conv(y, base[1], delta[1])`, and Qwen3's residual
    adds and norms. The attention is a stand-in here (a fixed map of its input), so that
    only the layer's wiring is under test; the convolution is the naive loop."""
    from types import SimpleNamespace

    from reference_engine.kernels import TORCH
    from reference_engine.models.layers import untimed

    from .test_dflash2 import naive_conv

    target_dir = tiny_checkpoint("qwen3", layers=4, hidden=64)
    draft = load_draft(draft_variant(tmp_path, target_dir, "dflash2", {}), load_target(target_dir, dtype=F64))
    layer = draft.layers[0]
    gen = torch.Generator().manual_seed(11)
    mixing = torch.randn(64, 64, generator=gen, dtype=F64) / 8

    class StandIn(torch.nn.Module):
        def forward(self, x, ctx, index):
            return torch.tanh(x @ mixing)

    layer.self_attn = StandIn()
    x = torch.randn(2, BLOCK, 64, generator=gen, dtype=F64)
    ours = layer(x, SimpleNamespace(ops=TORCH, phase=untimed), 0)

    eps = draft.config.rms_norm_eps

    def norm(v, weight):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight

    def convolved(conv, normed, sublayer):
        delta = (normed @ conv.kernel_projection.weight.T).view(2, BLOCK, 2, conv.taps, conv.groups)
        inner = naive_conv(normed, conv.base_kernel[0], delta[:, :, 0])
        return naive_conv(sublayer(inner), conv.base_kernel[1], delta[:, :, 1])

    mlp = layer.mlp

    def swiglu(v):
        gate = v @ mlp.gate_proj.weight.T
        return (gate * torch.sigmoid(gate) * (v @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T

    h = x + convolved(
        layer.attention_conv, norm(x, layer.input_layernorm.weight), lambda v: torch.tanh(v @ mixing)
    )
    expected = h + convolved(layer.mlp_conv, norm(h, layer.post_attention_layernorm.weight), swiglu)
    torch.testing.assert_close(ours, expected, rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------- loading
def _modules_and_buffers(model: torch.nn.Module) -> tuple[dict[str, type], dict[str, torch.Tensor]]:
    modules = {name: type(m) for name, m in model.named_modules()}
    buffers = {name: b for name, b in model.named_buffers()}  # persistent or not (RoPE's)
    return modules, buffers


@pytest.mark.parametrize("draft_arch", ["dflash", "dflash2"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "llama", "qwen3_moe", "qwen3_5_moe"])
def test_models_loaded_from_their_files_are_the_models_their_configs_build(
    arch: str, draft_arch: str, tiny_pair: Callable[..., tuple[Path, Path]]
) -> None:
    """A target and a draft loaded from their files have the modules and every buffer
    (the RoPE frequencies, which no checkpoint holds, among them) of the models their
    configs build, bit for bit: a loader that rebuilds a part the model builds itself (a
    draft's RoPE without its scaling, say) cannot make it differ."""
    from reference_engine.models import build_draft, build_target

    target_dir, draft_dir = tiny_pair(arch, draft_arch=draft_arch)
    target = load_target(target_dir, dtype=F64)
    draft = load_draft(draft_dir, target)
    for loaded, built in ((target, build_target(target.config)), (draft, build_draft(draft.config))):
        built = built.to(F64)
        built.load_state_dict(loaded.state_dict())
        loaded_modules, loaded_buffers = _modules_and_buffers(loaded)
        built_modules, built_buffers = _modules_and_buffers(built)
        assert loaded_modules == built_modules, arch
        assert loaded_buffers.keys() == built_buffers.keys(), arch
        for name, buffer in built_buffers.items():
            assert torch.equal(loaded_buffers[name], buffer), (arch, draft_arch, name)
