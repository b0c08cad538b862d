# DFlash engine alone, demo pair c16 bf16 graphs: per-method host time per step, GC time, and callees of hot spots
import sys, time, statistics, cProfile, pstats, io, gc, collections, torch
import reference_engine.bench as B
from reference_engine.runtime.request import SamplingParams
import reference_engine.runtime.speculative_step as SS
import reference_engine.runtime.engine as E
import reference_engine.runtime.transfer as T
D = "reference_engine/assets/demo"
argv = ["--model", f"{D}/target", "--draft", f"{D}/draft", "--prompts", f"{D}/heldout_prompts.jsonl",
        "--concurrency", "16", "--num-prompts", "16", "--output-len", "1200", "--block-size", "8",
        "--commit-strategy", "per_token"] + sys.argv[1:]
args = B.BenchArgs.parse(argv)
target, drafts = B.load_pair(args)
prompts = B.read_prompts(args.prompts, args.model, 16)
acc = collections.defaultdict(float)
def wrap(cls, name, key=None):
    orig = getattr(cls, name); key = key or name
    def w(*a, **k):
        t = time.perf_counter()
        try: return orig(*a, **k)
        finally: acc[key] += time.perf_counter() - t
    setattr(cls, name, w)
gcs = [0.0, 0]; gstart = [0.0]
def cb(phase, info):
    if phase == "start": gstart[0] = time.perf_counter()
    else: gcs[0] += time.perf_counter() - gstart[0]; gcs[1] += 1
gc.callbacks.append(cb)
eng = B.make_engine(target, drafts[0], prompts, args, 16, None)
S = type(eng.speculative_step)
import reference_engine.runtime.graphs as G
hits = [0, 0]
if hasattr(G.EngineGraphs, "propose_ahead"):
    pa = G.EngineGraphs.propose_ahead
    def counted(self, *a, **k):
        r = pa(self, *a, **k); hits[r is None] += 1; return r
    G.EngineGraphs.propose_ahead = counted
    wrap(G.EngineGraphs, "propose_ahead")
wrap(G.EngineGraphs, "verify", "graphs.verify"); wrap(G.EngineGraphs, "accept", "graphs.accept"); wrap(G.EngineGraphs, "commit", "graphs.commit")
for n in ("rows", "propose", "verify", "accept_replayed", "commit_replayed", "launch_ahead_replayed", "launch_ahead", "read_step", "expect_ahead"):
    wrap(S, n)
wrap(S, "__call__", "SPEC_STEP")
wrap(T.HostCopy, "__init__", "HostCopy")
wrap(T.HostCopy, "tolist", "HostCopy.tolist")
wrap(type(eng.verify_width), "choose", "width.choose")
wrap(E.Engine, "_record_speculative")
wrap(type(eng.timer), "flush", "timer.flush")
wrap(type(eng.scheduler), "admit", "sched.admit")
pass
for i, p in enumerate(prompts):
    eng.add_request(str(i), p, SamplingParams(max_tokens=1200, ignore_eos=True))
for _ in range(30): eng.step()
torch.cuda.is_available() and torch.cuda.synchronize()
acc.clear(); gcs[:] = [0.0, 0]
ts = []
for _ in range(200):
    t = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t)
print(f"wall/step median {1000*statistics.median(ts):.3f} mean {1000*statistics.mean(ts):.3f} p10 {1000*sorted(ts)[20]:.3f} p90 {1000*sorted(ts)[180]:.3f}")
print("propose_ahead taken/None", hits)
print(f"gc per step {1000*gcs[0]/200:.3f} ms ({gcs[1]} collections)")
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
    print(f"  {k:24s} {1000*v/200:.3f} ms/step")
print("steps times (ms) first 40:", [round(1000*x, 2) for x in ts[:40]])
pr = cProfile.Profile(); pr.enable()
for _ in range(100): eng.step()
pr.disable()
s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats("cumtime").print_stats(30); st.print_callees("accept_replayed|__call__|propose"); print(s.getvalue()[:20000])
