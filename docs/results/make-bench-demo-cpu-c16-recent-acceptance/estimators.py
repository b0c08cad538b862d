"""How well a request's own acceptance counts predict its next step, on the demo pair.

Runs the demo target with a shipped draft (argv[1]: draft or draft-dflash2) at c16 on the
CPU, every step verifying the full block of 8 (`--verify-width fixed`), 16 requests at a time
over three passes of the 32 held-out prompts (128 tokens each); records each row's committed
tokens a step, then replays the counts through the verify width's estimate
(`verify_width.prefix_rates`, the engine-wide rates as prior) for counts of every step alike
(prior weight 4, the estimate before this change; and no own counts at all) and for counts
decayed by gamma a step (prior weight w). Prints the mean expected tokens a row, the mean
committed, the bias, the squared error a row and the relative error of a step's sum (RMS), for
steps of 12-16 rows and for the steps of 1-11 rows as the last wave drains.

    python docs/results/make-bench-demo-cpu-c16-recent-acceptance/estimators.py draft
"""

import collections
import json
import statistics
import sys

import torch

from reference_engine.runtime import verify_width as V
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.stats import SpecCounters
from reference_engine.serving.args import ServeArgs
from reference_engine.serving.engine_build import build_engine

torch.set_num_threads(1)
D = "reference_engine/assets/demo"
W = 7
draft = sys.argv[1] if len(sys.argv) > 1 else "draft"
args = ServeArgs.parse(
    ["--model", f"{D}/target", "--dflash-draft-model-path", f"{D}/{draft}", "--block-size", "8",
     "--commit-strategy", "per_token", "--max-num-seqs", "16", "--verify-width", "fixed", "--threads", "1"]
)  # fmt: skip
engine, _, _ = build_engine(args)
prompts = [json.loads(line) for line in open(f"{D}/heldout_prompts.jsonl")]
added = 0


def add() -> None:
    global added
    p = prompts[added % len(prompts)]
    added += 1
    engine.add_request(f"r{added}", p["prompt_ids"], SamplingParams(max_tokens=128, ignore_eos=True))


for _ in range(16):
    add()
order = []  # a step: (request id, tokens it committed)
while added < 16 + 3 * len(prompts) or engine.has_unfinished():
    step = []
    for out in engine.step():
        step.append((out.request_id, len(out.new_token_ids)))
        if out.finished:
            engine.collect(out.request_id)
            if added < 16 + 3 * len(prompts):
                add()
    order.append(step)


def replay(gamma: float, weight: float) -> tuple[float, ...]:
    totals = SpecCounters()
    own = collections.defaultdict(lambda: [collections.Counter(), collections.Counter()])
    seen, preds, acts, sums = set(), [], [], {"12-16 rows": [], "1-11 rows": []}
    made = collections.Counter()  # tokens each request has
    for step in order:
        prior = V.engine_rates(totals, W)
        predicted = committed = 0.0
        done = []
        for rid, n in step:
            made[rid] += n
            if rid not in seen:  # the prefill's first token
                seen.add(rid)
                continue
            a, v = own[rid]
            limit = min(W, 128 - (made[rid] - n) - 1)  # the draft tokens it can still commit
            product, e = 1.0, 1.0
            for j, p in enumerate(prior[:limit], 1):
                product *= (a[j] + weight * p) / (v[j] + weight)
                e += product
            preds.append(e)
            acts.append(n)
            predicted, committed = predicted + e, committed + n
            done.append((rid, n - 1))
        for rid, acc in done:  # a step cut at max_tokens counts its kept tokens as accepted
            a, v = own[rid]
            for counts in (a, v):
                for j in counts:
                    counts[j] *= gamma
            for k in range(1, acc + 1):
                a[k] += 1
            for k in range(1, min(W, acc + 1) + 1):
                v[k] += 1
            totals.record(W, acc, acc + 1)
        if predicted:
            sums["12-16 rows" if len(done) >= 12 else "1-11 rows"].append((predicted, committed))
    mse = statistics.mean((p - q) ** 2 for p, q in zip(preds, acts))
    rel = {k: round(statistics.mean(((p - q) / q) ** 2 for p, q in s) ** 0.5, 3) for k, s in sums.items()}
    pred, act = statistics.mean(preds), statistics.mean(acts)
    return round(pred, 3), round(act, 3), round(pred - act, 3), round(mse, 3), rel


print(f"draft {draft}: expected, committed, bias, squared error a row, relative error of a step's sum")
print("alike, prior weight 4  ", replay(1.0, 4.0))
print("engine's rates alone   ", replay(1.0, 1e9))
for gamma in (0.9, 0.8, 0.7, 0.6, 0.5):
    for weight in (1.0, 2.0, 4.0):
        print(f"decay {gamma}, weight {weight:g}  ", replay(gamma, weight))
