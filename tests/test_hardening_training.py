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
  naming what differs, as `--from-pair` refuses such a target;
- every count of the recipe is refused at 0, below and as a boolean; a finished target whose
  config.json is gone is refused naming it; an adopted pair leaves its tokenizer in work/ and
  each stage's own parameter count, and a pair whose target lacks a config key is refused;
- a corpus file that is not UTF-8 is read with replacement characters;
- the loop is AdamW (betas 0.9 and 0.95, weight decay on matrices only) clipped at a norm of
  1, warming up over a tenth of the steps and at most 100, logging its last step; a resumed
  loop keeps its recorded terms, and a checkpoint whose save failed midway is not read;
- the target's views read the last layer after the final norm unless asked otherwise, and the
  draft starts from the weights of seed + 1;
- the evaluation measures a DFlash draft beside a DFlash2 one only when there is one, names
  the held-out packages in order, and a card of a recipe without last_layer_feature says raw;
- a pair whose results lack the figures adopting it copies, a time budget that is negative
  or not a number, a learning rate or selector weight that is not finite, an evaluation block
  size the engine cannot draft, and a corpus without a held-out file long enough for a prompt
  are each refused with one error, before anything is trained or copied.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import zipfile
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
from reference_engine.models.dflash import DFlashDraft
from reference_engine.tokenizer import EOS_TOKEN, MASK_TOKEN, train_byte_level_bpe
from reference_engine.training import loops
from reference_engine.training import recipe as recipe_module
from reference_engine.training import stages as stages_module
from reference_engine.training.corpus import Corpus, CorpusError, token_stream
from reference_engine.training.loops import (
    Checkpoint,
    Interrupted,
    init_weights,
    lm_loss,
    optimise,
    sequence_forward,
    slot_weights,
)
from reference_engine.training.pair import adopt_pair
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


# ------------------------------------------------------------------ the recipe's settings
COUNTS = (
    "vocab_size",
    "tokenizer_chars",
    "hidden_size",
    "target_layers",
    "draft_layers",
    "block_size",
    "seq_len",
    "target_steps",
    "validate_every",
    "target_batch",
    "prompt_len",
    "continuations",
    "draft_steps",
    "draft_batch",
    "anchors_per_seq",
    "checkpoint_every",
    "eval_prompts",
    "eval_max_tokens",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
)


@pytest.mark.parametrize("name", COUNTS)
def test_every_count_of_the_recipe_is_refused_at_zero_or_as_a_boolean(name: str) -> None:
    for value in (0, -1, True):
        with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
            dataclasses.replace(Recipe(), **{name: value})


def test_a_recipe_without_evaluation_block_sizes_is_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"eval_block_sizes must be whole numbers .* got \[\]"):
        dataclasses.replace(Recipe(), eval_block_sizes=())


# ------------------------------------------------------------------ resuming and --from-pair
def resumable_folder(folder: Path, recipe: Recipe, tokenizer, config: bool = True) -> None:
    """An output folder whose target stage is finished (work/target.json), with the target's
    config.json unless `config` is False."""
    (folder / "target").mkdir(parents=True)
    if config:
        eos = tokenizer.token_to_id(EOS_TOKEN)
        (folder / "target" / "config.json").write_text(json.dumps(recipe.target_config(eos)))
    (folder / "work").mkdir()
    (folder / "work" / "target.json").write_text('{"kept_step": 1}')


def test_a_finished_target_whose_config_is_gone_is_refused_naming_the_file(
    monkeypatch, tmp_path: Path, tokenizer
) -> None:
    recipe = Recipe.smoke(0)
    resumable_folder(tmp_path, recipe, tokenizer, config=False)
    data = SimpleNamespace(
        corpus=SimpleNamespace(train=(), heldout=()), tokenizer=tokenizer, stream=(), heldout_stream=()
    )
    monkeypatch.setattr(recipe_module, "read_corpus", lambda run, cache, lock: data)
    with pytest.raises(CheckpointError, match=r"config.json is missing; remove work/target.json"):
        quiet(recipe_module.train, recipe, tmp_path, "cpu", tmp_path / "cache", tmp_path / "lock.json")


