"""Where a step's GPU time goes, kernel by kernel: the draft forward, the verify forward (with
its argmax) and a plain decode step of a random target of a real shape, run eagerly (so the
profiler sees every kernel) at given rows x verify widths, exact numerics. Prints the GPU
milliseconds of each part per call and its twelve most costly kernels.

    python scripts/profile_step.py --random-shape qwen3-8b --cases 4x7,4x15,16x3
    python scripts/profile_step.py --random-shape qwen3.5-4b --commit-strategy per_token --cases 16x7
    python scripts/profile_step.py --random-shape qwen3.5-35b-a3b --prefill 128

`--prefill N` also profiles the prefill of one N-token prompt (with the draft's context from it).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from reference_engine.bench.shapes import TARGET_SHAPES, random_pair
from reference_engine.runtime.engine import Engine
from reference_engine.runtime.engine_config import EngineConfig
from reference_engine.runtime.verify_width import timing_ids

BLOCK = 16
CALLS = 5


def parse_cases(text: str) -> list[tuple[int, int]]:
    try:
        cases = [tuple(int(n) for n in case.split("x")) for case in text.split(",")]
    except ValueError:
        raise SystemExit(f"--cases: expected ROWSxWIDTH[,ROWSxWIDTH...], got '{text}'") from None
    for case in cases:
        if len(case) != 2 or case[0] < 1 or not 0 < case[1] < BLOCK:
            raise SystemExit(f"--cases: {case}: ROWSxWIDTH with rows >= 1 and width 1..{BLOCK - 1}")
    return cases


def profiled(fn, label: str) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) / CALLS / 1000
    print(f"== {label}: {total:.3f} ms GPU per call", flush=True)
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
        print(f"   {e.self_device_time_total / CALLS / 1000:7.3f} ms {e.count // CALLS:5d}x  {e.key[:100]}")


def profile_case(runner, label: str, vocab: int, rows: int, width: int) -> None:
    slots = torch.arange(rows, device="cuda")
    block = timing_ids(rows, BLOCK, vocab, "cuda")
    positions = torch.arange(BLOCK, device="cuda")[None].repeat(rows, 1)
    valid = torch.full((rows,), width + 1, dtype=torch.int64, device="cuda")
    label = f"{label} {rows}x{width}"
    full = torch.full_like(valid, BLOCK)
    profiled(lambda: runner.propose(block, positions, slots, full, BLOCK), f"{label} draft")
    verify = block[:, : width + 1], positions[:, : width + 1], slots, valid, width + 1, True
    profiled(lambda: runner.ops.greedy(runner.verify(*verify).logits), f"{label} verify")
    profiled(lambda: runner.decode(block[:, :1], positions[:, :1], slots, 1), f"{label} decode")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--random-shape", required=True, choices=sorted(TARGET_SHAPES))
    p.add_argument("--commit-strategy", default="replay")
    p.add_argument("--cases", default="", help="rows x verify width, e.g. 4x7,16x3")
    p.add_argument("--prefill", type=int, default=0, help="also profile a prefill of this many tokens")
    args = p.parse_args()
    if not args.cases and args.prefill <= 0:
        raise SystemExit("give --cases, --prefill N (N >= 1), or both")
    if not torch.cuda.is_available():
        sys.exit("profile_step.py: needs a CUDA device")
    cases = parse_cases(args.cases) if args.cases else []
    target, draft = random_pair(args.random_shape, "cuda")
    config = EngineConfig(
        max_num_seqs=max([rows for rows, _ in cases] + [1]),
        block_size=BLOCK,
        commit_strategy=args.commit_strategy,
        max_model_len=max(512, args.prefill + 2 * BLOCK),
        numerics="exact",
        enforce_eager=True,
        verify_width="fixed",
    )
    runner = Engine(target, draft, config).runner
    if args.prefill > 0:
        ids = timing_ids(1, args.prefill, target.config.vocab_size)[0].tolist()
        label = f"{args.random_shape} prefill {args.prefill}"
        profiled(lambda: runner.prefill(ids, 0, 0, speculative=True), label)
    for rows, width in cases:
        label = f"{args.random_shape} {args.commit_strategy}"
        profile_case(runner, label, target.config.vocab_size, rows, width)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
