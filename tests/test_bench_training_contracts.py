"""Contracts of the benchmark's draft tables and random shapes, and of the demo-pair recipe,
that the broader suites leave implicit.

The benchmark (reference_engine/bench): the draft ratio is per draft forward, whatever each
side's count of draft forwards; a DFlash row without draft forwards is set against nothing;
a part's ms are per timed call; the tables print their columns in their headers' order, the
shares as percentages, and no header without rows. A DFlash2 random draft is the published
one (every layer sliding over 2048 tokens, non-causal, the convolution and selector fields);
every draft's mask is the last token of the vocabulary and its context the target's; an
unknown arch or shape is refused by name; `random_pair` builds the draft of the arch, block
size and depth asked. Qwen3-8B and Qwen3.5-4B have the published layouts. `python -m
reference_engine.bench` exits with `main`'s code.

The recipe (reference_engine/training): the default settings write the shipped pair's
configs and card; `train` runs each unfinished stage once, with `--max-minutes` in minutes,
a run stopped after a stage returns None, a finished DFlash draft is no finished DFlash2
draft, the target is evaluated in float32; a zero on the command line is a setting, not a
default; `--fetch-only` fetches the lock given and trains nothing, and an OS error is one
error line with code 2. The selector loss is 0 with no true token among the candidates and
its edges are float32 for bfloat16 inputs. A run's files: the tokenizer of `work/` is reused,
the held-out stream is the held-out files', the kept step is the one the loop logged, the
weights are bfloat16, prompts are continued to `seq_len` from the train stream, a DFlash2
draft's loss weighs its selector term by `selector_loss_weight` and its summary names its
final terms, the results count what was measured and each split by its own files, and only
a DFlash run writes the card; continuations are drawn in chunks of at most 4096. Acceptance
is measured at each block size asked; the held-out prompts follow the seed's file order. The
corpus: a lock that is not one is a CorpusError, a wheel's hash covers all of it, an
interrupted download leaves no part file, the progress counts only the missing wheels, a
top-level vendored folder is left out, the splits are sorted whatever the lock's order, texts
come in the order asked, a window is never cut short at the stream's end (nor, a bug, drawn
up to it), and `pin` asks the index given and fails with code 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import re
import runpy
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from reference_engine.bench.drafts import draft_comparison, draft_parts, per_draft, print_drafts
from reference_engine.bench.shapes import DRAFT_HEADS, TARGET_SHAPES, draft_raw, random_pair
from reference_engine.checkpoint import load_draft, load_target
from reference_engine.config import DraftConfig, TargetConfig
from reference_engine.demo import DEMO_DIR, DEMO_DRAFT, DEMO_TARGET, demo_prompts
from reference_engine.errors import ConfigError
from reference_engine.models import expected_shapes
from reference_engine.models.dflash2 import DFlash2Draft
from reference_engine.tokenizer import EOS_TOKEN, MASK_TOKEN, train_byte_level_bpe
from reference_engine.training import corpus as corpus_module
from reference_engine.training import recipe as recipe_module
from reference_engine.training import stages as stages_module
from reference_engine.training.corpus import (
    Corpus,
    CorpusError,
    fetch,
    random_windows,
    read_lock,
    sha256_of,
    source_members,
    token_stream,
)
from reference_engine.training.evaluation import evaluate, heldout_prompts, model_card
from reference_engine.training.selector import selector_loss, teacher_forced_edges
from reference_engine.training.settings import Recipe

from .test_training import make_wheel_corpus
from .test_training_dflash2 import RECIPE as DFLASH2
from .test_training_dflash2 import selector_batch, smoke_draft


# ------------------------------------------------------------------ bench/drafts.py
def bench_row(draft: str, ms_step: float, ms_draft: float, n_draft: int, conv=0.0, selector=0.0, calls=0):
    return {
        "mode": "dflash",
        "draft": draft,
        "numerics": "exact",
        "concurrency": 2,
        "ms_per_decode_step": ms_step,
        "ms_draft": ms_draft,
        "n_draft": n_draft,
        "ms_conv": conv,
        "n_conv": calls,
        "ms_selector": selector,
        "n_selector": calls,
    }


def test_the_draft_ratio_is_per_draft_forward_whatever_each_sides_count() -> None:
    """DFlash: 12 ms over 4 forwards; DFlash2: 18 ms over 3 forwards; 6 / 3 per forward."""
    rows = [bench_row("dflash", 2.0, 12.0, 4), bench_row("dflash2", 4.0, 18.0, 3)]
    (compared,) = draft_comparison(rows)
    assert compared["draft_ratio"] == pytest.approx(2.0)
    assert (compared["dflash_ms"], compared["dflash2_ms"], compared["step_ratio"]) == (2.0, 4.0, 2.0)
    assert per_draft(rows[0]) == 3.0 and per_draft(rows[1]) == 6.0


def test_a_dflash_row_without_draft_forwards_is_set_against_nothing() -> None:
    rows = [bench_row("dflash", 2.0, 0.0, 0), bench_row("dflash2", 4.0, 18.0, 3)]
    assert draft_comparison(rows) == []


def test_a_parts_ms_are_per_timed_call_not_per_draft_forward() -> None:
    """Three draft forwards of which two timed their convolution and selector."""
    (parts,) = draft_parts([bench_row("dflash2", 4.0, 18.0, 3, conv=2.0, selector=4.0, calls=2)])
    assert parts["timed"]
    assert (parts["conv_ms"], parts["selector_ms"]) == (1.0, 2.0)
    assert parts["conv_share"] == pytest.approx(2 / 18) and parts["selector_share"] == pytest.approx(4 / 18)


def test_the_draft_tables_print_each_column_under_its_header(capsys: pytest.CaptureFixture) -> None:
    rows = [
        bench_row("dflash", 2.0, 12.0, 4),
        bench_row("dflash2", 3.0, 18.0, 3, conv=3.0, selector=6.0, calls=2),
    ]
    print_drafts(rows)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("DFlash2 step / DFlash step | DFlash2 draft / DFlash draft")
    assert lines[1] == "exact | 2 | 2.00 | 3.00 | 1.50 | 2.00"
    assert lines[2].startswith("numerics | concurrency | DFlash2 conv % of draft | conv ms per draft")
    assert lines[3] == "exact | 2 | 16.7 | 1.50 | 33.3 | 3.00"
    assert len(lines) == 4


def test_no_draft_table_is_printed_without_a_dflash2_row(capsys: pytest.CaptureFixture) -> None:
    print_drafts([bench_row("dflash", 2.0, 12.0, 4), {**bench_row("", 1.0, 0.0, 0), "mode": "plain"}])
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------ bench/shapes.py
def test_a_dflash2_random_draft_is_the_published_dflash2() -> None:
    config = DraftConfig.from_hf(draft_raw("qwen3-8b", 16, 5, "dflash2"))
    assert config.is_dflash2
    assert config.layer_types == ("sliding_attention",) * 5 and config.sliding_window == 2048
    assert not any(config.layer_causal(i) for i in range(5))
    fields = (config.conv_kernel_size, config.conv_group_size, config.selector_rank, config.selector_top_k)
    assert fields == (2, 16, 256, 16)
    plain = DraftConfig.from_hf(draft_raw("qwen3-8b", 16, 5))
    assert not plain.is_dflash2 and plain.selector_top_k == 0


@pytest.mark.parametrize("shape", sorted(TARGET_SHAPES))
def test_every_random_draft_masks_with_the_last_token_and_reads_the_targets_context(shape: str) -> None:
    target = TARGET_SHAPES[shape]
    config = DraftConfig.from_hf(draft_raw(shape, 8, 3))
    assert config.mask_token_id == target["vocab_size"] - 1
    assert config.max_position_embeddings == target["max_position_embeddings"]
    assert config.num_target_layers == target["num_hidden_layers"]
    heads, kv_heads, head_dim, width = DRAFT_HEADS[shape]
    assert (config.num_attention_heads, config.num_key_value_heads) == (heads, kv_heads)
    assert (config.head_dim, config.intermediate_size, config.block_size) == (head_dim, width, 8)


def test_an_unknown_draft_arch_or_shape_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="unknown draft arch 'eagle', expected one of dflash, dflash2"):
        draft_raw("qwen3-small", 4, 1, "eagle")
    with pytest.raises(ConfigError, match="unknown shape 'qwen9', expected one of qwen3-8b, "):
        random_pair("qwen9", "cpu", torch.float32)


def test_random_pair_builds_the_draft_of_the_arch_block_size_and_depth_asked() -> None:
    target, draft = random_pair(
        "qwen3-small", "cpu", torch.float32, block_size=4, draft_layers=2, draft_arch="dflash2"
    )
    assert isinstance(draft, DFlash2Draft)
    assert (draft.config.block_size, draft.config.num_hidden_layers) == (4, 2)
    assert target.config.num_hidden_layers == TARGET_SHAPES["qwen3-small"]["num_hidden_layers"]


def test_the_qwen3_8b_and_qwen3_5_4b_shapes_have_the_published_layouts() -> None:
    """Qwen3-8B: 36 layers of 11 tensors, untied lm_head, 8.19B parameters. Qwen3.5-4B's
    text model: tied embeddings, 24 Gated DeltaNet and 8 attention layers."""
    qwen3 = TargetConfig.from_hf(TARGET_SHAPES["qwen3-8b"])
    shapes = expected_shapes(qwen3)
    assert len(shapes) == 3 + 36 * 11
    assert 8.18 <= sum(torch.Size(s).numel() for s in shapes.values()) / 1e9 <= 8.20
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (12288, 4096)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (8 * 128, 4096)
    assert DRAFT_HEADS["qwen3-8b"] == (32, 8, 128, 12288)  # the target's own heads and width
    qwen35 = TargetConfig.from_hf(TARGET_SHAPES["qwen3.5-4b"])
    shapes = expected_shapes(qwen35)
    assert "lm_head.weight" not in shapes and qwen35.tie_word_embeddings
    assert len(qwen35.linear_layers) == 24 and qwen35.attention_layers == tuple(range(3, 32, 4))
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (9216, 2560)


# ------------------------------------------------------------------ bench/__main__.py
def test_python_m_bench_exits_with_mains_error_code(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["bench", "--model", str(tmp_path / "no"), "--draft", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("reference_engine.bench", run_name="__main__")
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("error: ")


# ------------------------------------------------------------------ training/settings.py
def shipped_recipe(name: str) -> Recipe:
    recipe = json.loads((DEMO_DIR / name).read_text())["recipe"]
    return Recipe(**{k: tuple(v) if isinstance(v, list) else v for k, v in recipe.items()})


@pytest.fixture(scope="module")
def demo_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(DEMO_DIR / "target" / "tokenizer.json"))


def test_the_default_recipe_is_the_shipped_pairs_and_writes_its_configs(demo_tokenizer) -> None:
    assert shipped_recipe("training.json") == Recipe()
    assert shipped_recipe("training-dflash2.json") == Recipe(draft_arch="dflash2")
    eos, mask = demo_tokenizer.token_to_id(EOS_TOKEN), demo_tokenizer.token_to_id(MASK_TOKEN)

    def shipped(folder: str) -> dict:
        return json.loads((DEMO_DIR / folder / "config.json").read_text())

    assert Recipe().target_config(eos) == shipped("target")
    assert Recipe().draft_config(mask) == shipped("draft")
    assert Recipe(draft_arch="dflash2").draft_config(mask) == shipped("draft-dflash2")


def test_the_draft_config_takes_the_mask_token_given_and_smoke_the_seed_given() -> None:
    recipe = Recipe.smoke(7)
    assert recipe.seed == 7
    assert recipe.draft_config(11)["dflash_config"]["mask_token_id"] == 11
    dflash2 = dataclasses.replace(recipe, draft_arch="dflash2", selector_rank=24, conv_kernel_size=3)
    fields = dflash2.draft_config(11)["dflash_config"]
    assert (fields["selector_rank"], fields["selector_top_k"]) == (24, recipe.selector_top_k)
    assert (fields["conv_kernel_size"], fields["conv_group_size"]) == (3, 16)
    assert DraftConfig.from_hf(dflash2.draft_config(11)).num_target_layers == recipe.target_layers


def test_the_last_layer_feature_is_a_setting_that_the_draft_config_records() -> None:
    """`--last-layer-feature`: raw (the shipped recipe) is written into the draft's
    dflash_config; final_norm is the loader's default and is left out; anything else is
    refused."""
    raw = Recipe.smoke(0)
    assert raw.draft_config(3)["dflash_config"]["last_layer_feature"] == "raw"
    assert DraftConfig.from_hf(raw.draft_config(3)).raw_last_layer
    final = recipe_module.parse(["--smoke", "--seed", "0", "--last-layer-feature", "final_norm"]).recipe
    assert "last_layer_feature" not in final.draft_config(3)["dflash_config"]
    assert not final.raw_last_layer and not DraftConfig.from_hf(final.draft_config(3)).raw_last_layer
    with pytest.raises(ValueError, match="last_layer_feature"):
        Recipe(last_layer_feature="normed")
    with pytest.raises(SystemExit):
        recipe_module.parse(["--smoke", "--last-layer-feature", "normed"])


# ------------------------------------------------------------------ training/recipe.py: train and main
EOS_ID = 2  # the stand-in tokenizer's end-of-sequence token


@pytest.fixture
def stages(monkeypatch: pytest.MonkeyPatch) -> list:
    """`train`'s stages replaced by stand-ins that write what a finished stage leaves and
    record each call: ("corpus", lock), ("target", deadline), ("load", dtype), ("draft",
    stage), ("evaluate", target summary, draft summary)."""
    calls: list = []

    def read_corpus(run, cache, lock):
        calls.append(("corpus", lock))
        tokenizer = SimpleNamespace(token_to_id=lambda token: EOS_ID)
        return SimpleNamespace(
            corpus=SimpleNamespace(train=(), heldout=()), stream=(), heldout_stream=(), tokenizer=tokenizer
        )

    def train_target(run, data):
        calls.append(("target", run.deadline))
        run.target_dir.mkdir(parents=True, exist_ok=True)
        (run.target_dir / "config.json").write_text(json.dumps(run.recipe.target_config(EOS_ID)))
        (run.work / "target.json").write_text('{"stage": "target"}')

    def load_target(folder, dtype, device):
        calls.append(("load", dtype))
        return torch.nn.Linear(1, 1)

    def train_draft(run, data, target):
        calls.append(("draft", run.recipe.draft_stage))
        (run.work / f"{run.recipe.draft_stage}.json").write_text(
            json.dumps({"stage": run.recipe.draft_stage})
        )

    def evaluate_pair(run, data, target, target_summary, draft_summary):
        calls.append(("evaluate", target_summary, draft_summary))
        return {"target": target_summary, "draft": draft_summary}

    for stand_in in (read_corpus, train_target, load_target, train_draft, evaluate_pair):
        monkeypatch.setattr(recipe_module, stand_in.__name__, stand_in)
    return calls


def run_train(out: Path, recipe: Recipe | None = None, **kwargs):
    with contextlib.redirect_stdout(io.StringIO()):
        return recipe_module.train(recipe or Recipe(), out, "cpu", out / "cache", out / "lock.json", **kwargs)


def test_train_runs_each_stage_once_and_returns_the_results(stages: list, tmp_path: Path) -> None:
    results = run_train(tmp_path)
    assert results == {"target": {"stage": "target"}, "draft": {"stage": "draft"}}
    assert [c[0] for c in stages] == ["corpus", "target", "load", "draft", "evaluate"]
    assert stages[0] == ("corpus", tmp_path / "lock.json")
    assert stages[2] == ("load", torch.float32)  # evaluated in true float32
    stages.clear()
    assert run_train(tmp_path) == results  # both stages finished: only the evaluation
    assert [c[0] for c in stages] == ["corpus", "load", "evaluate"]


def test_max_minutes_is_a_deadline_in_minutes(stages: list, tmp_path: Path) -> None:
    start = time.perf_counter()
    run_train(tmp_path, max_minutes=2.0)
    deadline = next(c[1] for c in stages if c[0] == "target")
    assert 119.0 <= deadline - start <= 121.0
    stages.clear()
    run_train(tmp_path / "b")
    assert next(c[1] for c in stages if c[0] == "target") is None


@pytest.mark.parametrize(
    "stop_after, ran", [("target", ["corpus", "target"]), ("draft", ["corpus", "target", "load", "draft"])]
)
def test_a_run_stopped_after_a_stage_returns_none_having_run_no_later_stage(
    stages: list, tmp_path: Path, stop_after: str, ran: list
) -> None:
    assert run_train(tmp_path, stop_after=stop_after) is None
    assert [c[0] for c in stages] == ran


def test_a_finished_dflash_draft_is_not_a_finished_dflash2_draft(stages: list, tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "draft.json").write_text('{"stage": "draft"}')
    results = run_train(tmp_path, recipe=Recipe(draft_arch="dflash2"))
    assert ("draft", "draft-dflash2") in stages and results["draft"] == {"stage": "draft-dflash2"}


def test_a_zero_on_the_command_line_is_a_setting_not_the_default() -> None:
    ns = recipe_module.parse(
        ["--selector-loss-weight", "0", "--short-block-share", "0", "--smoke", "--seed", "0"]
    )
    assert (ns.recipe.selector_loss_weight, ns.recipe.short_block_share) == (0.0, 0.0)
    assert recipe_module.parse(["--smoke", "--seed", "5"]).recipe.seed == 5


def test_fetch_only_fetches_the_lock_given_and_trains_nothing(tmp_path: Path, monkeypatch, capsys) -> None:
    lock, _ = make_wheel_corpus(tmp_path, packages=("json", "email"), heldout=("email",))
    monkeypatch.setattr(recipe_module, "train", lambda *a, **k: pytest.fail("--fetch-only trained"))
    code = recipe_module.main(
        ["--fetch-only", "--corpus-lock", str(lock), "--corpus-cache", str(tmp_path / "c")]
    )
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [
        w.filename for w in sorted(read_lock(lock), key=lambda w: w.filename)
    ]
    assert "holds every wheel" in capsys.readouterr().out


def test_an_os_error_is_one_error_line_with_code_2(tmp_path: Path, capsys) -> None:
    lock, _ = make_wheel_corpus(tmp_path, packages=("json", "email"), heldout=("email",))
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    code = recipe_module.main(["--fetch-only", "--corpus-lock", str(lock), "--corpus-cache", str(blocker)])
    assert code == 2
    assert capsys.readouterr().err.startswith("error: ")


# ------------------------------------------------------------------ training/selector.py
def test_the_selector_loss_is_zero_when_no_true_token_is_a_candidate() -> None:
    draft = smoke_draft()
    hidden, logits, _, anchors, lengths = selector_batch(draft)
    outside = logits.argmin(-1)  # never among the top-k
    loss, recall = selector_loss(draft, hidden, logits, outside, anchors, lengths, DFLASH2.position_decay)
    assert loss.item() == 0.0 and recall.item() == 0.0


def test_teacher_forced_edges_are_float32_for_bfloat16_inputs() -> None:
    draft = smoke_draft().to(torch.bfloat16)
    hidden, logits, labels, anchors, _ = selector_batch(draft)
    K = draft.config.selector_top_k
    unary, ids = logits.to(torch.bfloat16).topk(K, -1)
    predecessors = torch.cat([anchors[:, None], labels[:, :-1]], dim=1)
    edges = teacher_forced_edges(
        draft.candidate_selector, hidden.to(torch.bfloat16), ids, unary, predecessors
    )
    assert edges.dtype == torch.float32 and edges.shape == ids.shape


# ------------------------------------------------------------------ a recipe run's files
TINY = [
    "--smoke",
    "--device",
    "cpu",
    "--max-files",
    "16",  # 2 held-out files
    "--tokenizer-chars",
    "40000",
    "--seq-len",
    "24",
    "--prompt-len",
    "8",
    "--target-batch",
    "2",
    "--target-steps",
    "3",
    "--validate-every",
    "1",
    "--target-lr",
    "0.5",
    "--draft-steps",
    "2",
    "--continuations",
    "4",
    "--eval-prompts",
    "50",  # more than the held-out files
    "--eval-max-tokens",
    "6",
]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny DFlash run, then a DFlash2 run (selector loss weight 0.5, every token a
    candidate so that every slot counts) into the same folder, on test_training's synthetic
    wheel corpus: the folder, the corpus, each run's stdout and the model card as the DFlash
    run left it."""
    folder = tmp_path_factory.mktemp("tiny-run")
    lock, _ = make_wheel_corpus(folder / "corpus")
    out, cache = folder / "out", folder / "cache"
    args = [*TINY, "--out", str(out), "--corpus-lock", str(lock), "--corpus-cache", str(cache)]
    stdout = []
    for extra in (
        [],
        ["--draft-arch", "dflash2", "--selector-loss-weight", "0.5", "--selector-top-k", "384"],
    ):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            assert recipe_module.main(args + extra) == 0
        stdout.append(buffer.getvalue())
        if not extra:
            card = (out / "MODEL_CARD.md").read_text()
    corpus = Corpus.from_lock(cache, lock, 16, log=lambda m: None)
    return SimpleNamespace(out=out, corpus=corpus, stdout=stdout, card=card)


