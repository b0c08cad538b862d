"""Engine-level benchmark: plain decode vs DFlash on one checkpoint pair, per concurrency.

    python scripts/bench_engine.py (--model DIR --draft DIR | --random-shape qwen3-8b)
        [--oracle-acceptance X] [--concurrency 1,4,8,16] [--out FILE.csv] ...

For each concurrency c the engine gets `--num-prompts` requests (default c)
of `--input-len` random prompt tokens and `--output-len` output tokens (EOS ignored), all
queued at once, with c slots. Plain and DFlash runs alternate, `--repeats` times each
after one warm-up pair; the table and CSV give medians over the repeats.

Columns: output_tokens_per_s = all output tokens / wall time of the run (prefill
included); mean_acceptance_length = committed tokens per DFlash step, bonus included;
ms_<phase> = milliseconds spent in that phase over the whole run (CUDA-event time on a
GPU, monotonic host time on a CPU), phases as in stats.PHASES.

With --oracle-acceptance X the draft still runs, but its proposals are replaced by the
plain run's outputs and each step accepts a scheduled count, mean acceptance length X
(forced: random bfloat16 weights do not reproduce a plain continuation under the verify
kernels, see spec.OracleProposer; random weights are otherwise accepted about never).
The output of forced runs is not lossless; the gates check losslessness, this measures
cost.
"""

from __future__ import annotations

import argparse
import csv
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from .checkpoint import DTYPES, load_draft, load_target, parse_dtype
from .commit import COMMIT_STRATEGIES
from .engine import Engine, EngineConfig
from .errors import ReferenceEngineError
from .request import SamplingParams
from .shapes import TARGET_SHAPES, random_pair
from .spec import OracleProposer
from .stats import PHASES


@dataclass(frozen=True)
class BenchArgs:
    model: str | None
    draft: str | None
    random_shape: str | None
    oracle_acceptance: float | None
    concurrency: tuple[int, ...]
    num_prompts: int | None
    input_len: int
    output_len: int
    block_size: int | None
    commit_strategy: str
    dtype: str | None
    device: str
    repeats: int
    seed: int
    out: str | None

    @classmethod
    def parse(cls, argv: list[str] | None) -> BenchArgs:
        p = argparse.ArgumentParser(prog="python scripts/bench_engine.py",
                                    description=__doc__.split("\n\n")[0])
        p.add_argument("--model", help="target checkpoint directory")
        p.add_argument("--draft", help="DFlash draft directory")
        p.add_argument("--random-shape", choices=sorted(TARGET_SHAPES),
                       help="random-weight target and 5-layer block-16 draft of a real shape")
        p.add_argument("--oracle-acceptance", type=float, default=None,
                       help="replace proposals to reach this mean acceptance length")
        p.add_argument("--concurrency", default="1,4,8,16")
        p.add_argument("--num-prompts", type=int, default=None)
        p.add_argument("--input-len", type=int, default=128)
        p.add_argument("--output-len", type=int, default=128)
        p.add_argument("--block-size", type=int, default=None)
        p.add_argument("--commit-strategy", default="replay", choices=COMMIT_STRATEGIES)
        p.add_argument("--dtype", default=None, choices=list(DTYPES),
                       help="default: bfloat16 on cuda, float32 on cpu")
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", help="CSV file for the per-(mode, concurrency) rows")
        ns = p.parse_args(argv)
        if (ns.random_shape is None) == (ns.model is None):
            p.error("give either --model DIR --draft DIR or --random-shape NAME")
        if ns.model is not None and ns.draft is None:
            p.error("--model needs --draft")
        try:
            ns.concurrency = tuple(int(c) for c in ns.concurrency.split(","))
        except ValueError:
            p.error(f"--concurrency must be comma-separated integers, got {ns.concurrency!r}")
        if any(c <= 0 for c in ns.concurrency) or ns.repeats <= 0:
            p.error("--concurrency values and --repeats must be positive")
        return cls(**vars(ns))


