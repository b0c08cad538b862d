"""The recipe's stages, in the order a run takes them: the corpus and its tokenizer
(`read_corpus`), the target (`train_target`), the target's greedy continuations that the
draft learns from (`continuations`), the draft (`train_draft`), and the evaluation of what
was written with the results file and model card (`evaluate_pair`).

A training stage leaves its model folder and `work/<stage>.json` in the run's output folder;
recipe.py's `train` skips a stage that has them. Each stage draws from its own generator
(`generator`), so that skipping a finished stage draws the same batches in the next one as an
uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ..checkpoint import load_draft, write_safetensors
from ..config import DraftConfig, TargetConfig
from ..demo import DEMO_PROMPTS
from ..models import build_target
from ..models.dflash import DFlashDraft
from ..models.dflash2 import DFlash2Draft
from ..tokenizer import EOS_TOKEN, MASK_TOKEN, save_tokenizer
from .corpus import Corpus, random_windows, read_lock, sha256_of, token_stream, train_tokenizer
from .evaluation import evaluate, heldout_prompts, mean_tail, model_card
from .loops import (
    Checkpoint,
    anchor_tokens,
    block_hidden,
    block_labels,
    block_loss,
    greedy_continue,
    init_weights,
    lm_loss,
    loss_curve,
    optimise,
    target_views,
)
from .selector import selector_loss
from .settings import Recipe

CARD_FILE = "MODEL_CARD.md"


def log(message: str) -> None:
    print(message, flush=True)


@dataclass(frozen=True)
class Run:
    """What every stage of one run reads: its settings, its output folder, its device and the
    time past which a training loop writes a checkpoint and stops."""

    recipe: Recipe
    out: Path
    device: str
    deadline: float | None  # on time.perf_counter()'s clock; None: no limit

    @property
    def work(self) -> Path:
        return self.out / "work"

    @property
    def target_dir(self) -> Path:
        return self.out / "target"

    @property
    def draft_dir(self) -> Path:
        return self.out / self.recipe.draft_stage


@dataclass(frozen=True)
class TrainingData:
    """The corpus of a run as its stages read it: the split files, the tokenizer trained on
    the train files, and both splits as token streams."""

    corpus: Corpus
    lock: Path
    tokenizer: Tokenizer
    stream: torch.Tensor  # [train tokens]
    heldout_stream: torch.Tensor  # [held-out tokens]


def generator(seed: int, stage: int) -> torch.Generator:
    """One generator per stage, so that skipping a finished stage draws the same batches
    in the next one as an uninterrupted run."""
    return torch.Generator().manual_seed(seed * 1000 + stage)


def draw_block_lengths(recipe: Recipe, count: int, gen: torch.Generator) -> torch.Tensor:
    """Block lengths as the engine drafts them: a full block of a size in use, or, for a
    share of blocks, a request's shorter last block."""
    sizes = torch.tensor(recipe.train_block_sizes)
    full = sizes[torch.randint(0, len(sizes), (count,), generator=gen)]
    short = torch.randint(2, recipe.block_size + 1, (count,), generator=gen)
    return torch.where(torch.rand(count, generator=gen) < recipe.short_block_share, short, full)


def read_corpus(run: Run, corpus_cache: Path, lock: Path) -> TrainingData:
    """The locked corpus, fetched into `corpus_cache` when missing, and its tokenizer: the one
    in `work/` when a run before this one trained it, else trained now and saved there."""
    recipe = run.recipe
    corpus = Corpus.from_lock(corpus_cache, lock, recipe.max_files, log)
    train_texts = corpus.texts(corpus.train)
    tokenizer_file = run.work / "tokenizer.json"
    if tokenizer_file.exists():
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    else:
        tokenizer = train_tokenizer(train_texts, recipe.vocab_size, recipe.tokenizer_chars)
        tokenizer.save(str(tokenizer_file))
    stream = token_stream(tokenizer, train_texts)
    heldout_stream = token_stream(tokenizer, corpus.texts(corpus.heldout))
    heldout_prompts(corpus, tokenizer, recipe)  # a corpus without one fails before training
    return TrainingData(corpus, lock, tokenizer, stream, heldout_stream)


