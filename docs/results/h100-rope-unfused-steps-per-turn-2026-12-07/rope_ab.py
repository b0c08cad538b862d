"""The RoPE/norm kernel with FP fusion (before) and without (after): median ms, 8B shape, bf16."""

import statistics

import torch
import triton.testing

from reference_engine.kernels import reference as ref
from reference_engine.kernels import rope
from reference_engine.models.layers import RotaryEmbedding

H, KV, D = 32, 8, 128


def case(batch, T, ctx):
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s):
        return torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v = r(batch, T, H, D), r(batch, T, KV, D), r(batch, T, KV, D)
    qw, kw = r(D), r(D)
    pos = (ctx - T + torch.arange(T, device="cuda"))[None].repeat(batch, 1).contiguous()
    cos, sin = RotaryEmbedding(D, 1e6).to("cuda").cos_sin(pos, torch.bfloat16)
    kc = torch.zeros(batch, ctx, KV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    return (q, k, v, qw, kw, 1e-6, False, cos, sin, kc, vc, torch.arange(batch, device="cuda"), pos)


cases = {
    "decode b16": case(16, 1, 4096),
    "verify b16 T16": case(16, 16, 4096),
    "prefill 2048": case(1, 2048, 4096),
}
fused, unfused = {"enable_fp_fusion": True}, {"enable_fp_fusion": False}


def run(opts, args):
    rope.UNFUSED = opts
    return rope.attention_inputs(*args)


print("case | fused ms | unfused ms | unfused/fused | fused==ref q | unfused==ref q")
for name, args in cases.items():
    want = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    wq = ref.attention_inputs(*want)
    eq = []
    for opts in (fused, unfused):
        got = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        eq.append(torch.equal(run(opts, got), wq))
    tf, tu = [], []
    for _ in range(3):
        tf.append(
            triton.testing.do_bench(
                lambda args=args: run(fused, args), warmup=25, rep=100, return_mode="median"
            )
        )
        tu.append(
            triton.testing.do_bench(
                lambda args=args: run(unfused, args), warmup=25, rep=100, return_mode="median"
            )
        )
    mf, mu = statistics.median(tf), statistics.median(tu)
    print(f"{name} | {mf:.4f} | {mu:.4f} | {mu / mf:.3f} | {eq[0]} | {eq[1]}", flush=True)
rope.UNFUSED = unfused
