"""Acceptance of drafts for the demo target on its held-out prompts, as the recipe measures
it (reference_engine/training/evaluation.py): all prompts in one continuous batch, 128 greedy
output tokens, per_token commit, every draft token verified, float32.

    python scripts/eval_demo_drafts.py reference_engine/assets/demo/draft \
        reference_engine/assets/demo/draft-dflash2 [--out acceptance.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from reference_engine.checkpoint import load_draft, load_target  # noqa: E402
from reference_engine.demo import DEMO_PROMPTS, DEMO_TARGET, demo_prompts  # noqa: E402
from reference_engine.engine_args import resolve_device  # noqa: E402
from reference_engine.errors import ReferenceEngineError  # noqa: E402
from reference_engine.training.evaluation import evaluate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python scripts/eval_demo_drafts.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("drafts", nargs="+", type=Path, help="draft folders for the demo target")
    p.add_argument("--target", type=Path, default=DEMO_TARGET)
    p.add_argument(
        "--prompts", type=Path, default=DEMO_PROMPTS, help="held-out prompts (prompt_ids per line)"
    )
    p.add_argument("--block-sizes", default="4,8,16")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, help="JSON file for the figures")
    args = p.parse_args(argv)
    try:
        block_sizes = tuple(int(b) for b in args.block_sizes.split(","))
    except ValueError:
        p.error(f"--block-sizes must be comma-separated integers, got {args.block_sizes!r}")
    if min(block_sizes) < 2:
        p.error(f"--block-sizes must each be at least 2, got {args.block_sizes!r}")
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be positive, got {args.max_tokens}")
    torch.backends.cuda.matmul.allow_tf32 = False  # true float32 on a GPU too
    try:
        if args.out is not None and not args.out.resolve().parent.is_dir():  # before the evaluation
            raise ReferenceEngineError(f"--out {args.out}: no folder {args.out.parent} to write it in")
        target = load_target(args.target, torch.float32, resolve_device(args.device))
        prompts = [row["prompt_ids"] for row in demo_prompts(args.prompts)]
        drafts = [(folder, load_draft(folder, target)) for folder in args.drafts]
    except (ReferenceEngineError, OSError, KeyError, ValueError) as e:  # ValueError: a line not JSON
        print(f"eval_demo_drafts.py: {e}", file=sys.stderr)
        return 2
    results = {}
    for folder, draft in drafts:
        start = time.perf_counter()
        acceptance = evaluate(target, draft, prompts, block_sizes, args.max_tokens)
        for B, row in acceptance.items():
            print(
                f"{folder}: B={B}: mean acceptance length {row['mean_acceptance_length']:.3f}, "
                f"acceptance rate {row['acceptance_rate']:.3f}, "
                f"{row['mismatched_requests']} of {len(prompts)} requests differ from plain",
                flush=True,
            )
        print(f"{folder}: {time.perf_counter() - start:.0f} s", flush=True)
        results[str(folder)] = {str(B): row for B, row in acceptance.items()}
    if args.out is not None:
        meta = {"machine": platform.machine(), "torch": torch.__version__, "device": args.device}
        args.out.write_text(json.dumps({**meta, "acceptance": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