def test_a_run_keeps_the_step_its_loop_logged_and_writes_bfloat16_weights(tiny_run) -> None:
    results = json.loads((tiny_run.out / "training.json").read_text())
    kept = re.search(r"target: kept the weights of step (\d+) \(validation ([\d.]+)\)", tiny_run.stdout[0])
    assert kept is not None
    assert results["target"]["kept_step"] == int(kept.group(1))
    assert f"{results['target']['heldout_loss']:.3f}" == kept.group(2)
    for folder in ("target", "draft", "draft-dflash2"):
        weights = load_file(tiny_run.out / folder / "model.safetensors")
        assert {t.dtype for t in weights.values()} == {torch.bfloat16}, folder
    assert not list((tiny_run.out / "work").glob("*.ckpt*"))


def test_a_runs_results_count_what_was_measured_and_each_split_by_its_own_files(tiny_run) -> None:
    results = json.loads((tiny_run.out / "training.json").read_text())
    tokenizer = Tokenizer.from_file(str(tiny_run.out / "work" / "tokenizer.json"))
    corpus = tiny_run.corpus
    assert (results["corpus"]["train_files"], results["corpus"]["heldout_files"]) == (16, 2)
    heldout = token_stream(tokenizer, corpus.texts(corpus.heldout))
    assert results["corpus"]["heldout_tokens"] == len(heldout) != results["corpus"]["train_tokens"]
    prompts = (tiny_run.out / "heldout_prompts.jsonl").read_text().splitlines()
    assert results["eval"]["prompts"] == len(prompts) == 2
    assert "parameters" not in results["target"] and "parameters" not in results["draft"]
    target = load_target(tiny_run.out / "target")
    assert results["parameters"]["target"] == sum(p.numel() for p in target.parameters())
    seconds = results["seconds"]
    assert seconds["continuations"] == results["draft"]["continuation_seconds"] > 0
    assert seconds["eval"] == results["eval"]["seconds"] and seconds["draft"] == results["draft"]["seconds"]
    assert "acceptance_dflash" not in results  # a DFlash run measures its draft once
    for row in results["acceptance"].values():
        assert 0.0 <= row["acceptance_rate"] <= 1.0 and row["acceptance_rate"] < row["mean_acceptance_length"]


