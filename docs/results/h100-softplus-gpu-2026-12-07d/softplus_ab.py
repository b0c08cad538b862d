"""The gated-delta inputs kernel before (log(1 + e^x)) and after (log1p) the softplus change,
Qwen3.5-4B linear-attention heads (16 key / 32 value heads of 128), bf16 inputs: bits of every
output against each other and of g against the float32 reference; do_bench medians of 3
alternating rounds."""

import shutil
import statistics

import torch
import triton

shutil.copy(".prof/dev/gd_before.py", "reference_engine/kernels/gated_delta_before.py")
from reference_engine.kernels import gated_delta as after  # noqa: E402
from reference_engine.kernels import gated_delta_before as before  # noqa: E402
from reference_engine.kernels import reference as ref  # noqa: E402

KH, VH, DK, DV = 16, 32, 128, 128
gen = torch.Generator(device="cuda").manual_seed(0)
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
print(
    "case | outputs equal q,k,v,beta | g elems differing before/after | g != ref before"
    " | g != ref after | ms before | ms after | after/before"
)
for name, batch, T in (("decode b16", 16, 1), ("verify b16 T16", 16, 16), ("prefill 4096", 1, 4096)):
    mixed = torch.randn(batch, 2 * KH * DK + VH * DV, T, device="cuda", generator=gen).bfloat16()
    fused = (torch.randn(batch, T, 2 * VH, device="cuda", generator=gen) * 4).bfloat16()
    a, b = fused[..., :VH], fused[..., VH:]
    A_log = torch.randn(VH, device="cuda", generator=gen)
    dt_bias = torch.randn(VH, device="cuda", generator=gen)
    args = (mixed, a, b, A_log, dt_bias, KH, DK, DV)
    o_b, o_a = before.gated_delta_inputs(*args), after.gated_delta_inputs(*args)
    want = ref.gated_delta_inputs(*args)[3]
    same = all(torch.equal(x, y) for x, y in zip(o_b[:3] + o_b[4:], o_a[:3] + o_a[4:]))
    diff = int((o_b[3] != o_a[3]).sum())
    rb, ra = int((o_b[3] != want).sum()), int((o_a[3] != want).sum())
    tb, ta = [], []
    for _ in range(3):
        tb.append(triton.testing.do_bench(lambda args=args: before.gated_delta_inputs(*args)))
        ta.append(triton.testing.do_bench(lambda args=args: after.gated_delta_inputs(*args)))
    mb, ma = statistics.median(tb), statistics.median(ta)
    print(f"{name} | {same} | {diff} of {o_a[3].numel()} | {rb} | {ra} | {mb:.4f} | {ma:.4f} | {ma / mb:.3f}")