def load_pair(args: BenchArgs):
    dtype = parse_dtype(args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    if args.random_shape:
        block = args.block_size or 16
        return random_pair(args.random_shape, args.device, dtype, args.seed, block_size=block)
    target = load_target(args.model, dtype=dtype, device=args.device)
    return target, load_draft(args.draft, target)


def make_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def run_once(target, draft, prompts, args: BenchArgs, concurrency: int,
             continuations: list[list[int]] | None) -> dict:
    """One run to completion. With `draft` None: plain decode. Returns the row and outputs."""
    config = EngineConfig(max_num_seqs=concurrency, block_size=args.block_size,
                          commit_strategy=args.commit_strategy,
                          max_model_len=args.input_len + args.output_len)
    engine = Engine(target, draft, config)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    block = engine.block_size
    vocab = target.config.vocab_size
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        oracle = None
        if draft is not None and continuations is not None:
            oracle = OracleProposer.for_mean_acceptance(continuations[i],
                                                        args.oracle_acceptance, block, vocab,
                                                        forced=True)
        engine.add_request(str(i), prompt, params, oracle=oracle)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    wall = time.perf_counter() - start
    outputs = [engine.collect(str(i)).output_ids for i in range(len(prompts))]
    stats = engine.stats()
    phases = stats["phases"]
    kind = "device_s_" if engine.device.type == "cuda" else "host_s_"
    total = sum(len(o) for o in outputs)
    row = {
        "mode": "plain" if draft is None else "dflash",
        "concurrency": concurrency,
        "output_tokens_per_s": total / wall,
        "mean_acceptance_length": stats["spec"]["mean_acceptance_length"] if draft else 1.0,
        **{f"ms_{phase}": 1000 * phases.get(kind + phase, 0.0) for phase in PHASES},
        "steps": steps,
        "output_tokens": total,
        "wall_s": wall,
    }
    return {"row": row, "outputs": outputs}


def median_row(rows: list[dict]) -> dict:
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(r[key] for r in rows)
    out["repeats"] = len(rows)
    return out


def benchmark(args: BenchArgs) -> list[dict]:
    target, draft = load_pair(args)
    device = str(target.model.embed_tokens.weight.device)
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor()
    print(f"# device {device} ({gpu}), dtype {target.model.embed_tokens.weight.dtype}, "
          f"{args.random_shape or args.model}", flush=True)
    rows = []
    for c in args.concurrency:
        count = args.num_prompts or c
        prompts = make_prompts(target.config.vocab_size, count, args.input_len, args.seed + c)
        warm = run_once(target, None, prompts[:c], args, c, None)  # compile caches, allocator
        run_once(target, draft, prompts[:c], args, c,
                 warm["outputs"] if args.oracle_acceptance else None)
        plain_rows, spec_rows = [], []
        for r in range(args.repeats):
            plain = run_once(target, None, prompts, args, c, None)
            plain_rows.append(plain["row"])
            continuations = plain["outputs"] if args.oracle_acceptance else None
            spec_rows.append(run_once(target, draft, prompts, args, c, continuations)["row"])
            print(f"  c={c} repeat {r + 1}/{args.repeats}: plain "
                  f"{plain_rows[-1]['output_tokens_per_s']:.1f} tok/s, dflash "
                  f"{spec_rows[-1]['output_tokens_per_s']:.1f} tok/s, acceptance length "
                  f"{spec_rows[-1]['mean_acceptance_length']:.2f}", flush=True)
        rows += [median_row(plain_rows), median_row(spec_rows)]
        if args.out:  # after every concurrency, so an interrupted run keeps what it measured
            write_csv(args.out, rows)
    return rows


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def print_table(rows: list[dict]) -> None:
    cols = ["mode", "concurrency", "output_tokens_per_s", "mean_acceptance_length",
            *[f"ms_{p}" for p in PHASES]]
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c])
                         for c in cols))


def main(argv: list[str] | None = None) -> int:
    args = BenchArgs.parse(argv)
    try:
        rows = benchmark(args)
    except ReferenceEngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_table(rows)
    if args.out:
        print(f"wrote {args.out}")
    return 0
