"""Steady step costs on the CPU at fixed verify widths: the demo pair, 16 requests of 400
tokens, float32, one thread, `per_token` commit, B = 8. Each width: a fresh engine, 3 steps
after prefill untimed, then 25 timed steps (median wall time, tokens per step, phase times).

    python docs/results/cpu-per-token-written-rows/steps.py 16 0,3,7

Width 0 is a plain step of the DFlash engine; `p` a plain engine's decode step. Run it with
PYTHONPATH pointing at the tree to measure (from the repository root).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.runtime.engine import Engine
from reference_engine.runtime.engine_config import EngineConfig
from reference_engine.runtime.request import SamplingParams

DEMO = "reference_engine/assets/demo"
WARM, TIMED = 3, 25


def measure(target, draft, prompts: list[list[int]], rows: int, width: int | None) -> None:
    """One engine at `width` (None: plain decode, no draft)."""
    config = EngineConfig(
        max_num_seqs=rows,
        max_model_len=1024,
        block_size=None if width is None else 8,
        commit_strategy="per_token",
        verify_width="fixed",
    )
    engine = Engine(target, None if width is None else draft, config)
    if width is not None:
        engine.verify_width.choose = lambda *args: width
    for i in range(rows):
        engine.add_request(str(i), prompts[i % len(prompts)], SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(WARM):
        engine.step()
    engine.timer.reset()

    def tokens() -> int:
        return sum(len(engine.get(str(i)).output_ids) for i in range(rows))

    before, times = tokens(), []
    for _ in range(TIMED):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    made = tokens() - before
    label = "plain" if width is None else f"width {width}"
    print(
        f"{label:8s}: step {1000 * statistics.median(times):6.2f} ms, tokens/step {made / TIMED:5.2f}, "
        f"tok/s {made / sum(times):7.1f}",
        flush=True,
    )
    phases = engine.timer.as_dict()
    print(
        "   phases ms/step:",
        ", ".join(f"{k[7:]} {1000 * v / TIMED:.2f}" for k, v in phases.items() if k.startswith("host_s")),
    )


def main() -> None:
    torch.set_num_threads(1)
    rows = int(sys.argv[1])
    widths = [None if w == "p" else int(w) for w in sys.argv[2].split(",")]
    with open(f"{DEMO}/heldout_prompts.jsonl") as f:
        prompts = [json.loads(line)["prompt_ids"] for line in f]
    target = load_target(f"{DEMO}/target", dtype=torch.float32, device=torch.device("cpu"))
    draft = load_draft(f"{DEMO}/draft", target)
    for width in widths:
        measure(target, draft, prompts, rows, width)


if __name__ == "__main__":
    main()