def finished_pair(folder: Path, recipe: Recipe, tokenizer, drop: str | None = None) -> Path:
    """A finished pair's folder: the target's config (less the key `drop`) and tokenizer, its
    figures, and a DFlash draft."""
    (folder / "target").mkdir(parents=True)
    (folder / "draft").mkdir()
    tokenizer.save(str(folder / "target" / "tokenizer.json"))
    config = recipe.target_config(tokenizer.token_to_id(EOS_TOKEN))
    config.pop(drop, None)
    (folder / "target" / "config.json").write_text(json.dumps(config))
    (folder / "draft" / "config.json").write_text("{}")
    figures = {
        "target": {"kept_step": 1},
        "draft": {"final_loss": 1.0},
        "parameters": {"target": 10, "draft_own": 5},
    }
    (folder / "training.json").write_text(json.dumps(figures))
    return folder


def test_a_pair_whose_target_lacks_a_config_key_is_refused_naming_it(tmp_path: Path, tokenizer) -> None:
    pair = finished_pair(tmp_path / "pair", RECIPE, tokenizer, drop="rope_parameters")
    (tmp_path / "out" / "work").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="differs in rope_parameters"):
        adopt_pair(pair, tmp_path / "out", RECIPE, lambda m: None)
    assert not (tmp_path / "out" / "target").exists()


def test_an_adopted_pair_leaves_the_stages_a_resumed_run_reads(tmp_path: Path, tokenizer) -> None:
    """The target, its tokenizer in work/ (the one the run goes on with) and each stage's
    figures with its own parameter count."""
    pair = finished_pair(tmp_path / "pair", RECIPE, tokenizer)
    out = tmp_path / "out"
    (out / "work").mkdir(parents=True)
    adopt_pair(pair, out, RECIPE, lambda m: None)
    assert (out / "work" / "tokenizer.json").read_bytes() == (pair / "target" / "tokenizer.json").read_bytes()
    assert json.loads((out / "work" / "target.json").read_text()) == {"kept_step": 1, "parameters": 10}
    assert json.loads((out / "work" / "draft.json").read_text()) == {"final_loss": 1.0, "parameters": 5}
    assert (out / "draft" / "config.json").is_file()


