"""The demo pair shipped inside the package: a small trained Qwen3.5 hybrid target, its
DFlash draft and a DFlash2 draft (reference_engine/assets/demo, trained by
scripts/train_demo_pair.py; see its MODEL_CARD.md). The default of `make bench`, `make
profile` and docs/demo-pair.md's quick start."""

from __future__ import annotations

import json
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "assets" / "demo"
DEMO_TARGET = DEMO_DIR / "target"
DEMO_DRAFT = DEMO_DIR / "draft"
DEMO_DRAFT2 = DEMO_DIR / "draft-dflash2"  # a DFlash2 draft of the same target (training-dflash2.json)
DEMO_PROMPTS = DEMO_DIR / "heldout_prompts.jsonl"  # one per held-out file: prompt, prompt_ids
DEMO_RESULTS = DEMO_DIR / "training.json"


def demo_prompts(path: Path = DEMO_PROMPTS) -> list[dict]:
    """The held-out prompts: dicts with `file`, `prompt` (text) and `prompt_ids`."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
