"""Engine-only demo pair at c16 on the GPU: plain vs DFlash wall per step, tok/s, and a cProfile
of each (tottime), with 256 held-out prompts added at once (the scheduler keeps 16 running)."""
import cProfile, io, json, pstats, statistics, sys, time
import torch
from reference_engine.checkpoint import load_target, load_draft
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams

D = "reference_engine/assets/demo"
N = int(sys.argv[1]) if len(sys.argv) > 1 else 256
prompts = [json.loads(l)["prompt_ids"] for l in open(f"{D}/heldout_prompts.jsonl")]
prompts = (prompts * (N // len(prompts) + 1))[:N]
dev = torch.device("cuda")
target = load_target(f"{D}/target", torch.bfloat16, dev)
draft = load_draft(f"{D}/draft", target)
cfg = EngineConfig(max_num_seqs=16, block_size=8, commit_strategy="per_token")
MODES = sys.argv[3].split(",") if len(sys.argv) > 3 else ["plain", "dflash"]
engines = {m: Engine(target, draft if m == "dflash" else None, cfg) for m in MODES}
if len(sys.argv) > 4:  # spy mode: loop the first mode for this many seconds
    e = engines[MODES[0]]
    end = time.time() + float(sys.argv[4])
    while time.time() < end:
        params = SamplingParams(max_tokens=128, ignore_eos=True)
        for i, p in enumerate(prompts):
            e.add_request(str(i), p, params)
        while e.has_unfinished():
            e.step()
        for i in range(len(prompts)):
            e.collect(str(i))
    sys.exit(0)

def run(engine, prof=None):
    engine.reset_stats()
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    steps = 0
    if prof: prof.enable()
    while engine.has_unfinished():
        engine.step(); steps += 1
    if prof: prof.disable()
    wall = time.perf_counter() - t0
    toks = sum(len(engine.collect(str(i)).output_ids) for i in range(len(prompts)))
    return wall, steps, toks, engine.stats()

res = {m: [] for m in engines}
outs = {}
for r in range(4):
    for m, e in engines.items():
        wall, steps, toks, st = run(e)
        if r: res[m].append((wall, steps, toks))
        outs[m] = st
for m in engines:
    w = statistics.median(x[0] for x in res[m]); s = res[m][0][1]; t = res[m][0][2]
    print(f"ENGINE {m}: wall {w*1e3:.1f} ms steps {s} tok/s {t/w:.0f} ms/step {w/s*1e3:.3f} runs {[round(x[0]*1e3,1) for x in res[m]]}")
    ph = outs[m]["phases"]
    print("  phases host ms/step:", {k[7:]: round(v / s * 1e3, 3) for k, v in ph.items() if k.startswith("host_s_")})
    print("  phases device ms/step:", {k[9:]: round(v / s * 1e3, 3) for k, v in ph.items() if k.startswith("device_s_")})
    if m == "dflash":
        print("  widths", outs[m]["verify_widths"], "ahead", outs[m]["draft_ahead"], "spec", {k: outs[m]["spec"][k] for k in list(outs[m]["spec"])[:6]})
if len(engines) < 2: sys.exit(0)
r = {m: statistics.median(x[2] / x[0] for x in res[m]) for m in engines}
print(f"ENGINE ratio dflash/plain tok/s {r['dflash']/r['plain']:.3f}")
import os
for m, e in ([] if os.environ.get('NOPROF') else engines.items()):
    prof = cProfile.Profile()
    wall, steps, toks, _ = run(e, prof)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(45)
    open(f"{sys.argv[2] if len(sys.argv) > 2 else '/tmp'}/cprof-{m}.txt", "w").write(f"steps {steps} wall {wall:.3f}\n" + s.getvalue())
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(60)
    open(f"{sys.argv[2] if len(sys.argv) > 2 else '/tmp'}/cprof-{m}-cum.txt", "w").write(s.getvalue())