def test_a_dflash2_run_weighs_its_selector_term_and_leaves_the_dflash_card(tiny_run) -> None:
    results = json.loads((tiny_run.out / "training-dflash2.json").read_text())
    draft = results["draft"]
    terms = ("final_token_loss", "final_selector_loss", "final_candidate_recall")
    assert all(isinstance(draft[name], float) for name in terms), sorted(draft)
    assert draft["final_candidate_recall"] == 1.0 and draft["final_selector_loss"] > 0
    want = draft["final_token_loss"] + 0.5 * draft["final_selector_loss"]
    assert draft["final_loss"] == pytest.approx(want, rel=1e-5)
    assert set(results["acceptance_dflash"]) == set(results["acceptance"]) == {"2", "4"}
    assert (tiny_run.out / "MODEL_CARD.md").read_text() == tiny_run.card
    assert "target step" not in tiny_run.stdout[1]  # the target and tokenizer were reused


def test_a_runs_continuations_are_train_prompts_continued_to_seq_len(tiny_run, monkeypatch) -> None:
    """The prompts the draft learns from are windows of the train stream, continued by the
    target to seq_len tokens, one sequence per `continuations`."""
    recipe = recipe_module.parse(TINY).recipe
    tokenizer = Tokenizer.from_file(str(tiny_run.out / "work" / "tokenizer.json"))
    corpus = tiny_run.corpus
    data = stages_module.TrainingData(
        corpus,
        Path("lock.json"),
        tokenizer,
        token_stream(tokenizer, corpus.texts(corpus.train)),
        token_stream(tokenizer, corpus.texts(corpus.heldout)),
    )
    target = load_target(tiny_run.out / "target", dtype=torch.float32)
    run = stages_module.Run(recipe, tiny_run.out, "cpu", None)
    with contextlib.redirect_stdout(io.StringIO()):
        sequences, features, greedy = stages_module.continuations(run, data, target)
    assert sequences.shape == (recipe.continuations, recipe.seq_len)
    train = data.stream.unfold(0, recipe.prompt_len, 1)
    for prompt in sequences[:, : recipe.prompt_len]:
        assert (train == prompt).all(-1).any()
    assert greedy.shape == sequences.shape


