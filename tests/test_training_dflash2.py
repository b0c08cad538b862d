"""Training a DFlash2 draft (reference_engine/training/selector.py and the recipe's
`--draft-arch dflash2`): the selector loss against a naive loop, its edges against the walk's,
the selector's parameters learning, and the smoke recipe writing a DFlash2 draft that the
engine loads and serves losslessly, alone and from a finished pair (`--from-pair`)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.checkpoint.synthetic import make_tiny_draft
from reference_engine.config import DraftConfig
from reference_engine.errors import CheckpointError
from reference_engine.models.dflash2 import DFlash2Draft
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams
from reference_engine.training.loops import block_hidden, init_weights, optimise, target_views
from reference_engine.training.pair import adopt_pair
from reference_engine.training.recipe import Recipe
from reference_engine.training.selector import selector_loss, teacher_forced_edges

from .test_training import make_wheel_corpus, smoke

RECIPE = dataclasses.replace(Recipe.smoke(0), draft_arch="dflash2")


def smoke_draft(seed: int = 0) -> DFlash2Draft:
    """The smoke recipe's DFlash2 draft in float64, its selector drawn at scale 1."""
    draft = DFlash2Draft(DraftConfig.from_hf(RECIPE.draft_config(RECIPE.vocab_size - 1))).double()
    init_weights(draft, RECIPE.draft_layers, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.candidate_selector.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * p.shape[-1] ** -0.25)
    return draft


def selector_batch(draft: DFlash2Draft, rows: int = 5, seed: int = 1):
    """Random hidden states, logits and lengths; labels half of them a candidate of their
    slot (so that both kinds of slot are there), half outside."""
    cfg = draft.config
    N = cfg.block_size - 1
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, N, cfg.hidden_size, generator=gen, dtype=torch.float64)
    logits = torch.randn(rows, N, cfg.vocab_size, generator=gen, dtype=torch.float64) * 3
    ranked = logits.argsort(-1, descending=True)
    pick = torch.randint(0, cfg.selector_top_k, (rows, N), generator=gen)
    inside = ranked.gather(-1, pick[..., None])[..., 0]
    outside = ranked[..., -1]
    labels = torch.where(torch.rand(rows, N, generator=gen) < 0.6, inside, outside)
    anchors = torch.randint(0, cfg.vocab_size, (rows,), generator=gen)
    lengths = torch.randint(2, cfg.block_size + 1, (rows,), generator=gen)
    return hidden, logits, labels, anchors, lengths


def naive_selector_loss(draft, hidden, logits, labels, anchors, lengths, decay) -> tuple[float, float]:
    """Loops over blocks, slots, candidates and rank, in float64."""
    sel, K = draft.candidate_selector, draft.config.selector_top_k
    W, P, S = (
        t.detach() for t in (sel.hidden_projection.weight, sel.predecessor_codebook, sel.successor_codebook)
    )
    total = weight_sum = 0.0
    counted = found = 0
    for b in range(labels.shape[0]):
        for j in range(int(lengths[b]) - 1):
            counted += 1
            candidates = sorted(logits[b, j].argsort(descending=True)[:K].tolist())
            true = int(labels[b, j])
            if true not in candidates:
                continue
            found += 1
            before = int(anchors[b]) if j == 0 else int(labels[b, j - 1])
            projected = [
                sum(float(W[r, h]) * float(hidden[b, j, h]) for h in range(W.shape[1]))
                for r in range(W.shape[0])
            ]
            scores = [
                sum(float(P[before, r]) * projected[r] * float(S[c, r]) for r in range(W.shape[0]))
                + float(logits[b, j, c])
                for c in candidates
            ]
            top = max(scores)
            nll = top + math.log(sum(math.exp(s - top) for s in scores)) - scores[candidates.index(true)]
            w = math.exp(-j / decay)
            total += w * nll
            weight_sum += w
    return total / weight_sum, found / counted


def test_the_selector_loss_equals_a_naive_float64_loop() -> None:
    draft = smoke_draft()
    batch = selector_batch(draft)
    loss, recall = selector_loss(draft, *batch, RECIPE.position_decay)
    want_loss, want_recall = naive_selector_loss(draft, *batch, RECIPE.position_decay)
    assert 0 < want_recall < 1  # slots of both kinds
    assert abs(loss.item() - want_loss) < 1e-10
    assert abs(recall.item() - want_recall) < 1e-6  # a share of counts, in float32


