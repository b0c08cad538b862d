"""The DFlash2 draft (models/dflash2.py): its config and checkpoint layout, and the batched
convolution, selector edges, top-K and walk against naive float64 loops written from the
specification (docs/dflash2.md), one token, tap, channel and candidate at a time."""

from __future__ import annotations

import json

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.checkpoint.__main__ import main as checkpoint_main
from reference_engine.config import DraftConfig
from reference_engine.errors import ConfigError
from reference_engine.models.dflash2 import (
    CandidateSelector,
    DFlash2Draft,
    grouped_conv,
    top_candidates,
    walk_greedy,
)
from reference_engine.runtime.walk import sample_walk

F64 = torch.float64


def naive_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """out[b, i, c] = sum_t (base[t, c] + delta[b, i, t, c // gs]) * x[b, i - t, c], zero for
    i - t < 0 (before the block)."""
    batch, length, hidden = x.shape
    taps, groups = delta.shape[-2:]
    size = hidden // groups
    out = torch.zeros_like(x)
    for b in range(batch):
        for i in range(length):
            for c in range(hidden):
                total = 0.0
                for t in range(taps):
                    if i - t >= 0:
                        total += (base[t, c] + delta[b, i, t, c // size]) * x[b, i - t, c]
                out[b, i, c] = total
    return out


def naive_edges(selector: CandidateSelector, hidden, candidates, unary, anchors) -> torch.Tensor:
    """edge[b, j, p, c] = sum_r P[pred_p][r] * (W h_j)[r] * S[cand_c][r] + unary[c]."""
    batch, N, K = candidates.shape
    P, S = selector.predecessor_codebook, selector.successor_codebook
    W = selector.hidden_projection.weight
    out = torch.zeros(batch, N, K, K, dtype=F64)
    for b in range(batch):
        for j in range(N):
            projected = [sum(W[r, d] * hidden[b, j, d] for d in range(W.shape[1])) for r in range(W.shape[0])]
            for p in range(K):
                pred = int(anchors[b]) if j == 0 else int(candidates[b, j - 1, p])
                for c in range(K):
                    succ = int(candidates[b, j, c])
                    bigram = sum(P[pred, r] * projected[r] * S[succ, r] for r in range(W.shape[0]))
                    out[b, j, p, c] = bigram + unary[b, j, c]
    return out


def naive_walk(edges: torch.Tensor, candidates: torch.Tensor) -> list[list[int]]:
    """From the anchor, slot by slot: the largest edge from the previous choice, the lowest
    candidate index (candidates ascend by id: the lowest token id) among exact ties."""
    paths = []
    for b in range(edges.shape[0]):
        previous, path = 0, []
        for j in range(edges.shape[1]):
            row = [float(v) for v in edges[b, j, previous]]
            previous = row.index(max(row))
            path.append(int(candidates[b, j, previous]))
        paths.append(path)
    return paths


def sorted_candidates(rows: int, vocab: int, k: int) -> torch.Tensor:
    """k distinct random ids per row, ascending (the selector's candidate order)."""
    return torch.stack([torch.randperm(vocab)[:k].sort().values for _ in range(rows)])


def selector(vocab: int = 40, hidden: int = 12, rank: int = 6, top_k: int = 5, seed: int = 0):
    torch.manual_seed(seed)
    s = CandidateSelector(hidden, vocab, rank, top_k).to(F64)
    with torch.no_grad():
        for p in s.parameters():
            p.normal_()
    return s


@pytest.mark.parametrize("taps", [1, 2, 3])
@pytest.mark.parametrize("length", [1, 5, 8])
def test_grouped_conv_equals_the_naive_loop_and_taps_stop_at_the_block_start(taps: int, length: int) -> None:
    torch.manual_seed(taps * 10 + length)
    x = torch.randn(2, length, 8, dtype=F64)
    base = torch.randn(taps, 8, dtype=F64)
    delta = torch.randn(2, length, taps, 4, dtype=F64)  # groups of 2 channels
    torch.testing.assert_close(grouped_conv(x, base, delta), naive_conv(x, base, delta), rtol=0, atol=1e-12)


def test_grouped_conv_of_one_row_is_the_same_alone_and_beside_others() -> None:
    torch.manual_seed(1)
    x, base, delta = torch.randn(3, 8, 16, dtype=F64), torch.randn(2, 16, dtype=F64), torch.randn(3, 8, 2, 4)
    delta = delta.to(F64)
    alone = grouped_conv(x[1:2], base, delta[1:2])
    assert torch.equal(grouped_conv(x, base, delta)[1:2], alone)


def test_selector_edges_equal_the_naive_bigram_scores() -> None:
    s = selector()
    torch.manual_seed(2)
    batch, N, K = 2, 4, s.top_k
    candidates = torch.stack([torch.randperm(40)[:K].sort().values for _ in range(batch * N)]).view(
        batch, N, K
    )
    unary = torch.randn(batch, N, K, dtype=F64)
    hidden = torch.randn(batch, N, 12, dtype=F64)
    anchors = torch.tensor([3, 17])
    got = s.edges(hidden, candidates, unary, anchors)
    torch.testing.assert_close(got, naive_edges(s, hidden, candidates, unary, anchors), rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_edges_are_scored_in_float32(dtype: torch.dtype) -> None:
    """A half-precision selector scores its edges in float32 (its docstring's "float32 or
    wider"), so near ties are not decided by bfloat16's 8 bits of mantissa."""
    s = selector().to(dtype)
    hidden = torch.randn(2, 3, 12).to(dtype)
    candidates = sorted_candidates(2 * 3, 40, 5).view(2, 3, 5)
    unary = torch.randn(2, 3, 5).to(dtype)
    edges = s.edges(hidden, candidates, unary, torch.tensor([1, 2]))
    assert edges.dtype == torch.float32


def test_the_greedy_walk_follows_the_best_edge_from_the_anchor_and_breaks_ties_to_the_lowest_id() -> None:
    torch.manual_seed(3)
    batch, N, K = 3, 5, 4
    candidates = torch.stack([torch.randperm(50)[:K].sort().values for _ in range(batch * N)]).view(
        batch, N, K
    )
    edges = torch.randn(batch, N, K, K, dtype=F64)
    edges[0, 2] = 1.0  # every edge of a slot tied: the lowest id wins
    edges[1, 0, 0, 1] = edges[1, 0, 0, 3] = 9.0  # an exact tie between two candidates
    got = walk_greedy(edges, candidates)
    assert got.tolist() == naive_walk(edges, candidates)
    assert got[0, 2] == candidates[0, 2, 0]
    assert got[1, 0] == candidates[1, 0, 1]


def test_the_greedy_walk_gives_a_candidate_at_every_slot_whatever_its_edges_hold() -> None:
    """A draft whose scores are not finite (all NaN, all -inf, NaN beside numbers) still
    proposes one of each slot's candidates: a proposal only ever costs acceptance."""
    torch.manual_seed(4)
    batch, N, K = 2, 4, 5
    candidates = torch.randint(0, 50, (batch, N, K))
    edges = torch.randn(batch, N, K, K, dtype=F64)
    edges[0, 1] = float("nan")
    edges[1, 2] = float("-inf")
    edges[0, 3, :, 2] = float("nan")
    got = walk_greedy(edges, candidates)
    assert got.shape == (batch, N)
    for b in range(batch):
        for j in range(N):
            assert got[b, j] in candidates[b, j].tolist(), (b, j)


def test_top_candidates_keep_the_k_best_with_the_lowest_ids_among_ties() -> None:
    logits = torch.tensor([[0.5, 2.0, 1.0, 1.0, 3.0, 1.0, 1.0, -1.0]], dtype=F64)
    ids, values = top_candidates(logits, 4)
    assert ids.tolist() == [[1, 2, 3, 4]]  # 3.0, 2.0, then the two lowest ids of the four 1.0s
    assert values.tolist() == [[2.0, 1.0, 1.0, 3.0]]
    torch.manual_seed(4)
    logits = torch.randn(6, 100, dtype=F64)
    ids, _ = top_candidates(logits, 7)
    assert ids.tolist() == logits.topk(7).indices.sort().values.tolist()


def test_the_sampled_walk_draws_from_the_edge_row_of_the_candidate_it_drew() -> None:
    """q at slot j is softmax(edges[j, previous] / T) on slot j's candidates, zero elsewhere,
    with `previous` the candidate slot j - 1 drew."""
    torch.manual_seed(5)
    n, K, vocab = 4, 3, 20
    candidates = sorted_candidates(n, vocab, K)
    edges = torch.randn(n, K, K, dtype=F64)
    generator = torch.Generator().manual_seed(6)
    tokens, q = sample_walk(candidates, edges, vocab, 0.7, 0, 1.0, generator)
    previous = 0
    for j in range(n):
        expected = torch.zeros(vocab, dtype=F64)
        expected[candidates[j]] = torch.softmax(edges[j, previous] / 0.7, dim=-1)
        torch.testing.assert_close(q[j], expected, rtol=0, atol=1e-12)
        previous = candidates[j].tolist().index(int(tokens[j]))


# ----------------------------------------------------------------------------- config, checkpoint
def published_config() -> dict:
    """z-lab/Qwen3.8-27B-DFlash2's config.json fields that matter here (docs/dflash2.md)."""
    return {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 5,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 248320,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
        "layer_types": ["sliding_attention"] * 5,
        "sliding_window": 2048,
        "is_causal": False,
        "num_target_layers": 64,
        "dflash_config": {
            "block_size": 8,
            "conv_group_size": 16,
            "conv_kernel_size": 2,
            "mask_token_id": 248070,
            "selector_rank": 256,
            "selector_top_k": 16,
            "target_layer_ids": [5, 19, 33, 47, 61],
        },
    }


def test_the_published_config_parses_with_non_causal_sliding_layers_and_the_real_tensor_shapes() -> None:
    from reference_engine.models import draft_expected_shapes

    config = DraftConfig.from_hf(published_config())
    assert config.is_dflash2 and config.block_size == 8 and config.sliding_window == 2048
    assert (config.conv_kernel_size, config.conv_group_size) == (2, 16)
    assert (config.selector_rank, config.selector_top_k) == (256, 16)
    assert not any(config.layer_causal(i) for i in range(5))
    shapes = draft_expected_shapes(config)
    assert shapes["layers.0.attention_conv.base_kernel"] == (2, 2, 5120)
    assert shapes["layers.4.mlp_conv.kernel_projection.weight"] == (1280, 5120)
    assert shapes["candidate_selector.hidden_projection.weight"] == (256, 5120)
    assert shapes["candidate_selector.predecessor_codebook"] == (248320, 256)
    assert shapes["candidate_selector.successor_codebook"] == (248320, 256)
    assert len(shapes) == 81  # the checkpoint's tensor count


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"conv_group_size": 24}, "conv_group_size 24 does not divide hidden_size 5120"),
        ({"selector_top_k": 0}, "'selector_top_k' must be a positive integer, got 0"),
        ({"selector_rank": None}, "required field 'selector_rank' is missing"),
    ],
)
def test_a_bad_dflash2_field_is_refused_by_name(change: dict, message: str) -> None:
    raw = published_config()
    raw["dflash_config"] |= change
    with pytest.raises(ConfigError, match=message):
        DraftConfig.from_hf(raw)


