"""The model forwards' own arithmetic, beside the transformers parity set and the gates:

- the target features a draft reads: the layers `capture_layers` names, in the order it lists
  them with repeats kept, each as transformers' `hidden_states` gives that layer's output (the
  last layer's after the final norm, or its raw output with `raw_last_layer`);
- a DFlash2 draft's block forward against a layer written out from the specification
  (docs/dflash2.md): each sublayer between its two convolutions, both sides' dynamic weights
  from the sublayer's normed input viewed as [2, taps, groups], tap t of token i reading token
  i - t with token i's weights, the residual adds of Qwen3;
- a DFlash2 draft's proposals against the selector written out: slot j's unary scores are its
  own draft logits, its candidates their K best, its edges read slot j's hidden state and the
  candidates of slot j - 1 (the anchor for slot 1), the greedy walk from the anchor;
- the expert census of a mixture-of-experts target, counted under each step's tokens per row.
- a padded batch's `last_only` logits: each row's last real token's, as the row alone gives them.
"""

from __future__ import annotations

import random

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.models.dflash import DraftState
from reference_engine.models.dflash2 import DFlash2Draft
from reference_engine.models.layers import ForwardContext
from reference_engine.models.moe import ExpertCensus, count_experts
from reference_engine.runtime.decode import new_state

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

F64 = torch.float64
BLOCK = 8


def run_target(model, ids: list[int], **options):
    state = new_state(model, len(ids))
    n = len(ids)
    return model(torch.tensor([ids]), torch.arange(n)[None], torch.tensor([0]), state, kv_len=n, **options)