def test_teacher_forced_edges_are_the_walks_edges_out_of_the_true_token() -> None:
    """Where slot j - 1's true token is its candidate p, the edges training scores are row p
    of the edges the greedy walk reads (`CandidateSelector.edges`), and slot 1's are the
    anchor's."""
    draft = smoke_draft()
    hidden, logits, _, anchors, _ = selector_batch(draft)
    K = draft.config.selector_top_k
    ids = logits.argsort(-1, descending=True)[..., :K].sort(-1).values  # [rows, N, K]
    unary = logits.gather(-1, ids)
    walk = draft.candidate_selector.edges(hidden, ids, unary, anchors)  # [rows, N, K, K]
    pick = torch.randint(0, K, ids.shape[:2], generator=torch.Generator().manual_seed(3))
    chosen = ids.gather(-1, pick[..., None])[..., 0]  # a candidate of each slot
    predecessors = torch.cat([anchors[:, None], chosen[:, :-1]], dim=1)
    forced = teacher_forced_edges(draft.candidate_selector, hidden, ids, unary, predecessors)
    want = torch.cat(
        [walk[:, :1, 0], walk[:, 1:].gather(2, pick[:, :-1, None, None].expand(-1, -1, 1, K))[:, :, 0]], dim=1
    )
    torch.testing.assert_close(forced, want, rtol=0, atol=1e-12)


def test_the_selector_loss_trains_the_selector_and_reaches_the_convolutions() -> None:
    """On a fixed batch whose true tokens are candidates, the selector's parameters alone
    lower the selector loss; the recipe's loss (token + selector) has a gradient for the
    codebooks, the projection and the convolutions' dynamic weights."""
    draft = smoke_draft()
    hidden, logits, labels, anchors, lengths = selector_batch(draft)
    labels = logits.argsort(-1, descending=True)[..., 1]  # every slot's second best
    before = {n: p.detach().clone() for n, p in draft.candidate_selector.named_parameters()}
    draft.requires_grad_(False)
    draft.candidate_selector.requires_grad_(True)

    def loss_at(step: int) -> torch.Tensor:
        return selector_loss(draft, hidden, logits, labels, anchors, lengths, RECIPE.position_decay)[0]

    fit = optimise(draft, 30, 3e-2, loss_at, lambda m: None, "selector")
    assert fit["losses"][-1] < 0.5 * fit["losses"][0]
    for name, p in draft.candidate_selector.named_parameters():
        assert not torch.equal(p, before[name]), name


@pytest.fixture(scope="module")
def dflash2_run(tmp_path_factory) -> tuple[Path, str, tuple[Path, Path]]:
    """The smoke recipe with --draft-arch dflash2 on test_training's synthetic wheel corpus
    (nothing downloaded): its output folder, its stdout, and the corpus (lock, cache)."""
    folder = tmp_path_factory.mktemp("dflash2")
    lock, _ = make_wheel_corpus(folder / "corpus")
    corpus = (lock, folder / "corpus" / "cache")
    run = smoke(folder / "out", *corpus, "--draft-arch", "dflash2")
    assert run.returncode == 0, run.stderr
    return folder / "out", run.stdout, corpus


def test_the_smoke_recipe_writes_a_dflash2_draft_the_engine_loads(dflash2_run) -> None:
    out, stdout, _ = dflash2_run
    assert "draft-dflash2 step 4/4" in stdout
    assert not (out / "draft").exists() and not (out / "MODEL_CARD.md").exists()
    results = json.loads((out / "training-dflash2.json").read_text())
    assert results["recipe"]["draft_arch"] == "dflash2"
    assert set(results["acceptance"]) == {"2", "4"} and "acceptance_dflash" not in results
    assert all(row["mismatched_requests"] == 0 for row in results["acceptance"].values())
    summary = results["draft"]
    for name in ("curve", "token_loss_curve", "selector_loss_curve", "candidate_recall_curve"):
        assert len(summary[name]) == 4, name
    assert all(math.isfinite(loss) for _, loss in summary["selector_loss_curve"])
    target = load_target(out / "target")
    draft = load_draft(out / "draft-dflash2", target)
    assert isinstance(draft, DFlash2Draft) and draft.config.is_dflash2
    assert (draft.config.block_size, draft.config.selector_top_k, draft.config.selector_rank) == (4, 8, 16)
    assert not any(draft.config.layer_causal(i) for i in range(draft.config.num_hidden_layers))


def test_the_recipe_trains_the_selector_and_the_convolutions(dflash2_run) -> None:
    """Every DFlash2 tensor the recipe wrote differs from its initial value (the dynamic
    convolution weights start at zero, the base kernels at the identity)."""
    out, _, _ = dflash2_run
    config = DraftConfig.from_hf(json.loads((out / "draft-dflash2" / "config.json").read_text()))
    initial = DFlash2Draft(config)
    init_weights(initial, RECIPE.draft_layers, RECIPE.seed + 1)
    start = {n: t.to(torch.bfloat16) for n, t in initial.state_dict().items()}
    written = load_file(out / "draft-dflash2" / "model.safetensors")
    new = [n for n in written if "conv" in n or n.startswith("candidate_selector")]
    assert len(new) == 4 * config.num_hidden_layers + 3
    for name in new:
        assert not torch.equal(written[name], start[name]), name