def test_continuations_are_drawn_in_chunks_of_at_most_4096_to_the_count_asked(monkeypatch) -> None:
    chunks: list[int] = []

    def greedy_continue(target, prompts, new_tokens):
        chunks.append(len(prompts))
        return torch.cat([prompts, torch.zeros(len(prompts), new_tokens, dtype=prompts.dtype)], 1)

    monkeypatch.setattr(stages_module, "greedy_continue", greedy_continue)
    monkeypatch.setattr(
        stages_module, "target_views", lambda target, sequences, layers, raw_last: (None, sequences)
    )
    recipe = dataclasses.replace(Recipe.smoke(), continuations=4097)
    stream = torch.arange(200)
    data = stages_module.TrainingData(None, Path("lock.json"), None, stream, stream)
    with contextlib.redirect_stdout(io.StringIO()):
        sequences, _, _ = stages_module.continuations(
            stages_module.Run(recipe, Path("."), "cpu", None), data, None
        )
    assert chunks == [4096, 1] and sequences.shape == (4097, recipe.seq_len)


def test_read_corpus_reuses_the_tokenizer_in_work_and_streams_the_held_out_files(tmp_path: Path) -> None:
    lock, _ = make_wheel_corpus(tmp_path, packages=("json", "email"), heldout=("email",))
    recipe = dataclasses.replace(Recipe.smoke(), max_files=4)
    run = stages_module.Run(recipe, tmp_path / "out", "cpu", None)
    run.work.mkdir(parents=True)
    mine = train_byte_level_bpe(["x = 1\n"] * 10, 300)
    mine.save(str(run.work / "tokenizer.json"))
    data = stages_module.read_corpus(run, tmp_path / "cache", lock)
    assert data.tokenizer.get_vocab() == mine.get_vocab()
    assert data.heldout_stream.tolist() == token_stream(mine, data.corpus.texts(data.corpus.heldout)).tolist()
    assert data.stream.tolist() == token_stream(mine, data.corpus.texts(data.corpus.train)).tolist()


