"""The models' and the reference kernels' numerics where the other tests leave a path or a
value unexercised: a chunked (training) forward over a slot that already holds state, the
gradients of the chunked gated delta rule under strong decay, the Gated DeltaNet conv in
half precision, the draft's head on a NaN row and with an output multiplier below one, a
draft block shorter than its neighbours in a batch, drafts with attention biases (fused and
not) against z-lab's reference draft, fused biases that stay views of one stacked vector,
and pooled KV caches read through each slot's run of cells by the target and the draft.

Independent references: transformers' model classes and z-lab's `dflash` package on the same
tiny checkpoints where they exist, else the arithmetic written out in the test.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target, write_safetensors
from reference_engine.checkpoint.synthetic import make_tiny_draft, random_weights
from reference_engine.config import DraftConfig
from reference_engine.kernels.reference import gated_delta_chunked, gated_delta_recurrent, l2_norm
from reference_engine.models import draft_expected_shapes, fuse_projections
from reference_engine.models.dflash import DraftState
from reference_engine.runtime.decode import new_state

F64 = torch.float64
BLOCK = 8


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    scale = max(1.0, reference.abs().max().item())
    return (ours.double() - reference.double()).abs().max().item() / scale


# ----------------------------------------------------------------------------- chunked forward
@torch.inference_mode()
def test_a_chunked_forward_continues_from_the_slots_state_and_leaves_its_final_state(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    """A chunked forward (the training path of the Gated DeltaNet layers) over a slot that
    already holds a prompt's state starts from that slot's recurrent state and writes its
    final state back there: its logits, the slot's recurrent and conv states after it, and
    the next decode step equal those of the same tokens run unchunked; another slot's state
    stays as it was."""
    model = load_target(tiny_checkpoint("qwen3_5", layers=4, hidden=64), dtype=F64)
    layers = model.config.linear_layers
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 21), generator=gen)
    other = torch.randint(0, model.config.vocab_size, (1, 5), generator=gen)
    slot = torch.tensor([1])

    def run(chunked: bool) -> list[torch.Tensor]:
        state = new_state(model, 32, num_slots=3)
        model(other, torch.arange(5)[None], torch.tensor([2]), state, 5)
        model(ids[:, :9], torch.arange(9)[None], slot, state, 9)
        untouched = [state.recurrent[i][2].clone() for i in layers]
        out = model(ids[:, 9:20], torch.arange(9, 20)[None], slot, state, 20, chunked=chunked)
        step = model(ids[:, 20:], torch.tensor([[20]]), slot, state, 21)
        assert all(torch.equal(state.recurrent[i][2], kept) for i, kept in zip(layers, untouched))
        recurrent = [state.recurrent[i][1] for i in layers]
        conv = [state.conv[i][1] for i in layers]
        return [out.logits, *recurrent, *conv, step.logits]

    for got, want in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


def test_the_chunked_rules_gradients_stay_finite_and_the_recurrences_under_strong_decay() -> None:
    """With log decays whose sums over a chunk pass exp's range (float64's 709 here; a
    float32 model passes its 88 within a few tokens of -15, a decay a tiny Qwen3.5 reaches),
    the chunked gated delta rule's outputs and gradients are finite and equal the per-token
    recurrence's: the masked (future) pairs of a chunk carry no gradient."""
    gen = torch.Generator().manual_seed(0)
    batch, T, heads, k_dim, v_dim = 1, 48, 2, 8, 4

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    inputs = [
        l2_norm(randn(batch, T, heads, k_dim)) * k_dim**-0.5,
        l2_norm(randn(batch, T, heads, k_dim)),
        randn(batch, T, heads, v_dim),
        -40 * torch.rand(batch, T, heads, generator=gen, dtype=F64),
        torch.rand(batch, T, heads, generator=gen, dtype=F64),
        randn(batch, heads, k_dim, v_dim),
    ]
    inputs = [x.requires_grad_() for x in inputs]
    weights = randn(batch, T, heads, v_dim)
    grads = []
    for run in (gated_delta_recurrent, lambda *a: gated_delta_chunked(*a, chunk=T)):
        out, final = run(*inputs)
        assert torch.isfinite(out).all() and torch.isfinite(final).all()
        grads.append(torch.autograd.grad((out * weights).sum() + final.sum(), inputs))
    for got, want in zip(grads[1], grads[0]):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_conv_casts_its_output_to_the_model_dtype_before_the_silu(
    dtype: torch.dtype,
) -> None:
    """The Gated DeltaNet's causal conv in half precision, as transformers' Qwen3.5 runs it:
    the depthwise conv1d's output in the model dtype (the exact tap sum cast once), then
    SiLU of that cast value, bit for bit. The inputs are multiples of 1/16 and 1/8,
    so every tap sum is exact in float32 and no summation order can change a bit."""
    import torch.nn.functional as F

    from reference_engine.kernels.reference import causal_conv_step

    gen = torch.Generator().manual_seed(0)
    batch, channels, T, kernel = 2, 64, 9, 4
    x = (torch.randint(-64, 65, (batch, T, channels), generator=gen) / 16).to(dtype)
    weight = (torch.randint(-16, 17, (channels, 1, kernel), generator=gen) / 8).to(dtype)
    states = (torch.randint(-64, 65, (3, channels, kernel - 1), generator=gen) / 16).to(dtype)
    slots = torch.tensor([2, 0])
    full = torch.cat([states[slots], x.transpose(1, 2)], -1)
    want = F.silu(F.conv1d(full, weight, groups=channels))
    got = causal_conv_step(x, states.clone(), slots, weight)
    assert got.dtype == dtype
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------- the draft's head
@pytest.fixture(scope="module")
def qwen3_pair(tiny_pair: Callable[..., tuple[Path, Path]]) -> tuple[Path, Path]:
    return tiny_pair("qwen3", block_size=BLOCK)


