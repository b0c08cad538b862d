# steady c16 engine alone (demo pair, bf16, graphs): plain and DFlash ms/step and tok/s, 3 windows each
import statistics
import sys
import time

import torch

import reference_engine.bench as B
from reference_engine.runtime.request import SamplingParams

tag = sys.argv[1]
D = "reference_engine/assets/demo"
argv = [
    "--model",
    f"{D}/target",
    "--draft",
    f"{D}/draft",
    "--prompts",
    f"{D}/heldout_prompts.jsonl",
    "--concurrency",
    "16",
    "--num-prompts",
    "16",
    "--output-len",
    "1500",
    "--block-size",
    "8",
    "--commit-strategy",
    "per_token",
]
args = B.BenchArgs.parse(argv)
target, drafts = B.load_pair(args)
prompts = B.read_prompts(args.prompts, args.model, 16)
for mode in ("plain", "dflash"):
    eng = B.make_engine(target, drafts[0] if mode == "dflash" else None, prompts, args, 16, None)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(max_tokens=1500, ignore_eos=True))
    for _ in range(20):
        eng.step()
    torch.cuda.synchronize()
    res = []
    for _w in range(3):
        n0 = sum(len(eng.get(str(i)).output_ids) for i in range(16))
        ts = []
        t0 = time.perf_counter()
        for _ in range(120):
            t = time.perf_counter()
            eng.step()
            ts.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
        n1 = sum(len(eng.get(str(i)).output_ids) for i in range(16))
        res.append((1000 * statistics.median(ts), (n1 - n0) / wall, (n1 - n0) / 120))
    print(
        f"AB {tag} {mode} ms/step {[round(r[0], 3) for r in res]}",
        f"tok/s {[round(r[1]) for r in res]} tok/step {[round(r[2], 2) for r in res]}",
        flush=True,
    )
    del eng
    torch.cuda.empty_cache()