def train_target(run: Run, data: TrainingData) -> None:
    """A causal LM on random windows of the train stream, keeping the weights with the best
    held-out loss; writes `target/` (bfloat16 weights, config.json, tokenizer) and
    `work/target.json`."""
    recipe, device, work, target_dir = run.recipe, run.device, run.work, run.target_dir
    target_raw = recipe.target_config(data.tokenizer.token_to_id(EOS_TOKEN))
    gen = generator(recipe.seed, 1)
    target = build_target(TargetConfig.from_hf(target_raw))
    init_weights(target, recipe.target_layers, recipe.seed)
    target.to(device)
    t1 = time.perf_counter()
    probe = random_windows(data.heldout_stream, 64, recipe.seq_len + 1, generator(recipe.seed, 0)).to(device)
    fit = optimise(
        target,
        recipe.target_steps,
        recipe.target_lr,
        lambda step: lm_loss(
            target, random_windows(data.stream, recipe.target_batch, recipe.seq_len + 1, gen).to(device)
        ),
        log,
        "target",
        validate=lambda: lm_loss(target, probe).item(),
        validate_every=recipe.validate_every,
        checkpoint=Checkpoint(work, "target"),
        checkpoint_every=recipe.checkpoint_every,
        generator=gen,
        deadline=run.deadline,
    )
    # the shipped form (bfloat16) is what the draft trains against and what is served
    write_safetensors(target_dir, {n: t.to(torch.bfloat16).cpu() for n, t in target.state_dict().items()})
    (target_dir / "config.json").write_text(json.dumps(target_raw, indent=2) + "\n")
    save_tokenizer(data.tokenizer, target_dir)
    summary = {
        "final_loss": mean_tail(fit["losses"]),
        "kept_step": fit["best_step"],
        "heldout_loss": fit["best_score"],
        "curve": loss_curve(fit["losses"]),
        "seconds": time.perf_counter() - t1,
        "parameters": sum(p.numel() for p in target.parameters()),
    }
    (work / "target.json").write_text(json.dumps(summary, indent=2) + "\n")
    Checkpoint(work, "target").remove()


