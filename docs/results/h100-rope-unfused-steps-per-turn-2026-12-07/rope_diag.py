"""Where the compiled attention_inputs (norm + RoPE) differs from the reference in float16."""

import os

import torch

from reference_engine.kernels import launch

if os.environ.get("UNFUSED"):
    launch.LAUNCH["enable_fp_fusion"] = False
from reference_engine.kernels import reference as ref
from reference_engine.kernels.rope import attention_inputs
from reference_engine.models.layers import RotaryEmbedding

DEVICE = "cuda"


def rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE)


for dt in (torch.float16, torch.bfloat16):
    batch, T, heads, kv_heads, dim, rotary = 4, 8, 4, 2, 48, 16
    q = (rand(batch, T, heads, dim, seed=56) * 2).to(dt)
    k = (rand(batch, T, kv_heads, dim, seed=57) * 2).to(dt)
    v = rand(batch, T, kv_heads, dim, seed=58).to(dt)
    qw, kw = rand(dim, seed=59).to(dt), rand(dim, seed=60).to(dt)
    positions = torch.arange(batch * T, device=DEVICE).view(batch, T) * 3
    cos, sin = RotaryEmbedding(rotary, 10000.0).to(DEVICE).cos_sin(positions, dt)
    slots = torch.arange(batch, device=DEVICE)
    for norm in (True, False):
        for offset in (False, True):
            got = [torch.zeros(batch, 96, kv_heads, dim, dtype=dt, device=DEVICE) for _ in range(2)]
            want = [torch.zeros_like(c) for c in got]
            w1, w2 = (qw, kw) if norm else (None, None)
            gq = attention_inputs(q, k, v, w1, w2, 1e-6, offset, cos, sin, *got, slots, positions)
            wq = ref.attention_inputs(q, k, v, w1, w2, 1e-6, offset, cos, sin, *want, slots, positions)
            d = gq != wq
            rot, rest = d[..., :rotary], d[..., rotary:]
            # the norm alone (no rotation): compare the pass-through dims only
            ulp = ((gq.float() - wq.float()).abs() / wq.float().abs().clamp(min=2**-14)).max().item()
            kd = (got[0] != want[0]).sum().item()
            print(
                f"UNFUSED={bool(os.environ.get('UNFUSED'))} {dt} norm={norm} offset={offset}:"
                f" q differ {int(d.sum())}/{d.numel()}"
                f" rotary {int(rot.sum())}/{rot.numel()} rest {int(rest.sum())}/{rest.numel()}"
                f" max rel {ulp:.2e}; k rows differ {kd}"
            )
    # the norm by itself against F.rms_norm
    x = (rand(256, dim, seed=61) * 2).to(dt)
    for offset in (False, True):
        n_ref = ref.rms_norm(x, qw, 1e-6, offset)
        from reference_engine.kernels.norms import rms_norm

        n_k = rms_norm(x, qw, 1e-6, offset)
        print(
            f"  rms_norm kernel vs reference {dt} offset={offset} D={dim}:"
            f" differ {int((n_ref != n_k).sum())}/{n_ref.numel()}"
        )
    xd = x.double()
    exact = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt)
    fr = torch.nn.functional.rms_norm(x.float(), x.shape[-1:], None, 1e-6).to(dt)
    man = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt)
    print(
        f"  normed {dt}: F.rms_norm vs float64 differ {int((fr != exact).sum())},"
        f" manual fp32 vs float64 {int((man != exact).sum())},"
        f" F vs manual {int((fr != man).sum())} of {exact.numel()}"
    )
