"""The demo-pair training stages (reference_engine/training/stages.py, loops.py, settings.py),
where the existing tests leave room:
- the draft stage trains on what the engine drafts: every anchor is a generated position
  whose block fits the sequence, the context features are the target's layers read the way
  the written draft's config says (the last layer raw or after the final norm), each slot's
  label is the target's greedy token at anchor + j, the logits are those of slots 1..B-1, the
  loss sees the block lengths the draft saw, and a DFlash2 selector walks from the anchor
  token towards those same labels;
- the written draft loads back through the engine's loader as the weights that were trained,
  with the recipe's target layers, block size, mask token and last-layer feature;
- the target stage learns from the train stream and validates on the held-out stream only;
  its causal-LM loss predicts the next token;
- the seed reaches the initial weights of the target and the draft;
- a slot's loss weight decays as exp(-(j-1)/position_decay), the model card's formula;
- the recipe refuses settings that cannot train (no steps, a zero interval, a non-positive
  decay) when it is built, rather than failing deep inside a run;
- a run resumed in an output folder whose finished target another recipe trained is refused
  naming what differs, as `--from-pair` refuses such a target.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.config import DraftConfig, TargetConfig
from reference_engine.errors import CheckpointError
from reference_engine.models import build_target
from reference_engine.tokenizer import EOS_TOKEN, MASK_TOKEN, train_byte_level_bpe
from reference_engine.training import loops
from reference_engine.training import recipe as recipe_module
from reference_engine.training import stages as stages_module
from reference_engine.training.corpus import token_stream
from reference_engine.training.loops import init_weights, lm_loss, sequence_forward, slot_weights
from reference_engine.training.settings import Recipe

TEXT = (
    "def add(a, b):\n    return a + b\n\n\nclass Box:\n    def __init__(self, value):\n"
    "        self.value = value\n\n    def get(self):\n        return self.value\n"
)

RECIPE = dataclasses.replace(
    Recipe.smoke(0),
    seq_len=24,
    prompt_len=12,
    continuations=4,
    draft_steps=3,
    draft_batch=2,
    anchors_per_seq=12,
    target_steps=2,
    target_batch=2,
    validate_every=1,
)


@pytest.fixture(scope="module")
def tokenizer():
    return train_byte_level_bpe([TEXT] * 8, RECIPE.vocab_size)


def training_data(tokenizer, train: torch.Tensor | None = None, heldout: torch.Tensor | None = None):
    stream = token_stream(tokenizer, [TEXT] * 6)
    return stages_module.TrainingData(
        None,
        Path("lock.json"),
        tokenizer,
        stream if train is None else train,
        stream if heldout is None else heldout,
    )


def random_target(recipe: Recipe, tokenizer):
    """The recipe's target with its layers drawn at std 0.1, so that its greedy continuations
    move from token to token (at the recipe's small init they repeat one token)."""
    target = build_target(TargetConfig.from_hf(recipe.target_config(tokenizer.token_to_id(EOS_TOKEN))))
    init_weights(target, recipe.target_layers, recipe.seed)
    gen = torch.Generator().manual_seed(recipe.seed)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if p.ndim >= 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return target.eval().requires_grad_(False)


def quiet(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


def record_draft_stage(monkeypatch, recipe: Recipe, tokenizer, out: Path) -> dict:
    """`train_draft` of `recipe` against a random target, recording the target's views of
    its continuations and what each step's loss was built from: the draft, the target, the
    rows and features given to `block_hidden`,
    its output, and the logits, labels and lengths given to `block_loss` (and, for DFlash2,
    the anchors and labels given to `selector_loss`)."""
    seen: dict = {"views": [], "hidden": [], "loss": [], "selector": [], "fit": []}

    def target_views(target, sequences, layers, raw_last_layer=False):
        features, greedy = loops.target_views(target, sequences, layers, raw_last_layer)
        seen["views"].append((sequences, features, greedy))
        return features, greedy

    def block_hidden(draft, target, seqs, features, anchors, lengths=None):
        out = loops.block_hidden(draft, target, seqs, features, anchors, lengths)
        seen["hidden"].append((draft, target, seqs, features, anchors, lengths, out))
        return out

    def block_loss(logits, labels, lengths, decay):
        draft, target, *_, hidden = seen["hidden"][-1]
        want = draft.logits(hidden[:, 1:], target.lm_head_weight)
        seen["loss"].append((logits.detach(), want.detach(), labels, lengths, decay))
        return loops.block_loss(logits, labels, lengths, decay)

    selector = stages_module.selector_loss

    def selector_loss(draft, hidden, logits, labels, anchors, lengths, decay):
        seen["selector"].append((labels, anchors, lengths))
        return selector(draft, hidden, logits, labels, anchors, lengths, decay)

    def optimise(model, *args, **kwargs):
        fit = loops.optimise(model, *args, **kwargs)
        seen["fit"].append({n: t.detach().clone() for n, t in model.state_dict().items()})
        return fit

    monkeypatch.setattr(stages_module, "target_views", target_views)
    monkeypatch.setattr(stages_module, "block_hidden", block_hidden)
    monkeypatch.setattr(stages_module, "block_loss", block_loss)
    monkeypatch.setattr(stages_module, "optimise", optimise)
    monkeypatch.setattr(stages_module, "selector_loss", selector_loss)
    target = random_target(recipe, tokenizer)
    run = stages_module.Run(recipe, out, "cpu", None)
    run.work.mkdir(parents=True, exist_ok=True)
    quiet(stages_module.train_draft, run, training_data(tokenizer), target)
    seen["target"] = target
    return seen


@pytest.mark.parametrize("feature", ["raw", "final_norm"])
def test_the_draft_stage_trains_on_the_engines_blocks_and_writes_what_it_trained(
    monkeypatch, tmp_path: Path, tokenizer, feature: str
) -> None:
    recipe = dataclasses.replace(RECIPE, last_layer_feature=feature)
    seen = record_draft_stage(monkeypatch, recipe, tokenizer, tmp_path)
    target = seen["target"]
    config = DraftConfig.from_hf(json.loads((tmp_path / "draft" / "config.json").read_text()))
    B = recipe.block_size
    assert len(seen["hidden"]) == len(seen["loss"]) == recipe.draft_steps
    ((sequences, views, greedy),) = seen["views"]
    # the context is the target's layers as the written config tells the engine to read them
    want_views, want_greedy = loops.target_views(
        target, sequences, config.target_layer_ids, config.raw_last_layer
    )
    assert torch.equal(views, want_views) and torch.equal(greedy, want_greedy)
    anchors_seen = set()
    for (_, _, seqs, features, anchors, lengths, _), (logits, want, labels, loss_lengths, decay) in zip(
        seen["hidden"], seen["loss"]
    ):
        anchors_seen |= set(anchors.flatten().tolist())
        rows = [next(r for r in range(len(sequences)) if torch.equal(sequences[r], s)) for s in seqs]
        assert torch.equal(features, views[rows])
        # slot j of the block at p learns the target's greedy token after position p + j - 1
        for i, p in enumerate(anchors.flatten().tolist()):
            row = rows[i // anchors.shape[1]]
            assert labels[i].tolist() == greedy[row, p : p + B - 1].tolist()
        torch.testing.assert_close(logits, want, rtol=0, atol=0)  # slots 1..B-1, not 0..B-2
        assert loss_lengths is not None and torch.equal(loss_lengths, lengths)
        assert lengths.min() >= 2 and lengths.max() <= B
        assert decay == recipe.position_decay
    # anchors from the first generated token to the last whose block fits the sequence
    assert min(anchors_seen) == recipe.prompt_len
    assert max(anchors_seen) == recipe.seq_len - B
    # the written draft is the trained one, in the form the engine loads
    loaded = load_draft(tmp_path / "draft", target)
    trained = seen["fit"][-1]
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor.float(), trained[name].to(torch.bfloat16).float()), name
    assert loaded.config.target_layer_ids == recipe.target_layer_ids
    assert loaded.config.block_size == B and loaded.config.num_hidden_layers == recipe.draft_layers
    assert loaded.config.mask_token_id == tokenizer.token_to_id(MASK_TOKEN)
    assert loaded.config.raw_last_layer == (feature == "raw")


def test_a_dflash2_selector_walks_from_the_anchor_token_to_the_targets_greedy_tokens(
    monkeypatch, tmp_path: Path, tokenizer
) -> None:
    recipe = dataclasses.replace(RECIPE, draft_arch="dflash2", draft_steps=2)
    seen = record_draft_stage(monkeypatch, recipe, tokenizer, tmp_path)
    assert len(seen["selector"]) == recipe.draft_steps
    for (_, _, seqs, _, anchors, lengths, _), (_, _, labels, _, _), (
        sel_labels,
        sel_anchors,
        sel_lengths,
    ) in zip(seen["hidden"], seen["loss"], seen["selector"]):
        assert torch.equal(sel_anchors, seqs.gather(1, anchors).flatten())
        assert torch.equal(sel_labels, labels) and torch.equal(sel_lengths, lengths)
    loaded = load_draft(tmp_path / "draft-dflash2", seen["target"])
    assert loaded.config.is_dflash2 and loaded.config.selector_top_k == recipe.selector_top_k


def test_the_target_trains_on_the_train_stream_and_validates_on_the_held_out_one(
    monkeypatch, tmp_path: Path, tokenizer
) -> None:
    """Train tokens below 150, held-out tokens from 150 on: every validation window is
    held-out text and every training window is train text."""
    windows: list[torch.Tensor] = []

    def recording_lm_loss(target, window):
        windows.append(window)
        return lm_loss(target, window)

    monkeypatch.setattr(stages_module, "lm_loss", recording_lm_loss)
    gen = torch.Generator().manual_seed(0)
    train, heldout = (
        torch.randint(0, 150, (400,), generator=gen),
        torch.randint(150, 300, (400,), generator=gen),
    )
    run = stages_module.Run(RECIPE, tmp_path, "cpu", None)
    run.work.mkdir(parents=True)
    quiet(stages_module.train_target, run, training_data(tokenizer, train, heldout))
    shapes = {(RECIPE.target_batch, RECIPE.seq_len + 1), (64, RECIPE.seq_len + 1)}
    assert {tuple(w.shape) for w in windows} == shapes
    probes = [w for w in windows if len(w) == 64]
    steps = [w for w in windows if len(w) == RECIPE.target_batch]
    assert len(steps) == RECIPE.target_steps and len(probes) == RECIPE.target_steps
    assert all((w >= 150).all() for w in probes) and all((w < 150).all() for w in steps)
    written = load_target(tmp_path / "target")
    assert written.config.num_hidden_layers == RECIPE.target_layers
    assert written.config.vocab_size == RECIPE.vocab_size


def test_the_targets_loss_is_the_cross_entropy_of_the_next_token(tokenizer) -> None:
    target = random_target(RECIPE, tokenizer)
    window = torch.randint(0, RECIPE.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = sequence_forward(target, window[:, :-1]).logits
    want = sum(F.cross_entropy(logits[:, t], window[:, t + 1], reduction="sum") for t in range(8)) / (2 * 8)
    assert lm_loss(target, window).item() == pytest.approx(want.item(), rel=1e-6)


def test_the_seed_reaches_the_initial_weights_of_the_target_and_the_draft(
    monkeypatch, tmp_path: Path, tokenizer
) -> None:
    """With a learning rate of 0 the written weights are the initial ones: one seed writes
    the same, another seed other weights."""

    def written(seed: int, folder: str) -> tuple[dict, dict]:
        recipe = dataclasses.replace(
            RECIPE, seed=seed, target_lr=0.0, draft_lr=0.0, target_steps=1, draft_steps=1, continuations=2
        )
        run = stages_module.Run(recipe, tmp_path / folder, "cpu", None)
        run.work.mkdir(parents=True)
        data = training_data(tokenizer)
        quiet(stages_module.train_target, run, data)
        target = load_target(run.target_dir, dtype=torch.float32)
        quiet(stages_module.train_draft, run, data, target)
        return load_file(run.target_dir / "model.safetensors"), load_file(run.draft_dir / "model.safetensors")

    a, b, c = written(0, "a"), written(0, "b"), written(1, "c")
    for i in range(2):
        assert all(torch.equal(a[i][n], b[i][n]) for n in a[i])
        random = [n for n, t in a[i].items() if t.ndim > 1]
        assert random and all(not torch.equal(a[i][n], c[i][n]) for n in random)


def test_a_slots_loss_weight_decays_by_the_recipes_position_decay() -> None:
    """Slot j weighs exp(-(j-1)/position_decay), as the model card states: the default
    decay of 7 halves a weight about every 4.85 slots."""
    weights = slot_weights(2, 15, torch.tensor([16, 5]), 7.0, torch.float64, torch.device("cpu"))
    want = torch.tensor([math.exp(-j / 7.0) for j in range(15)], dtype=torch.float64)
    torch.testing.assert_close(weights[0], want, rtol=1e-12, atol=0)
    torch.testing.assert_close(weights[1, :4], want[:4], rtol=1e-12, atol=0)
    assert weights[1, 4:].abs().sum() == 0


@pytest.mark.parametrize(
    "change",
    [
        {"target_steps": 0},
        {"draft_steps": 0},
        {"validate_every": 0},
        {"checkpoint_every": 0},
        {"position_decay": 0.0},
        {"position_decay": -7.0},
    ],
    ids=lambda change: f"{next(iter(change))}={next(iter(change.values()))}",
)
def test_a_recipe_that_cannot_train_is_refused_when_built(change: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(change))):
        dataclasses.replace(Recipe(), **change)


@pytest.mark.parametrize(
    ("change", "key"),
    [({"hidden_size": 128}, "hidden_size"), ({"target_layers": 6}, "num_hidden_layers")],
    ids=["hidden_size", "target_layers"],
)
def test_a_run_resumed_with_another_recipes_target_is_refused(
    monkeypatch, tmp_path: Path, tokenizer, change, key
) -> None:
    recipe = Recipe.smoke(0)
    (tmp_path / "target").mkdir()
    config = recipe.target_config(tokenizer.token_to_id(EOS_TOKEN))
    (tmp_path / "target" / "config.json").write_text(json.dumps(config))
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "target.json").write_text('{"kept_step": 1}')
    trained: list = []
    data = SimpleNamespace(
        corpus=SimpleNamespace(train=(), heldout=()), tokenizer=tokenizer, stream=(), heldout_stream=()
    )

    def train_draft(run, data, target):
        trained.append(run.recipe)
        (run.work / "draft.json").write_text("{}")

    monkeypatch.setattr(recipe_module, "read_corpus", lambda run, cache, lock: data)
    monkeypatch.setattr(recipe_module, "load_target", lambda folder, dtype, device: torch.nn.Linear(1, 1))
    monkeypatch.setattr(recipe_module, "train_draft", train_draft)
    other = dataclasses.replace(recipe, **change)
    with pytest.raises(CheckpointError, match=key):
        quiet(
            recipe_module.train, other, tmp_path, "cpu", tmp_path / "cache", tmp_path / "lock.json", "draft"
        )
    assert not trained
    quiet(recipe_module.train, recipe, tmp_path, "cpu", tmp_path / "cache", tmp_path / "lock.json", "draft")
    assert trained == [recipe]  # the recipe that trained it goes on
