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

This module is the run: `train` takes the stages (stages.py) in order, skipping the finished
ones, and `main` is its command line, built from the `Recipe` fields (settings.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from ..checkpoint import load_target
from ..config.draft import LAST_LAYER_FEATURES
from ..demo import DEMO_DIR
from ..errors import CheckpointError, exit_with
from ..tokenizer import EOS_TOKEN
from .corpus import LOCK, fetch, read_lock
from .loops import Interrupted
from .pair import adopt_pair, target_differences
from .settings import DRAFT_ARCHS, Recipe
from .stages import (
    Run,
    draw_block_lengths,
    evaluate_pair,
    log,
    read_corpus,
    train_draft,
    train_target,
)

__all__ = ["Recipe", "draw_block_lengths", "main", "parse", "train"]

STAGES = ("target", "draft")  # "draft": the draft of the recipe's draft_arch


def check_finished_target(run: Run, eos_id: int) -> None:
    """A run resumed in a folder whose target is finished goes on only with the recipe that
    trained it: the draft is trained against it and the results name the recipe."""
    config = run.target_dir / "config.json"
    if not config.is_file():
        raise CheckpointError(
            f"{run.out}: work/target.json says the target is finished but {config} is missing; "
            "remove work/target.json to train it again"
        )
    differ = target_differences(run.target_dir, run.recipe, eos_id)
    if differ:
        raise CheckpointError(
            f"{run.out}: its finished target is not the one this recipe trains (config.json "
            f"differs in {', '.join(differ)}); resume with the recipe that trained it, or give "
            "another --out"
        )


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
    run = Run(recipe, out, device, deadline=None if max_minutes is None else t0 + 60 * max_minutes)
    run.work.mkdir(parents=True, exist_ok=True)
    if from_pair is not None:
        adopt_pair(from_pair, out, recipe, log)
    torch.manual_seed(recipe.seed)
    if device.startswith("cuda"):
        # reproducible on the GPU too: deterministic kernels where torch has them
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    data = read_corpus(run, corpus_cache, lock)
    corpus = data.corpus
    log(
        f"corpus {lock.name}: {len(corpus.train)} train files ({len(data.stream):,} tokens), "
        f"{len(corpus.heldout)} held-out files ({len(data.heldout_stream):,} tokens); "
        f"{time.perf_counter() - t0:.0f} s"
    )

    if not (run.work / "target.json").exists():
        train_target(run, data)
    else:  # a finished target: the one this recipe trains, or the run stops here
        check_finished_target(run, data.tokenizer.token_to_id(EOS_TOKEN))
    target_summary = json.loads((run.work / "target.json").read_text())
    if stop_after == "target":
        log(f"target done ({run.target_dir}); stopping as asked")
        return None
    target = load_target(run.target_dir, dtype=torch.float32, device=device)
    target.eval().requires_grad_(False)

    stage = recipe.draft_stage
    if not (run.work / f"{stage}.json").exists():
        train_draft(run, data, target)
    draft_summary = json.loads((run.work / f"{stage}.json").read_text())
    if stop_after == "draft":
        log(f"{stage} done ({run.draft_dir}); stopping as asked")
        return None

    results = evaluate_pair(run, data, target, target_summary, draft_summary)
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
    p.add_argument(
        "--last-layer-feature",
        choices=LAST_LAYER_FEATURES,
        default=None,
        help="the feature of the target's last layer, when listed: raw (its output; the "
        "default, as the shipped drafts were trained) or final_norm (after the final norm, "
        "Hugging Face's hidden_states[N]); the draft's config.json says which",
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
    if ns.max_minutes is not None and not (math.isfinite(ns.max_minutes) and ns.max_minutes >= 0):
        p.error(f"--max-minutes must be a finite number of minutes >= 0, got {ns.max_minutes}")
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
