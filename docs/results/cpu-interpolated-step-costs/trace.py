"""Per-step trace of the verify width `auto` at c16 on the demo pair: for each (rows, width)
bucket, the steps, the median real and table ms, the mean tokens committed and expected.

    REPO=$PWD PYTHONPATH=<tree> OMP_NUM_THREADS=1 python trace.py RUNS
"""

import collections
import os
import statistics
import sys
import time

import torch

from reference_engine.bench import BenchArgs, load_pair, make_engine, read_prompts, run_once

torch.set_num_threads(1)
D = os.path.join(os.environ.get("REPO", "."), "reference_engine/assets/demo")
argv = ["--model", f"{D}/target", "--draft", f"{D}/draft", "--prompts", f"{D}/heldout_prompts.jsonl"]
argv += ["--concurrency", "16", "--num-prompts", "32", "--output-len", "128", "--block-size", "8"]
argv += ["--commit-strategy", "per_token", "--measure-step-costs"]
args = BenchArgs.parse(argv)
target, (draft,) = load_pair(args)
prompts = read_prompts(args.prompts, args.model, 32)
engine = make_engine(target, draft, prompts, args, 16, None)
log = []
step_call = type(engine.speculative_step).__call__


def traced(self, seqs, width, **kwargs):
    memo = engine.verify_width.memo
    tokens = dict(memo[2]) if memo else None
    context = max(engine.state.lengths[s.slot] for s in seqs)
    start = time.perf_counter()
    out = step_call(self, seqs, width, **kwargs)
    seconds = time.perf_counter() - start
    log.append((len(seqs), width, seconds, sum(len(c.tokens) for c in out), tokens, context))
    return out


type(engine.speculative_step).__call__ = traced
for run in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    log.clear()
    run_once(engine, prompts, args, 16, None)
    costs = engine.verify_width.costs
    buckets = collections.defaultdict(list)
    for rows, width, seconds, got, tokens, context in log:
        bucket = 16 if rows == 16 else ("8-15" if rows >= 8 else "1-7")
        expected = tokens[width] if tokens else float("nan")
        buckets[bucket, width].append((seconds, got, expected, costs.of(rows, width), context))
    print(f"run {run}")
    print("rows width steps | ms real med | ms table med | tok real mean | tok est mean | ctx")
    for key in sorted(buckets, key=str):
        v = buckets[key]
        real = 1000 * statistics.median(x[0] for x in v)
        table = 1000 * statistics.median(x[3] for x in v)
        got, expected = statistics.mean(x[1] for x in v), statistics.mean(x[2] for x in v)
        print(
            key,
            len(v),
            f"{real:.1f} {table:.1f} {got:.1f} {expected:.1f} ctx {statistics.mean(x[4] for x in v):.0f}",
        )