# ------------------------------------------------------------------ training/evaluation.py
def test_the_shipped_card_is_the_model_card_of_the_shipped_results() -> None:
    """A run's results hold its recipe as dataclasses.asdict gives it (tuples); the card the
    recipe writes is the shipped one, up to the section added after training."""
    results = json.loads((DEMO_DIR / "training.json").read_text())
    results["recipe"] = dataclasses.asdict(shipped_recipe("training.json"))
    shipped = (DEMO_DIR / "MODEL_CARD.md").read_text()
    assert model_card(results) == shipped.split("\n## Measured throughput")[0]


@pytest.fixture(scope="module")
def demo_pair():
    target = load_target(DEMO_TARGET, dtype=torch.float32)
    return target, load_draft(DEMO_DRAFT, target)


def test_acceptance_is_measured_at_each_block_size_asked(demo_pair) -> None:
    """The shipped pair (block size 16) drafts at B=2 and B=8: at most one draft token is
    accepted per step at B=2, more at B=8; the rate is accepted per proposed draft token."""
    prompts = [p["prompt_ids"] for p in demo_prompts()[:2]]
    acceptance = evaluate(*demo_pair, prompts, (2, 8), 24)
    assert set(acceptance) == {2, 8}
    assert 1.0 < acceptance[2]["mean_acceptance_length"] <= 2.0 < acceptance[8]["mean_acceptance_length"]
    for row in acceptance.values():
        assert 0.0 < row["acceptance_rate"] < 1.0 and row["mismatched_requests"] == 0
    # at B=2 a step proposes one token: the rate is the mean length less the bonus token
    assert acceptance[2]["acceptance_rate"] == pytest.approx(acceptance[2]["mean_acceptance_length"] - 1)


