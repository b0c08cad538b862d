"""to_device against a pinned tensor made for each copy, 200 int64 values, each copy followed
by a small kernel; medians of 5 rounds of 2000 after one untimed. Call 12 ran it on a tree
whose to_device copied through a ring of pinned staging buffers."""

import statistics
import time

import torch

from reference_engine.runtime.transfer import to_device, to_pinned

values = list(range(200))
x = torch.zeros(16, device="cuda")


def pinned_each() -> torch.Tensor:
    return to_pinned(values).to("cuda", non_blocking=True)


def staged() -> torch.Tensor:
    return to_device(values, "cuda")


times: dict[str, list[float]] = {f.__name__: [] for f in (pinned_each, staged)}
for r in range(6):
    for f in (pinned_each, staged):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(2000):
            f()
            x.add_(1)
        torch.cuda.synchronize()
        if r:
            times[f.__name__].append((time.perf_counter() - start) / 2000 * 1e6)
for name, runs in times.items():
    print(
        f"STAGE {name}: {statistics.median(runs):.1f} us a copy and a kernel ({[round(t, 1) for t in runs]})"
    )