# ------------------------------------------------------------------ target features
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_captured_features_are_transformers_hidden_states_in_the_listed_order(
    arch: str, tiny_checkpoint
) -> None:
    path = tiny_checkpoint(arch)
    ours = load_target(path, dtype=F64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F64, attn_implementation="eager")
    ids = random.Random(3).sample(range(ours.config.vocab_size), 11)
    with torch.inference_mode():
        states = hf(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    hidden = ours.config.hidden_size
    last = ours.config.num_hidden_layers - 1
    layers = (last, 0, 2, 0)  # not ascending, the last layer first, one layer twice
    with torch.inference_mode():
        got = run_target(ours, ids, capture_layers=layers).features[0]
        raw = run_target(ours, ids, capture_layers=(last,), raw_last_layer=True).features[0]
    assert got.shape == (len(ids), len(layers) * hidden)
    for k, layer in enumerate(layers):
        # hidden_states[i + 1] is layer i's output; the last one is after the final norm
        torch.testing.assert_close(
            got[:, k * hidden : (k + 1) * hidden],
            states[layer + 1][0],
            rtol=0,
            atol=1e-5,
            msg=f"layer {layer}",
        )
    normed = ours.model.norm(raw)
    torch.testing.assert_close(normed, states[last + 1][0], rtol=0, atol=1e-5)
    assert (raw - normed).abs().max() > 1e-2  # the raw output is not the normed one


# ------------------------------------------------------------------ DFlash2 draft, written out
def spec_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """out[i, c] = sum_t (base[t, c] + delta[i, t, c // group]) * x[i - t, c], x before the
    block's first token 0. x [B, hidden], base [taps, hidden], delta [B, taps, groups]."""
    length, hidden = x.shape
    taps, groups = delta.shape[-2:]
    group_of = torch.arange(hidden) // (hidden // groups)
    out = torch.zeros_like(x)
    for i in range(length):
        for t in range(taps):
            if i - t >= 0:
                out[i] += (base[t] + delta[i, t, group_of]) * x[i - t]
    return out


def spec_layer(layer, x: torch.Tensor, ctx: ForwardContext, index: int) -> torch.Tensor:
    """One DFlash2 layer over one row's block x [B, hidden], from docs/dflash2.md; attention
    and MLP are the layer's own modules (their arithmetic is DFlash's)."""

    def sides(conv, normed: torch.Tensor) -> torch.Tensor:  # [B, 2, taps, groups]
        return (normed @ conv.kernel_projection.weight.T).view(len(normed), 2, conv.taps, conv.groups)

    normed = layer.input_layernorm(x)
    delta = sides(layer.attention_conv, normed)
    base = layer.attention_conv.base_kernel
    attended = layer.self_attn(spec_conv(normed, base[0], delta[:, 0])[None], ctx, index)[0]
    h = x + spec_conv(attended, base[1], delta[:, 1])
    normed = layer.post_attention_layernorm(h)
    delta = sides(layer.mlp_conv, normed)
    base = layer.mlp_conv.base_kernel
    out = layer.mlp(spec_conv(normed, base[0], delta[:, 0])[None])[0]
    return h + spec_conv(out, base[1], delta[:, 1])


@pytest.fixture(scope="module")
def dflash2_draft(tiny_pair):
    target_dir, draft_dir = tiny_pair("qwen3", block_size=BLOCK, draft_arch="dflash2", draft_seed=3)
    target = load_target(target_dir, dtype=F64)
    draft = load_draft(draft_dir, target)
    assert isinstance(draft, DFlash2Draft)
    with torch.no_grad():  # dynamic and static taps of a trained draft's size, on every side
        gen = torch.Generator().manual_seed(11)
        for layer in draft.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.copy_(torch.randn(conv.base_kernel.shape, generator=gen, dtype=F64) * 0.5)
                weight = conv.kernel_projection.weight
                weight.copy_(torch.randn(weight.shape, generator=gen, dtype=F64) * 0.2)
    return target, draft


def context_and_block(target, draft, context: int = 13):
    config = draft.config
    gen = torch.Generator().manual_seed(5)
    state = DraftState(config, 1, context + BLOCK, F64)
    features = torch.randn(1, context, config.num_features * config.hidden_size, generator=gen, dtype=F64)
    slots = torch.tensor([0])
    draft.append_context(features, torch.arange(context)[None], slots, state)
    ids = torch.randint(0, config.vocab_size, (1, BLOCK), generator=gen)
    embeds = target.embed(ids) * config.input_embedding_scale
    positions = torch.arange(context, context + BLOCK)[None]
    return state, slots, embeds, positions, ids[:, 0]


@torch.inference_mode()
def test_a_dflash2_block_forward_equals_its_layers_written_out_from_the_specification(dflash2_draft) -> None:
    target, draft = dflash2_draft
    state, slots, embeds, positions, _ = context_and_block(target, draft)
    kv_len = int(positions[0, -1]) + 1
    got = draft(embeds, positions, slots, state, kv_len)[0]
    ctx = ForwardContext(state, slots, positions, kv_len, draft.rotary, F64)
    x = embeds[0]
    for index, layer in enumerate(draft.layers):
        x = spec_layer(layer, x, ctx, index)
    torch.testing.assert_close(got, draft.norm(x), rtol=0, atol=1e-10)


@torch.inference_mode()
def test_dflash2_proposals_equal_the_selector_written_out_from_the_specification(dflash2_draft) -> None:
    target, draft = dflash2_draft
    state, slots, embeds, positions, anchors = context_and_block(target, draft)
    hidden = draft(embeds, positions, slots, state, int(positions[0, -1]) + 1)
    K = draft.config.selector_top_k
    selector = draft.candidate_selector
    P, S = selector.predecessor_codebook, selector.successor_codebook
    for width in (BLOCK - 1, 3):
        logits, tokens, candidates, edges = draft.proposals(
            hidden, target.lm_head_weight, anchors=anchors, width=width
        )
        previous, expected, before = int(anchors[0]), [], [int(anchors[0])] * K
        for j in range(1, width + 1):
            unary = draft.logits(hidden[0, j], target.lm_head_weight)  # slot j's own logits
            torch.testing.assert_close(logits[0, j - 1], unary, rtol=0, atol=1e-12)
            best = sorted(range(len(unary)), key=lambda v: (-float(unary[v]), v))[:K]
            ids = sorted(best)
            assert candidates[0, j - 1].tolist() == ids, j
            projected = selector.hidden_projection.weight @ hidden[0, j]
            spec = torch.tensor(
                [[float((P[p] * projected * S[c]).sum() + unary[c]) for c in ids] for p in before],
                dtype=F64,
            )
            torch.testing.assert_close(edges[0, j - 1], spec, rtol=0, atol=1e-10)
            # the walk: the best edge out of the candidate the slot before took (lowest on a tie)
            row = spec[before.index(previous)]
            previous = ids[int(torch.nonzero(row == row.max())[0])]
            expected.append(previous)
            before = ids
        assert tokens[0].tolist() == expected, width


# ------------------------------------------------------------------ MoE expert census
@torch.inference_mode()
def test_the_expert_census_counts_a_step_under_its_tokens_per_row(tiny_checkpoint) -> None:
    model = load_target(tiny_checkpoint("qwen3_moe"), dtype=F64)
    census = ExpertCensus("cpu")
    count_experts(model, census)
    ids = [5, 9, 40, 77, 3]
    state = new_state(model, 16, num_slots=2)
    model(torch.tensor([ids, ids[::-1]]), torch.arange(5).expand(2, 5), torch.tensor([0, 1]), state, kv_len=5)
    layers = len(model.config.moe_layers)
    assert census.mean_distinct(2) is None  # no step ran two tokens a row
    distinct = census.mean_distinct(5)
    assert distinct is not None and 1 <= distinct <= model.config.num_experts
    counts = census.counts[census.rows[5]].tolist()
    assert counts[1] == layers  # one call per MoE layer
    count_experts(model, None)


# ------------------------------------------------------------------ padded rows
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
@torch.inference_mode()
def test_last_only_logits_of_padded_rows_are_each_rows_last_real_token(arch: str, tiny_checkpoint) -> None:
    """A batch of prompts padded at their ends (`valid_len`), `last_only`: each row's logits
    are those of its last real token, as the row run alone gives them."""
    model = load_target(tiny_checkpoint(arch), dtype=F64)
    rows = [[5, 9, 40, 77, 3, 12], [400, 3, 21], [8, 8, 250, 1]]
    width = max(map(len, rows))
    padded = torch.tensor([ids + [0] * (width - len(ids)) for ids in rows])
    state = new_state(model, width, num_slots=len(rows))
    positions = torch.arange(width).expand(len(rows), width)
    valid = torch.tensor([len(ids) for ids in rows])
    slots = torch.arange(len(rows))
    got = model(padded, positions, slots, state, kv_len=width, last_only=True, valid_len=valid).logits
    assert got.shape[:2] == (len(rows), 1)
    for i, ids in enumerate(rows):
        alone = run_target(model, ids).logits[0, -1]
        torch.testing.assert_close(got[i, 0], alone, rtol=0, atol=1e-10, msg=f"row {i}")
