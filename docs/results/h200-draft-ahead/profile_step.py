"""Eager kernel profile of one step's draft and verify at given (rows, width)."""
import sys, torch
from torch.profiler import profile, ProfilerActivity
from reference_engine.bench.shapes import random_pair
from reference_engine.runtime.engine import Engine
from reference_engine.runtime.engine_config import EngineConfig
from reference_engine.runtime.verify_width import timing_ids

DEV = "cuda" if torch.cuda.is_available() else "cpu"
shape, strategy = sys.argv[1], sys.argv[2]
cases = [tuple(map(int, c.split("x"))) for c in sys.argv[3].split(",")]
target, draft = random_pair(shape, DEV)
rows_max = max(r for r, _ in cases)
eng = Engine(target, draft, EngineConfig(max_num_seqs=rows_max, block_size=16, commit_strategy=strategy,
             max_model_len=512, numerics="exact", enforce_eager=True, verify_width="fixed"))
run = eng.runner
B = 16
t = lambda e: e.self_device_time_total if DEV == "cuda" else e.self_cpu_time_total
for rows, width in cases:
    slots = torch.arange(rows, device=DEV)
    block = timing_ids(rows, B, target.config.vocab_size, DEV)
    pos = torch.arange(B, device=DEV)[None].repeat(rows, 1)
    valid = torch.full((rows,), width + 1, dtype=torch.int64, device=DEV)
    def step(part):
        if part in ("draft", "both"):
            run.propose(block, pos, slots, torch.full_like(valid, B), B)
        if part in ("verify", "both"):
            v = run.verify(block[:, : width + 1], pos[:, : width + 1], slots, valid, width + 1, True)
            run.ops.greedy(v.logits)
    for part in ("draft", "verify", "decode"):
        if part == "decode":
            f = lambda: run.decode(block[:, :1], pos[:, :1], slots, 1)
        else:
            f = lambda: step(part)
        for _ in range(3): f()
        torch.cuda.synchronize() if DEV == "cuda" else None
        with profile(activities=[ProfilerActivity.CUDA if DEV == "cuda" else ProfilerActivity.CPU]) as p:
            for _ in range(5): f()
            torch.cuda.synchronize() if DEV == "cuda" else None
        ev = [e for e in p.key_averages() if e.device_type.name == ("CUDA" if DEV == "cuda" else "CPU")]
        tot = sum(t(e) for e in ev) / 5 / 1000
        print(f"== {shape} {strategy} {rows}x{width} {part}: {tot:.3f} ms GPU per call")
        for e in sorted(ev, key=lambda e: -t(e))[:8]:
            print(f"   {t(e)/5/1000:7.3f} ms  {e.count//5:4d}x  {e.key[:110]}")
    torch.cuda.empty_cache()