class LetterFiles:
    """Held-out files f0..f9, each 40 one-letter tokens of its own letter."""

    heldout = tuple(f"w.whl:f{i}.py" for i in range(10))

    def text(self, path: str) -> str:
        return "abcdefghij"[int(path[len("w.whl:f")])] * 40

    def encode(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(ids=[ord(c) for c in text])

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


def test_held_out_prompts_take_the_files_in_the_seeds_order() -> None:
    files = LetterFiles()
    orders = {
        tuple(
            p["file"] for p in heldout_prompts(files, files, Recipe(seed=seed, prompt_len=8, eval_prompts=3))
        )
        for seed in range(6)
    }
    assert len(orders) > 1  # not the sorted order for every seed
    again = heldout_prompts(files, files, Recipe(seed=2, prompt_len=8, eval_prompts=3))
    assert again == heldout_prompts(files, files, Recipe(seed=2, prompt_len=8, eval_prompts=3))


# ------------------------------------------------------------------ training/corpus.py
@pytest.mark.parametrize("text", ['{"cutoff": "2026-01-01"}', "not json", '{"wheels": [{"name": "x"}]}'])
def test_a_lock_that_is_not_one_is_a_corpus_error(tmp_path: Path, text: str) -> None:
    (tmp_path / "lock.json").write_text(text)
    with pytest.raises(CorpusError, match="not a corpus lock"):
        read_lock(tmp_path / "lock.json")


def test_a_wheels_hash_covers_the_whole_file(tmp_path: Path) -> None:
    """Wheels of several MiB are read in blocks; a change past the first block changes the hash."""
    data = bytes(range(256)) * (3 * 2**12 + 7)
    (tmp_path / "big.whl").write_bytes(data)
    assert sha256_of(tmp_path / "big.whl") == hashlib.sha256(data).hexdigest()


def test_an_interrupted_download_leaves_no_part_file(tmp_path: Path, monkeypatch) -> None:
    lock, _ = make_wheel_corpus(tmp_path, packages=("json", "email"), heldout=("email",))

    class Broken(io.BytesIO):
        def read(self, size: int = -1) -> bytes:
            if self.tell():
                raise ConnectionResetError("reset by peer")
            return super().read(16)

    monkeypatch.setattr(corpus_module.urllib.request, "urlopen", lambda url, timeout: Broken(b"x" * 64))
    with pytest.raises(CorpusError, match="cannot download .*reset by peer"):
        fetch(read_lock(lock)[:1], tmp_path / "cache", log=lambda m: None)
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_fetch_progress_counts_only_the_missing_wheels(tmp_path: Path) -> None:
    lock, _ = make_wheel_corpus(tmp_path, packages=("json", "email", "http"), heldout=("http",))
    wheels = read_lock(lock)
    fetch(wheels[:1], tmp_path / "cache", log=lambda m: None)
    logs: list[str] = []
    fetch(wheels, tmp_path / "cache", log=logs.append)
    assert [m.split()[2] for m in logs] == ["1/2", "2/2"]
    done, total = re.search(r"\(([\d.]+) of ([\d.]+) MiB\)", logs[-1]).groups()
    assert done == total == f"{(wheels[1].size + wheels[2].size) / 2**20:.1f}"


def test_a_top_level_vendored_folder_is_left_out(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "w.whl", "w") as archive:
        for name in ("_vendor/six.py", "vendor/x/y.py", "pkg/a.py"):
            archive.writestr(name, "x = 1\n")
    with zipfile.ZipFile(tmp_path / "w.whl") as archive:
        assert source_members(archive) == ["pkg/a.py"]


def test_the_splits_are_sorted_whatever_the_locks_order_and_texts_come_in_the_order_asked(
    tmp_path: Path,
) -> None:
    lock, _ = make_wheel_corpus(
        tmp_path, packages=("xml", "json", "http", "email"), heldout=("http", "email")
    )
    corpus = Corpus.from_lock(tmp_path / "cache", lock, log=lambda m: None)
    assert list(corpus.train) == sorted(corpus.train) and corpus.train[0].startswith("json-")
    assert list(corpus.heldout) == sorted(corpus.heldout) and corpus.heldout[0].startswith("email-")
    asked = (corpus.train[0], corpus.heldout[0], corpus.train[1])  # two wheels, interleaved
    assert corpus.texts(asked) == [corpus.text(p) for p in asked]


def test_a_window_is_never_cut_short_at_the_streams_end() -> None:
    stream = torch.arange(10)
    windows = random_windows(stream, 300, 8, torch.Generator().manual_seed(0))
    assert windows.shape == (300, 8)
    assert all(w.tolist() == list(range(w[0], w[0] + 8)) for w in windows)


def test_windows_start_where_the_recipe_has_always_drawn_them_and_a_short_stream_is_refused() -> None:
    """Starts come from [0, len - length): the draws the shipped pair was trained with (the
    window ending at the last token is not drawn); a stream no longer than a window is a
    CorpusError, not torch's error about an empty range."""
    stream = torch.arange(10)
    windows = random_windows(stream, 300, 8, torch.Generator().manual_seed(0))
    assert sorted({w[0].item() for w in windows}) == [0, 1]
    assert all(torch.equal(w, torch.arange(w[0], w[0] + 8)) for w in windows)
    for short in (8, 5):
        with pytest.raises(CorpusError, match="too short"):
            random_windows(torch.arange(short), 2, 8, torch.Generator().manual_seed(0))


def pypi_stand_in(monkeypatch, asked: list) -> None:
    def urlopen(request, timeout):
        asked.append(request.full_url)
        name = request.full_url.rstrip("/").rsplit("/", 1)[-1]
        filename = (
            f"{name}-1.0-py3-none-any.whl" if name != "native" else "native-1.0-cp312-cp312-win_amd64.whl"
        )
        file = {
            "filename": filename,
            "url": f"https://files.example/{filename}",
            "hashes": {"sha256": "ab" * 32},
            "size": 10,
            "upload-time": "2026-01-01T00:00:00",
        }
        return io.BytesIO(json.dumps({"files": [file]}).encode())

    monkeypatch.setattr(corpus_module.urllib.request, "urlopen", urlopen)


def test_pin_asks_the_index_given_and_fails_with_code_2(tmp_path: Path, monkeypatch, capsys) -> None:
    asked: list[str] = []
    pypi_stand_in(monkeypatch, asked)
    lock = tmp_path / "lock.json"
    index = "https://mirror.example/simple"
    assert corpus_module.main(["--cutoff", "2026-11-01", "--index", index, "--out", str(lock), "pkg"]) == 0
    assert asked == [f"{index}/pkg/"] and json.loads(lock.read_text())["index"] == index
    capsys.readouterr()
    assert corpus_module.main(["--cutoff", "2026-11-01", "--out", str(tmp_path / "x.json"), "native"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: native: no pure-Python wheel before 2026-11-01") and "Traceback" not in err