def test_dflash_config_fields_come_before_the_top_levels() -> None:
    """A field given in both places is read from `dflash_config` (as the published
    implementations read it); one given only at the top level is read there."""
    raw = published_config()
    raw["selector_top_k"] = 8  # dflash_config says 16
    top_only = published_config()
    top_only["selector_rank"] = top_only["dflash_config"].pop("selector_rank")
    assert DraftConfig.from_hf(raw).selector_top_k == 16
    assert DraftConfig.from_hf(top_only).selector_rank == 256


def test_make_tiny_writes_the_published_layout_and_the_loader_reads_it_back(
    tmp_path, qwen3_checkpoint
) -> None:
    out = tmp_path / "dflash2"
    args = ["make-tiny", "--arch", "dflash2", "--target", str(qwen3_checkpoint), "--out", str(out)]
    assert checkpoint_main(args) == 0
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"] and raw["is_causal"] is False
    assert set(raw["layer_types"]) == {"sliding_attention"}
    target = load_target(qwen3_checkpoint, dtype=F64)
    draft = load_draft(out, target)
    assert isinstance(draft, DFlash2Draft) and draft.config.is_dflash2
    assert not draft.layers[0].self_attn.causal and draft.layers[0].self_attn.sliding_window == 64


def test_is_causal_reaches_every_draft_layers_block_attention(tiny_pair, tmp_path) -> None:
    """The same weights loaded with `is_causal` true and false: every layer's block attention
    attends as the checkpoint says (a layer that ignores it attends both ways in both)."""
    import json
    import shutil

    from reference_engine.checkpoint import load_draft, load_target

    target_dir, draft_dir = tiny_pair("qwen3", block_size=8, draft_arch="dflash2")
    target = load_target(target_dir, dtype=F64)
    for causal in (True, False):
        folder = tmp_path / f"causal-{causal}"
        shutil.copytree(draft_dir, folder)
        raw = json.loads((folder / "config.json").read_text())
        raw["is_causal"] = causal
        (folder / "config.json").write_text(json.dumps(raw))
        draft = load_draft(folder, target)
        layers = draft.config.num_hidden_layers
        assert [draft.config.layer_causal(i) for i in range(layers)] == [causal] * layers
        attention = [m for m in draft.modules() if hasattr(m, "causal")]
        assert len(attention) == layers and all(m.causal is causal for m in attention), causal