def edited_draft(draft_dir: Path, out: Path, **changes) -> Path:
    """A copy of a draft checkpoint with `changes` set in its config.json."""
    out.mkdir()
    for f in draft_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    raw = json.loads((out / "config.json").read_text())
    raw.update(changes)
    (out / "config.json").write_text(json.dumps(raw))
    return out


@torch.inference_mode()
def test_a_slot_whose_logits_hold_a_nan_proposes_the_vocab_size(qwen3_pair) -> None:
    """The draft's greedy proposals follow the engine's greedy rule: a slot whose logits
    hold a NaN proposes `vocab` (the id the engine reads as a numerical failure), the other
    slots their argmax."""
    target_dir, draft_dir = qwen3_pair
    target = load_target(target_dir, dtype=F64)
    draft = load_draft(draft_dir, target)
    hidden = torch.randn(2, BLOCK, 64, generator=torch.Generator().manual_seed(0), dtype=F64)
    hidden[1, 3, 5] = float("nan")
    logits, tokens = draft.proposals(hidden, target.lm_head_weight)
    vocab = target.config.vocab_size
    assert logits[1, 2].isnan().all()
    assert tokens[1, 2].item() == vocab
    keep = torch.ones_like(tokens, dtype=torch.bool)
    keep[1, 2] = False
    assert torch.equal(tokens[keep], logits.argmax(-1)[keep])
    assert (tokens[keep] < vocab).all()


