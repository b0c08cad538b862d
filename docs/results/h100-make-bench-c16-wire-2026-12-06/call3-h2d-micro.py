# ruff: noqa: E501, E701, E702 (a measurement's script, kept as it ran)
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from reference_engine.runtime.transfer import to_device

dev = torch.device("cuda")
vals = list(range(208))
x = torch.zeros(1024, device=dev)


def timeit(f, n=3000):
    ts = []
    for i in range(n):
        x.add_(1)  # a kernel queued each time, as a step would
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
        if i % 50 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6, statistics.mean(ts) * 1e6


ring = [torch.empty(4096, dtype=torch.int64, pin_memory=True) for _ in range(8)]
evs = [torch.cuda.Event() for _ in range(8)]
k = [0]


def ringed():
    i = k[0] = (k[0] + 1) % 8
    evs[i].synchronize()
    cpu = torch.tensor(vals, dtype=torch.int64)
    buf = ring[i][: len(vals)]
    buf.copy_(cpu)
    out = buf.to(dev, non_blocking=True)
    evs[i].record()
    return out


def ringed_np():
    i = k[0] = (k[0] + 1) % 8
    evs[i].synchronize()
    buf = ring[i][: len(vals)]
    buf.numpy()[:] = vals
    out = buf.to(dev, non_blocking=True)
    evs[i].record()
    return out


cases = {
    "to_device (pin_memory=True)": lambda: to_device(vals, dev),
    "torch.tensor cpu only": lambda: torch.tensor(vals, dtype=torch.int64),
    "torch.tensor pinned only": lambda: torch.tensor(vals, dtype=torch.int64, pin_memory=True),
    "pageable .to(non_blocking)": lambda: torch.tensor(vals, dtype=torch.int64).to(dev, non_blocking=True),
    "ring pinned + event": ringed,
    "ring pinned numpy + event": ringed_np,
    "empty cuda": lambda: torch.empty(208, dtype=torch.int64, device=dev),
    "event record": lambda: evs[0].record(),
}
for _r in range(2):
    for name, f in cases.items():
        med, mean = timeit(f)
        print(f"{name:32s} median {med:7.1f} us mean {mean:7.1f} us")
# correctness of ringed copies
for f in (ringed, ringed_np):
    outs = [f() for _ in range(20)]
    assert all(o.tolist() == vals for o in outs)
print("ok")