def test_a_pair_without_its_figures_is_one_error_line_with_code_2(tmp_path: Path, tokenizer, capsys) -> None:
    pair = finished_pair(tmp_path / "pair", Recipe.smoke(0), tokenizer)
    (pair / "training.json").write_text('{"target": {"kept_step": 1}}')
    code = recipe_module.main(
        ["--smoke", "--device", "cpu", "--out", str(tmp_path / "out"), "--from-pair", str(pair)]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "parameters.target" in err
    assert not (tmp_path / "out" / "target").exists()  # refused before anything is copied


@pytest.mark.parametrize("minutes", ["nan", "-1"])
def test_a_time_budget_that_is_not_one_is_refused_on_the_command_line(minutes: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        recipe_module.parse(["--smoke", "--max-minutes", minutes])
    assert exit_info.value.code == 2
    assert "max-minutes" in capsys.readouterr().err


@pytest.mark.parametrize(
    "change",
    [{"target_lr": math.inf}, {"draft_lr": math.inf}, {"selector_loss_weight": math.nan}],
    ids=["target_lr=inf", "draft_lr=inf", "selector_loss_weight=nan"],
)
def test_a_learning_rate_or_weight_that_is_not_finite_is_refused(change: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(change))):
        dataclasses.replace(Recipe(), **change)


def test_an_evaluation_block_size_the_engine_cannot_draft_is_refused_when_built() -> None:
    from reference_engine.runtime.engine import EngineConfig

    with pytest.raises(Exception, match="block size must be >= 2"):
        EngineConfig(block_size=1)  # what the evaluation would meet
    with pytest.raises(ValueError, match="eval_block_sizes"):
        dataclasses.replace(Recipe(), eval_block_sizes=(1, 4))
    for sizes in ((2.5,), (True, 4), ()):
        with pytest.raises(ValueError, match="eval_block_sizes"):
            dataclasses.replace(Recipe(), eval_block_sizes=sizes)
    with pytest.raises(ValueError, match="max_files"):
        dataclasses.replace(Recipe(), max_files=2.5)


# ------------------------------------------------------------------ the corpus
def test_a_file_that_is_not_utf8_is_read_with_replacement_characters(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "w.whl", "w") as archive:
        archive.writestr("pkg/latin.py", b"name = '\xe9t\xe9'\n")
        archive.writestr("pkg/plain.py", "x = 1\n")
    corpus = Corpus(tmp_path, ("w.whl:pkg/latin.py", "w.whl:pkg/plain.py"), ())
    want = "name = '\ufffdt\ufffd'\n"
    assert corpus.text("w.whl:pkg/latin.py") == want
    assert corpus.texts(corpus.train) == [want, "x = 1\n"]


# ------------------------------------------------------------------ the training loop
class VectorAndMatrix(torch.nn.Module):
    """A vector (no weight decay) and a matrix (weight decay), in float64."""

    def __init__(self) -> None:
        super().__init__()
        self.vector = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        self.matrix = torch.nn.Parameter(torch.ones(2, 2, dtype=torch.float64))


def test_optimise_is_adamw_with_its_betas_and_decays_only_matrices() -> None:
    """The vector's gradients are given per step and the matrix's are 0: the vector moves as
    AdamW (betas 0.9 and 0.95, eps 1e-8) at the scheduled rate, the matrix only shrinks by
    its weight decay of 0.1; the last step is logged whatever log_every is."""
    grads = torch.tensor([[0.3, -0.2], [0.1, 0.4], [-0.5, 0.1]], dtype=torch.float64)
    model = VectorAndMatrix()
    logs: list[str] = []

    def loss_at(step: int) -> torch.Tensor:
        return (grads[step] * model.vector).sum() + 0 * model.matrix.sum()

    fit = optimise(model, 3, 0.1, loss_at, logs.append, "t")
    assert len(fit["losses"]) == 3 and fit["best_step"] == 3
    b1, b2 = 0.9, 0.95
    m = v = torch.zeros(2, dtype=torch.float64)
    vector, shrink = torch.zeros(2, dtype=torch.float64), 1.0
    for t, g in enumerate(grads, 1):
        lr = loops.lr_at(t - 1, 3, 0.1, 1)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        vector = vector - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + 1e-8)
        shrink *= 1 - lr * 0.1
    torch.testing.assert_close(model.vector.detach(), vector, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(model.matrix.detach(), torch.full((2, 2), shrink, dtype=torch.float64))
    assert [line.split("  ")[0] for line in logs] == ["t step 3/3"]


def test_the_gradient_is_clipped_to_a_norm_of_one() -> None:
    model = VectorAndMatrix()
    optimise(model, 2, 0.1, lambda step: (30 * model.vector).sum() + 0 * model.matrix.sum(), print, "t", 50)
    assert torch.linalg.vector_norm(model.vector.grad).item() == pytest.approx(1.0, rel=1e-5)


def test_the_warm_up_is_a_tenth_of_the_steps_and_at_most_100(tmp_path: Path) -> None:
    """A loop of 3000 steps stopped after its first: AdamW's first move of an undecayed
    parameter is the rate itself, the peak over a warm-up of 100 steps."""
    model = VectorAndMatrix()
    with pytest.raises(Interrupted, match="stopped at step 1/3000"):
        optimise(
            model,
            3000,
            0.5,
            lambda step: model.vector.sum() + 0 * model.matrix.sum(),
            lambda m: None,
            "t",
            checkpoint=Checkpoint(tmp_path, "t"),
            deadline=0.0,
        )
    torch.testing.assert_close(model.vector.detach(), torch.full((2,), -0.5 / 100, dtype=torch.float64))


def test_a_resumed_loop_keeps_the_terms_recorded_before_it_stopped(tmp_path: Path) -> None:
    def run(folder: Path, deadline: float | None) -> dict:
        model = VectorAndMatrix()

        def loss_at(step: int) -> dict:
            loss = (model.vector - step).square().sum() + 0 * model.matrix.sum()
            return {"loss": loss, "part": loss.detach() / 2}

        return optimise(
            model,
            4,
            0.1,
            loss_at,
            lambda m: None,
            "t",
            checkpoint=Checkpoint(folder, "t"),
            deadline=deadline,
        )

    want = run(tmp_path / "a", None)
    with pytest.raises(Interrupted):
        run(tmp_path / "b", 0.0)
    got = run(tmp_path / "b", None)
    assert len(want["terms"]["part"]) == 4
    assert got["terms"] == want["terms"] and got["losses"] == want["losses"]


def test_a_checkpoint_whose_save_failed_midway_is_not_read(tmp_path: Path, monkeypatch) -> None:
    checkpoint = Checkpoint(tmp_path, "t", part_bytes=400)
    checkpoint.save({"step": 1, "weights": torch.zeros(300)})
    assert checkpoint.load()["step"] == 1
    writes = []
    real_write = Path.write_bytes

    def failing_write(path: Path, data: bytes) -> int:
        writes.append(path.name)
        if len(writes) == 2:
            raise OSError("disk full")
        return real_write(path, data)

    monkeypatch.setattr(Path, "write_bytes", failing_write)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save({"step": 2, "weights": torch.ones(300)})
    monkeypatch.undo()
    assert checkpoint.load() is None


def test_the_targets_views_read_the_last_layer_after_the_final_norm_unless_asked(tokenizer) -> None:
    target = random_target(RECIPE, tokenizer)
    seqs = torch.randint(0, RECIPE.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    layers = (0, RECIPE.target_layers - 1)
    features, greedy = loops.target_views(target, seqs, layers)
    normed = sequence_forward(target, seqs, layers, raw_last_layer=False)
    raw = sequence_forward(target, seqs, layers, raw_last_layer=True)
    assert torch.equal(features, normed.features) and not torch.equal(features, raw.features)
    assert torch.equal(greedy, normed.logits.argmax(-1))


# ------------------------------------------------------------------ the draft's initial weights
def test_the_draft_starts_from_the_weights_of_the_seed_after_the_targets(tmp_path: Path, tokenizer) -> None:
    """With a learning rate of 0 the written draft is its initial weights: those drawn from
    seed + 1 (the target's come from the seed), as the shipped pair's were."""
    recipe = dataclasses.replace(RECIPE, seed=4, draft_lr=0.0, draft_steps=1, continuations=2)
    run = stages_module.Run(recipe, tmp_path, "cpu", None)
    run.work.mkdir(parents=True)
    target = random_target(recipe, tokenizer)
    quiet(stages_module.train_draft, run, training_data(tokenizer), target)
    config = DraftConfig.from_hf(recipe.draft_config(tokenizer.token_to_id(MASK_TOKEN)))
    want = DFlashDraft(config)
    init_weights(want, recipe.draft_layers, recipe.seed + 1)
    written = load_file(run.draft_dir / "model.safetensors")
    for name, tensor in want.state_dict().items():
        assert torch.equal(written[name], tensor.to(torch.bfloat16)), name


# ------------------------------------------------------------------ evaluating what was written
def measured_run(monkeypatch, tmp_path: Path, recipe: Recipe, prompts: list[dict] | None = None):
    """`evaluate_pair` of `recipe` in `tmp_path`, its held-out prompts, drafts and acceptance
    stood in for; the lock holds a train wheel and the held-out packages zeta and alpha.
    Returns (results, the draft folders measured)."""
    measured: list[Path] = []
    rows = [
        {"name": n, "version": "1", "filename": f"{n}.whl", "url": "", "sha256": "", "size": 1, "heldout": h}
        for n, h in (("train", False), ("zeta", True), ("alpha", True))
    ]
    lock = tmp_path / "lock.json"
    lock.write_text(json.dumps({"wheels": rows}))
    if prompts is None:
        prompts = [{"file": "zeta.whl:z.py", "prompt_ids": [1, 2, 3], "prompt": "abc"}]
    monkeypatch.setattr(stages_module, "heldout_prompts", lambda corpus, tokenizer, recipe: prompts)
    monkeypatch.setattr(stages_module, "load_draft", lambda folder, target: measured.append(folder) or folder)
    accepted = {"mean_acceptance_length": 1.5, "acceptance_rate": 0.5, "mismatched_requests": 0}
    monkeypatch.setattr(
        stages_module, "evaluate", lambda target, draft, ids, sizes, tokens: {B: accepted for B in sizes}
    )
    data = stages_module.TrainingData(
        Corpus(tmp_path, ("train.whl:a.py",), ("zeta.whl:z.py",)),
        lock,
        None,
        torch.arange(5),
        torch.arange(3),
    )
    run = stages_module.Run(recipe, tmp_path, "cpu", None)
    target_summary = {"parameters": 10, "seconds": 1.0, "curve": [], "kept_step": 1}
    target_summary |= {"heldout_loss": 2.0, "final_loss": 2.5}
    draft_summary = {"parameters": 5, "seconds": 2.0, "continuation_seconds": 0.5, "curve": []}
    draft_summary["final_loss"] = 3.0
    results = quiet(stages_module.evaluate_pair, run, data, None, target_summary, draft_summary)
    return results, measured


def test_a_dflash2_run_measures_a_dflash_draft_only_when_there_is_one(monkeypatch, tmp_path: Path) -> None:
    recipe = dataclasses.replace(RECIPE, draft_arch="dflash2")
    results, measured = measured_run(monkeypatch, tmp_path, recipe)
    assert measured == [tmp_path / "draft-dflash2"]
    assert "acceptance_dflash" not in results
    assert json.loads((tmp_path / "training-dflash2.json").read_text())["acceptance"] == results["acceptance"]
    assert not (tmp_path / stages_module.CARD_FILE).exists()  # the card is the DFlash pair's
    (tmp_path / "draft").mkdir()
    results, measured = measured_run(monkeypatch, tmp_path, recipe)
    assert measured == [tmp_path / "draft-dflash2", tmp_path / "draft"]
    assert set(results["acceptance_dflash"]) == {str(B) for B in recipe.eval_block_sizes}


def test_the_results_name_the_held_out_packages_in_order(monkeypatch, tmp_path: Path) -> None:
    results, _ = measured_run(monkeypatch, tmp_path, RECIPE)
    assert results["corpus"]["heldout_packages"] == ["alpha", "zeta"]
    assert results["corpus"]["wheels"] == 3
    assert "alpha, zeta are held out" in (tmp_path / stages_module.CARD_FILE).read_text()


def test_a_corpus_without_a_held_out_prompt_is_told_so(tmp_path: Path, tokenizer) -> None:
    """Held-out prompts are read before training (read_corpus asks for them): a corpus whose
    held-out files are all shorter than two prompts fails there, naming prompt_len, and the
    evaluation refuses an empty prompt list rather than failing inside the engine."""
    from reference_engine.training import evaluation

    with zipfile.ZipFile(tmp_path / "h.whl", "w") as archive:
        archive.writestr("pkg/short.py", "x = 1\n")
        archive.writestr("pkg/long.py", TEXT * 8)
    short = Corpus(tmp_path, ("h.whl:pkg/long.py",), ("h.whl:pkg/short.py",))
    with pytest.raises(CorpusError, match=f"held-out .* prompt_len {RECIPE.prompt_len}"):
        evaluation.heldout_prompts(short, tokenizer, RECIPE)
    enough = Corpus(tmp_path, ("h.whl:pkg/short.py",), ("h.whl:pkg/short.py", "h.whl:pkg/long.py"))
    (prompt,) = evaluation.heldout_prompts(enough, tokenizer, RECIPE)
    assert prompt["file"] == "h.whl:pkg/long.py" and len(prompt["prompt_ids"]) == RECIPE.prompt_len
    with pytest.raises(CorpusError, match="held-out"):
        evaluation.evaluate(None, None, [], RECIPE.eval_block_sizes, 4)


def test_a_card_of_a_recipe_that_predates_the_last_layer_setting_says_raw() -> None:
    """The shipped results' recipe has no last_layer_feature: its draft read the last layer
    raw, and its card says so."""
    from reference_engine.demo import DEMO_DIR
    from reference_engine.training.evaluation import model_card

    results = json.loads((DEMO_DIR / "training.json").read_text())
    shipped = {k: tuple(v) if isinstance(v, list) else v for k, v in results["recipe"].items()}
    assert "last_layer_feature" not in shipped
    results["recipe"] = shipped
    card = model_card(results)
    assert card == (DEMO_DIR / "MODEL_CARD.md").read_text().split("\n## Measured throughput")[0]
    assert "(the last one's raw output, before the final norm)" in card