@torch.inference_mode()
def test_draft_logits_follow_an_output_multiplier_below_one_as_zlabs(qwen3_pair, tmp_path: Path) -> None:
    """An `output_multiplier` below one scales the draft's logits as z-lab's `compute_logits`
    does (a multiplier is a multiplier, whichever side of one)."""
    dflash_model = pytest.importorskip("dflash.model", reason="z-lab's dflash package is not installed")
    target_dir, draft_dir = qwen3_pair
    target = load_target(target_dir, dtype=F64)
    edited = edited_draft(draft_dir, tmp_path / "draft", output_multiplier=0.25)
    draft = load_draft(edited, target)
    reference = dflash_model.DFlashDraftModel.from_pretrained(edited, dtype=F64).eval()
    hidden = torch.randn(2, BLOCK - 1, 64, generator=torch.Generator().manual_seed(1), dtype=F64)
    head = torch.nn.Linear(64, target.config.vocab_size, bias=False).to(F64)
    head.weight.copy_(target.lm_head_weight)
    want = reference.compute_logits(hidden, head)
    torch.testing.assert_close(draft.logits(hidden, target.lm_head_weight), want, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- ragged blocks
@torch.inference_mode()
def test_a_shorter_block_in_a_batch_equals_that_block_run_alone(qwen3_pair) -> None:
    """A row whose block is shorter than the batch's (`valid_len`) gets, at its real
    positions, the hidden states of its block run alone at its own length: the
    bidirectional block attention stops at the row's last real token, not at the batch's."""
    target_dir, draft_dir = qwen3_pair
    target = load_target(target_dir, dtype=F64)
    draft = load_draft(draft_dir, target)
    context, short = 11, 5
    gen = torch.Generator().manual_seed(2)
    features = torch.randn(2, context, draft.config.num_features * 64, generator=gen, dtype=F64)
    embeds = torch.randn(2, BLOCK, 64, generator=gen, dtype=F64)
    slots = torch.tensor([1, 0])
    state = DraftState(draft.config, 2, context + BLOCK, F64)
    draft.append_context(features, torch.arange(context).expand(2, -1), slots, state)
    positions = torch.arange(context, context + BLOCK).expand(2, -1)
    batched = draft(embeds, positions, slots, state, context + BLOCK, valid_len=torch.tensor([BLOCK, short]))

    alone_state = DraftState(draft.config, 1, context + BLOCK, F64)
    one = torch.tensor([0])
    draft.append_context(features[1:], torch.arange(context)[None], one, alone_state)
    alone = draft(embeds[1:, :short], positions[1:, :short], one, alone_state, context + short)
    torch.testing.assert_close(batched[1, :short], alone[0], rtol=0, atol=1e-10)
    full_state = DraftState(draft.config, 1, context + BLOCK, F64)
    draft.append_context(features[:1], torch.arange(context)[None], one, full_state)
    full = draft(embeds[:1], positions[:1], one, full_state, context + BLOCK)
    torch.testing.assert_close(batched[0], full[0], rtol=0, atol=1e-10)


# ----------------------------------------------------------------------------- biased drafts
def biased_draft(target_dir: Path, out: Path) -> Path:
    """A tiny DFlash draft with `attention_bias` true: biases on q, k, v and o, drawn with
    the other weights."""
    make_tiny_draft(out, target_dir, block_size=BLOCK, layers=2, seed=4)
    raw = json.loads((out / "config.json").read_text())
    raw["attention_bias"] = True
    (out / "config.json").write_text(json.dumps(raw))
    config = DraftConfig.from_hf(raw)
    tensors = random_weights(draft_expected_shapes(config), seed=4, norm_offset=False)
    assert any(name.endswith("k_proj.bias") for name in tensors)
    write_safetensors(out, tensors)
    return out


@torch.inference_mode()
def test_a_biased_draft_fused_or_not_equals_zlabs_reference_draft(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """A draft with attention biases gives z-lab's block hidden states, unfused and with its
    projections fused (where the context rows take the key and value projections alone, so
    their biases are the stacked bias past the query's)."""
    dflash_model = pytest.importorskip("dflash.model", reason="z-lab's dflash package is not installed")
    target_dir = tiny_checkpoint("qwen3", layers=4, hidden=64)
    draft_dir = biased_draft(target_dir, tmp_path / "draft")
    target = load_target(target_dir, dtype=F64)
    draft = load_draft(draft_dir, target)
    fused = copy.deepcopy(draft)
    fuse_projections(fused)
    assert fused.layers[0].self_attn.fused.live() and fused.layers[0].self_attn.fused.bias is not None
    reference = dflash_model.DFlashDraftModel.from_pretrained(draft_dir, dtype=F64).eval()
    context = 13
    gen = torch.Generator().manual_seed(5)
    features = torch.randn(1, context, draft.config.num_features * 64, generator=gen, dtype=F64)
    embeds = torch.randn(1, BLOCK, 64, generator=gen, dtype=F64)
    theirs = reference(
        position_ids=torch.arange(context + BLOCK)[None], noise_embedding=embeds, target_hidden=features
    )
    slot = torch.tensor([0])
    for model in (draft, fused):
        state = DraftState(model.config, 1, context + BLOCK, F64)
        model.append_context(features, torch.arange(context)[None], slot, state)
        ours = model(embeds, torch.arange(context, context + BLOCK)[None], slot, state, context + BLOCK)
        assert relative_error(ours, theirs) < 1e-5


@torch.inference_mode()
def test_fused_biases_are_views_that_follow_in_place_updates(tiny_checkpoint: Callable[..., Path]) -> None:
    """After fusing, each linear's bias is a view of its rows of the stacked bias, as its
    weight is of the stacked weight: loading new values in place (load_state_dict) changes
    what the fused product adds, and the fused model then equals an unfused model of those
    values."""
    path = tiny_checkpoint("llama", layers=2, hidden=64, bias=True)
    model = load_target(path, dtype=F64)
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(7)
    for name, p in other.named_parameters():
        if name.endswith("bias"):
            p.add_(torch.randn(p.shape, generator=gen, dtype=F64))
    fused = copy.deepcopy(model)
    fuse_projections(fused)
    attn = fused.model.layers[0].self_attn
    stacked = attn.fused.bias
    assert attn.k_proj.bias.data_ptr() == stacked[attn.q_proj.out_features :].data_ptr()
    fused.load_state_dict(other.state_dict())
    assert attn.fused.live()
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=gen)
    logits = []
    for m in (other, fused):
        logits.append(m(ids, torch.arange(9)[None], torch.tensor([0]), new_state(m, 9), 9).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-10)


# ----------------------------------------------------------------------------- pooled caches
@torch.inference_mode()
def test_pooled_caches_give_each_slot_its_own_run_of_cells(
    tiny_pair: Callable[..., tuple[Path, Path]],
) -> None:
    """With a pooled KV cache, a target's and a draft's attention read and write each slot's
    rows through the slot's run of cells (not the slot's number): two requests placed in
    runs that their slot numbers would make overlap give the logits and block hidden states
    of unpooled caches, and their keys land in their own runs."""
    from reference_engine.runtime.kv_pool import PoolLayout
    from reference_engine.runtime.state import TargetState

    target_dir, draft_dir = tiny_pair("qwen3", block_size=BLOCK)
    target = load_target(target_dir, dtype=F64)
    draft = load_draft(draft_dir, target)
    room, prompt = 24, 10
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, target.config.vocab_size, (2, prompt + 1), generator=gen)
    embeds = torch.randn(2, BLOCK, 64, generator=gen, dtype=F64)
    slots = torch.tensor([0, 1])
    positions = torch.arange(prompt).expand(2, -1)
    block_positions = torch.arange(prompt, prompt + BLOCK).expand(2, -1)

    def run(pool: PoolLayout | None) -> tuple[torch.Tensor, ...]:
        state = TargetState(target.config, 2, room, F64, pool=pool)
        if pool is not None:  # slot 0 on cells 6..8, slot 1 on cells 0..2: rows 0 and 1 would overlap
            state.place(0, 6)
            state.place(1, 0)
        out = target(ids[:, :prompt], positions, slots, state, prompt, draft.config.target_layer_ids)
        step = target(ids[:, prompt:], torch.full((2, 1), prompt), slots, state, prompt + 1)
        dstate = DraftState(draft.config, 2, room, F64, pool=pool, cell_of=state.cell_of)
        draft.append_context(out.features, positions, slots, dstate)
        hidden = draft(embeds, block_positions, slots, dstate, prompt + BLOCK)
        rows = state.cache_rows(slots)
        return (
            out.logits,
            step.logits,
            hidden,
            state.k_cache[0][rows, :prompt],
            dstate.k_cache[0][rows, :prompt],
        )

    plain = run(None)
    pooled = run(PoolLayout(cells=12, cell_tokens=4, room=room))
    for got, want in zip(pooled, plain):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
