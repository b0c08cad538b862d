"""Draft tokens accepted a step by the demo pair's DFlash draft at block sizes 2-16, over its
held-out prompts (one request at a time, float32 on the CPU, every step verifying its whole
block): how many of a step's first W proposals were accepted, on average, for W = 1, 2, 3,
4, 7. A block of W + 1 is what `--draft-span verify` drafts for a step of width W.

    python docs/results/cpu-draft-span/acceptance.py [PROMPTS] [BLOCK_SIZES]   # 48 2,3,4,5,8,16
"""

from __future__ import annotations

import json
import sys

import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.demo import DEMO_DRAFT, DEMO_PROMPTS, DEMO_TARGET
from reference_engine.runtime.engine import EngineConfig
from reference_engine.runtime.one_request import generate_speculative
from reference_engine.runtime.request import SamplingParams


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 48
    sizes = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "2,3,4,5,8,16").split(",")]
    torch.set_num_threads(1)
    target = load_target(DEMO_TARGET, dtype=torch.float32, device="cpu")
    draft = load_draft(DEMO_DRAFT, target)
    with open(DEMO_PROMPTS) as f:
        prompts = [json.loads(line)["prompt_ids"] for line in f][:count]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for block in sizes:
        accepted = []  # draft tokens each step accepted (its last step, cut at max_tokens, left out)
        for prompt in prompts:
            result = generate_speculative(target, draft, prompt, params, EngineConfig(block_size=block))
            accepted += [n - 1 for n in result.acceptance_lengths[:-1]]
        steps = len(accepted)
        within = " ".join(f"W<={w}: {sum(min(a, w) for a in accepted) / steps:.3f}" for w in (1, 2, 3, 4, 7))
        print(f"B={block:2d} steps={steps:5d} accepted={sum(accepted) / steps:.3f} {within}", flush=True)


if __name__ == "__main__":
    main()