def test_dflash2_output_is_plain_greedy_with_the_trained_draft(dflash2_run) -> None:
    out, _, _ = dflash2_run
    target = load_target(out / "target")
    draft = load_draft(out / "draft-dflash2", target)
    prompts = [
        json.loads(line)["prompt_ids"] for line in (out / "heldout_prompts.jsonl").read_text().splitlines()
    ]
    prompts.append(torch.randint(0, 380, (9,), generator=torch.Generator().manual_seed(0)).tolist())
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for B in (2, 4):
        for prompt in prompts:
            engine = Engine(target, draft, EngineConfig(max_num_seqs=1, block_size=B, max_model_len=64))
            engine.add_request("0", prompt, params)
            while engine.has_unfinished():
                engine.step()
            assert engine.collect("0").output_ids == generate_plain(target, prompt, params).output_ids, B


def test_the_recipes_dflash2_loss_reaches_every_new_parameter(dflash2_run) -> None:
    """Through the real draft forward (`block_hidden`) the token + selector loss has a
    gradient for the convolutions, the codebooks and the hidden projection."""
    out, _, _ = dflash2_run
    target = load_target(out / "target")
    target.requires_grad_(False)
    draft = load_draft(out / "draft-dflash2", target)
    draft.requires_grad_(True)
    seqs = torch.randint(0, 380, (2, 24), generator=torch.Generator().manual_seed(4))
    anchors = torch.tensor([[3, 12], [7, 20]])
    features, _ = target_views(target, seqs, draft.config.target_layer_ids)
    hidden = block_hidden(draft, target, seqs, features, anchors)[:, 1:]
    logits = draft.logits(hidden, target.lm_head_weight)
    labels = logits.argsort(-1, descending=True)[..., 2].detach()  # candidates, so the selector counts
    tokens = seqs.gather(1, anchors).flatten()
    loss, recall = selector_loss(draft, hidden, logits, labels, tokens, None, RECIPE.position_decay)
    assert recall.item() == 1.0
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).add(loss).backward()
    for name, p in draft.named_parameters():
        if "conv" in name or name.startswith("candidate_selector"):
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def fake_pair(run: Path, folder: Path) -> Path:
    """A finished pair's folder made of the DFlash2 run: its target, a `training.json` with
    the run's target figures, and a (tiny random) DFlash draft for that target."""
    pair = folder / "pair"
    shutil.copytree(run / "target", pair / "target")
    results = json.loads((run / "training-dflash2.json").read_text())
    (pair / "training.json").write_text(json.dumps(results))
    make_tiny_draft(pair / "draft", pair / "target", block_size=4, layers=1)
    return pair


def test_from_pair_trains_only_the_dflash2_draft_and_measures_both(dflash2_run, tmp_path) -> None:
    """`--from-pair` takes the pair's target, tokenizer and DFlash draft: only the DFlash2
    draft trains, and the results hold both drafts' acceptance on the same prompts."""
    run, _, corpus = dflash2_run
    pair = fake_pair(run, tmp_path)
    out = tmp_path / "out"
    done = smoke(out, *corpus, "--draft-arch", "dflash2", "--from-pair", str(pair))
    assert done.returncode == 0, done.stderr
    assert "target step" not in done.stdout and "taken from" in done.stdout
    assert (out / "target" / "model.safetensors").read_bytes() == (
        run / "target" / "model.safetensors"
    ).read_bytes()
    # the same target, tokenizer, data and seed: the same DFlash2 draft as the run's
    name = "draft-dflash2/model.safetensors"
    assert (out / name).read_bytes() == (run / name).read_bytes()
    results = json.loads((out / "training-dflash2.json").read_text())
    assert set(results["acceptance_dflash"]) == {"2", "4"}
    for rows in (results["acceptance"], results["acceptance_dflash"]):
        assert all(row["mismatched_requests"] == 0 for row in rows.values())


def test_from_pair_refuses_a_target_the_recipe_would_not_train(dflash2_run, tmp_path) -> None:
    run, _, _ = dflash2_run
    pair = fake_pair(run, tmp_path)
    other = dataclasses.replace(RECIPE, hidden_size=128)
    with pytest.raises(CheckpointError, match="config.json differs in hidden_size, intermediate_size"):
        adopt_pair(pair, tmp_path / "out", other, lambda m: None)
    (pair / "training.json").unlink()
    with pytest.raises(CheckpointError, match="no training.json; expected a finished pair's folder"):
        adopt_pair(pair, tmp_path / "out", RECIPE, lambda m: None)
