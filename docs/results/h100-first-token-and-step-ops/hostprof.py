"""The demo pair's engine alone at c16 on a GPU: plain and DFlash wall time a step and tok/s,
with the 256 held-out prompts (the 32 eight times) added at once, 128 greedy tokens each (the
scheduler keeps 16 running). Three timed runs of each mode after one untimed, alternating;
then a cProfile of one run of each (unless NOPROF is set).

    python hostprof.py PROMPTS OUT_DIR [MODES [SECONDS]]

MODES: plain,dflash (default). With SECONDS, the first mode's engine loops for that long and
nothing is printed (a loop for a sampling profiler to attach to)."""

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams

DEMO = "reference_engine/assets/demo"
count = int(sys.argv[1]) if len(sys.argv) > 1 else 256
out_dir = sys.argv[2] if len(sys.argv) > 2 else "/tmp"
modes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["plain", "dflash"]
prompts = [json.loads(line)["prompt_ids"] for line in open(f"{DEMO}/heldout_prompts.jsonl")]
prompts = (prompts * (count // len(prompts) + 1))[:count]
target = load_target(f"{DEMO}/target", torch.bfloat16, torch.device("cuda"))
draft = load_draft(f"{DEMO}/draft", target)
config = EngineConfig(max_num_seqs=16, block_size=8, commit_strategy="per_token")
engines = {m: Engine(target, draft if m == "dflash" else None, config) for m in modes}
params = SamplingParams(max_tokens=128, ignore_eos=True)


def run(engine: Engine, profile: cProfile.Profile | None = None) -> tuple[float, int, int, dict]:
    engine.reset_stats()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    steps = 0
    if profile is not None:
        profile.enable()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    if profile is not None:
        profile.disable()
    wall = time.perf_counter() - start
    tokens = sum(len(engine.collect(str(i)).output_ids) for i in range(len(prompts)))
    return wall, steps, tokens, engine.stats()


if len(sys.argv) > 4:  # a loop for a sampling profiler
    engine, end = engines[modes[0]], time.time() + float(sys.argv[4])
    while time.time() < end:
        run(engine)
    sys.exit(0)

results: dict[str, list[tuple[float, int, int]]] = {m: [] for m in engines}
last: dict[str, dict] = {}
for r in range(4):
    for mode, engine in engines.items():
        wall, steps, tokens, stats = run(engine)
        if r:
            results[mode].append((wall, steps, tokens))
        last[mode] = stats
for mode in engines:
    runs = results[mode]
    wall, steps, tokens = statistics.median(x[0] for x in runs), runs[0][1], runs[0][2]
    walls = [round(x[0] * 1e3, 1) for x in runs]
    print(
        f"ENGINE {mode}: wall {wall * 1e3:.1f} ms steps {steps} tok/s {tokens / wall:.0f} "
        f"ms/step {wall / steps * 1e3:.3f} runs {walls}"
    )
    phases = last[mode]["phases"]
    for kind in ("host", "device"):
        prefix = f"{kind}_s_"
        per_step = {
            k[len(prefix) :]: round(v / steps * 1e3, 3) for k, v in phases.items() if k.startswith(prefix)
        }
        print(f"  phases {kind} ms/step:", per_step)
    if mode == "dflash":
        spec = {k: last[mode]["spec"][k] for k in list(last[mode]["spec"])[:6]}
        print("  widths", last[mode]["verify_widths"], "ahead", last[mode]["draft_ahead"], "spec", spec)
if len(engines) < 2:
    sys.exit(0)
rates = {m: statistics.median(x[2] / x[0] for x in results[m]) for m in engines}
print(f"ENGINE ratio dflash/plain tok/s {rates['dflash'] / rates['plain']:.3f}")
for mode, engine in [] if os.environ.get("NOPROF") else engines.items():
    profile = cProfile.Profile()
    wall, steps, _, _ = run(engine, profile)
    for order, suffix in (("tottime", ""), ("cumulative", "-cum")):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(45 if not suffix else 60)
        with open(f"{out_dir}/cprof-{mode}{suffix}.txt", "w") as f:
            f.write(f"steps {steps} wall {wall:.3f}\n" + text.getvalue())