def continuations(
    run: Run, data: TrainingData, target: torch.nn.Module
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's greedy continuations of random train-stream prompts, with the target's
    views of them: (sequences [continuations, seq_len], the features of the draft's target
    layers at every position, the target's greedy token at every position)."""
    recipe, device = run.recipe, run.device
    t2 = time.perf_counter()
    prompt_gen = generator(recipe.seed, 2)
    new_tokens = recipe.seq_len - recipe.prompt_len
    chunks = []
    for begin in range(0, recipe.continuations, 4096):
        count = min(4096, recipe.continuations - begin)
        prompts = random_windows(data.stream, count, recipe.prompt_len, prompt_gen).to(device)
        chunks.append(greedy_continue(target, prompts, new_tokens))
    sequences = torch.cat(chunks)  # [continuations, seq_len]
    features, greedy = target_views(target, sequences, recipe.target_layer_ids, recipe.raw_last_layer)
    log(f"continuations: {len(sequences)} x {new_tokens} tokens, {time.perf_counter() - t2:.0f} s")
    return sequences, features, greedy


def train_draft(run: Run, data: TrainingData, target: torch.nn.Module) -> None:
    """The draft of the recipe's draft_arch: blocks at anchors inside the target's own greedy
    continuations (`continuations`), against the frozen (shipped) target; a DFlash2 draft adds
    the selector loss. Writes the draft's folder (bfloat16 weights, config.json) and
    `work/<draft stage>.json`."""
    recipe, device, work, stage = run.recipe, run.device, run.work, run.recipe.draft_stage
    draft_raw = recipe.draft_config(data.tokenizer.token_to_id(MASK_TOKEN))
    t2 = time.perf_counter()
    sequences, features, greedy = continuations(run, data, target)

    config = DraftConfig.from_hf(draft_raw)
    draft = DFlash2Draft(config) if config.is_dflash2 else DFlashDraft(config)
    init_weights(draft, recipe.draft_layers, recipe.seed + 1)
    draft.to(device)
    t3 = time.perf_counter()
    gen = generator(recipe.seed, 3)  # the same blocks for either architecture
    blocks = recipe.draft_batch * recipe.anchors_per_seq

    def draft_loss(step: int) -> torch.Tensor | dict[str, torch.Tensor]:
        rows = torch.randint(0, len(sequences), (recipe.draft_batch,), generator=gen)
        # anchors from the first generated token on (the first block an engine drafts)
        anchors = torch.randint(
            recipe.prompt_len,
            recipe.seq_len - recipe.block_size + 1,
            (recipe.draft_batch, recipe.anchors_per_seq),
            generator=gen,
        )
        lengths = draw_block_lengths(recipe, blocks, gen)
        rows, anchors, lengths = rows.to(device), anchors.to(device), lengths.to(device)
        seqs = sequences[rows]
        hidden = block_hidden(draft, target, seqs, features[rows], anchors, lengths)[:, 1:]
        logits = draft.logits(hidden, target.lm_head_weight)
        labels = block_labels(greedy[rows], anchors, recipe.block_size)
        token = block_loss(logits, labels, lengths, recipe.position_decay)
        if not config.is_dflash2:
            return token
        selector, recall = selector_loss(
            draft, hidden, logits, labels, anchor_tokens(seqs, anchors), lengths, recipe.position_decay
        )
        loss = token + recipe.selector_loss_weight * selector
        return {"loss": loss, "token_loss": token, "selector_loss": selector, "candidate_recall": recall}

    fit = optimise(
        draft,
        recipe.draft_steps,
        recipe.draft_lr,
        draft_loss,
        log,
        stage,
        checkpoint=Checkpoint(work, stage),
        checkpoint_every=recipe.checkpoint_every,
        generator=gen,
        deadline=run.deadline,
    )
    draft_dir = run.draft_dir
    write_safetensors(draft_dir, {n: t.to(torch.bfloat16).cpu() for n, t in draft.state_dict().items()})
    (draft_dir / "config.json").write_text(json.dumps(draft_raw, indent=2) + "\n")
    summary = {
        "final_loss": mean_tail(fit["losses"]),
        "curve": loss_curve(fit["losses"]),
        "seconds": time.perf_counter() - t3,
        "continuation_seconds": t3 - t2,
        "parameters": sum(p.numel() for p in draft.parameters()),
    }
    for name, values in fit["terms"].items():  # DFlash2: the token and selector terms
        summary[f"final_{name}"] = mean_tail(values)
        summary[f"{name}_curve"] = loss_curve(values)
    (work / f"{stage}.json").write_text(json.dumps(summary, indent=2) + "\n")
    Checkpoint(work, stage).remove()


def evaluate_pair(
    run: Run, data: TrainingData, target: torch.nn.Module, target_summary: dict, draft_summary: dict
) -> dict:
    """Acceptance on held-out prompts of what was written, as the engine loads it (and of the
    DFlash draft beside a DFlash2 one); writes the prompts, the results file (every figure of
    the run, from the two stages' summaries) and, for a DFlash run, the model card. Returns
    the results."""
    recipe, device, out = run.recipe, run.device, run.out
    corpus, lock, stage = data.corpus, data.lock, recipe.draft_stage
    prompts = heldout_prompts(corpus, data.tokenizer, recipe)
    with open(out / DEMO_PROMPTS.name, "w") as f:
        for row in prompts:
            f.write(json.dumps(row) + "\n")
    t4 = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False  # evaluate in true float32
    torch.backends.cudnn.allow_tf32 = False
    prompt_ids = [p["prompt_ids"] for p in prompts]

    def measure(folder: Path, what: str) -> dict:
        acceptance = evaluate(
            target, load_draft(folder, target), prompt_ids, recipe.eval_block_sizes, recipe.eval_max_tokens
        )
        for B, row in acceptance.items():
            log(
                f"held-out acceptance, {what}, B={B}: mean length {row['mean_acceptance_length']:.2f}, "
                f"{row['mismatched_requests']} of {len(prompts)} requests differ from plain"
            )
        return {str(B): row for B, row in acceptance.items()}

    acceptance = measure(run.draft_dir, recipe.draft_arch)
    # a DFlash2 run measures the DFlash draft beside it, on the same prompts in the same run
    dflash_dir = out / "draft"
    compared = measure(dflash_dir, "dflash") if stage != "draft" and dflash_dir.is_dir() else None

    results = {
        "recipe": dataclasses.asdict(recipe),
        "device": (
            torch.cuda.get_device_name() if device.startswith("cuda") else f"a CPU ({platform.machine()})"
        ),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "corpus": {
            "lock": lock.name,
            "lock_sha256": sha256_of(lock),
            "wheels": len(read_lock(lock)),
            "train_files": len(corpus.train),
            "heldout_files": len(corpus.heldout),
            "train_tokens": len(data.stream),
            "heldout_tokens": len(data.heldout_stream),
            "heldout_packages": sorted(w.name for w in read_lock(lock) if w.heldout),
        },
        "parameters": {
            "target": target_summary.pop("parameters"),
            "draft_own": draft_summary.pop("parameters"),
        },
        "target": target_summary,
        "draft": draft_summary,
        "acceptance": acceptance,
        "eval": {
            "prompts": len(prompts),
            "max_tokens": recipe.eval_max_tokens,
            "dtype": "float32",
            "seconds": time.perf_counter() - t4,
        },
        "seconds": {
            "target": target_summary["seconds"],
            "continuations": draft_summary["continuation_seconds"],
            "draft": draft_summary["seconds"],
        },
    }
    if compared is not None:
        results["acceptance_dflash"] = compared
    results["seconds"]["eval"] = results["eval"]["seconds"]
    (out / recipe.results_file).write_text(json.dumps(results, indent=2) + "\n")
    if stage == "draft":  # the card describes the pair: its target and DFlash draft
        (out / CARD_FILE).write_text(model_card(results))
    return results
