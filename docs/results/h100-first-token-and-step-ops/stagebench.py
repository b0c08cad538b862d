"""to_device through the staging buffers against a pinned tensor a copy, 200 int64 values,
each copy followed by a small kernel; medians of 5 rounds of 2000."""
import statistics, time
import torch
from reference_engine.runtime.transfer import to_device, to_pinned

vals = list(range(200))
x = torch.zeros(16, device="cuda")
def pinned_each():
    return to_pinned(vals).to("cuda", non_blocking=True)
def staged():
    return to_device(vals, "cuda")
res = {f.__name__: [] for f in (pinned_each, staged)}
for r in range(6):
    for f in (pinned_each, staged):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(2000):
            f(); x.add_(1)
        torch.cuda.synchronize()
        if r: res[f.__name__].append((time.perf_counter() - t0) / 2000 * 1e6)
for k, v in res.items():
    print(f"STAGE {k}: {statistics.median(v):.1f} us a copy and a kernel ({[round(t, 1) for t in v]})")
