"""Kernel timings on the device: each exact (Triton) kernel against its vendor/PyTorch
counterpart on real model shapes, medians of CUDA-event timings (triton.testing.do_bench),
plus the device's copy bandwidth as the memory ceiling.

    python scripts/bench_kernels.py [--out FILE.csv] [--sweep] [--moe-sweep] [--delta-sweep]
        [--long-attention]

--moe-sweep times the mixture-of-experts products (kernels/moe.py) of the Qwen3-30B-A3B and
Qwen3.5-35B-A3B shapes for 1 to 256 tokens under each candidate tile pair, replayed from a
CUDA graph (the engine runs them so), against the time to stream the distinct experts' bytes
at the copy bandwidth, and checks that every pair gives the bits of the engine's.

--delta-sweep times the gated delta recurrence (kernels/gated_delta.py) of the Qwen3.5 shapes
(32 value heads of 128 x 128) under each layout (value columns a program, warps, inputs
loaded a token ahead) for decode steps, verify blocks keeping the per_token checkpoints, and
prefill chunks, replayed from CUDA graphs, and checks each layout's block against its
one-token steps bit for bit (the invariance the engine needs of the layout it runs).
"""

from __future__ import annotations

import argparse
import csv
import sys

import torch
import triton.testing

from reference_engine.kernels import reference as ref
from reference_engine.kernels.attention import attention
from reference_engine.kernels.gated_delta import gated_delta
from reference_engine.kernels.matmul import CONFIGURATIONS, Tiles, matmul
from reference_engine.kernels.norms import rms_norm

# the engine's matrices (q/k/v and gate/up fused), Qwen3-8B
PROJECTIONS = {
    "qkv 8B": (6144, 4096),
    "o 8B": (4096, 4096),
    "gate/up 8B": (24576, 4096),
    "down 8B": (4096, 12288),
    "lm_head 8B": (151936, 4096),
}


def median_ms(fn, *args) -> float:
    return triton.testing.do_bench(lambda: fn(*args), warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy (bytes read + written)."""
    src = torch.empty(2**30, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms(dst.copy_, src)
    return 2 * src.numel() * 2 / ms / 1e6


def sweep(bw: float) -> None:
    """Matmul tile configurations (the engine's and a few others) on the 8B projections and
    row counts on both sides of each switch: median us per M, the best per M, and whether
    every configuration gives the bits of the first (it must: no tile changes an element's
    sum, see kernels/matmul.py)."""
    extra = (
        Tiles(16, 32, 256, 4, 5),
        Tiles(64, 128, 64, 4, 4),
        Tiles(128, 128, 64, 8, 3),
        Tiles(128, 64, 64, 4, 4),
        Tiles(256, 128, 64, 8, 3),
    )
    configs = (*CONFIGURATIONS, *extra)
    row_counts = (1, 16, 32, 64, 128, 256)
    print("M, then us per configuration (engine's first):", ", ".join(map(str, configs)))
    for name, (N, K) in PROJECTIONS.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
        for m in row_counts:
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            want = matmul(x, w, None, configs[0])
            times = [1000 * median_ms(matmul, x, w, None, t) for t in configs]
            same = all(torch.equal(matmul(x, w, None, t), want) for t in configs)
            cublas = 1000 * median_ms(ref.linear, x, w)
            engine = 1000 * median_ms(matmul, x, w)
            best = min(range(len(configs)), key=times.__getitem__)
            print(
                f"{name:<10} M={m:<4} engine {engine:7.1f} cuBLAS {cublas:7.1f} best {times[best]:7.1f} "
                f"{configs[best]} | all bits equal: {same} | " + " ".join(f"{t:.1f}" for t in times)
            )


MOE_SHAPES = {"30B-A3B": (2048, 768, 128, 8), "35B-A3B": (2048, 512, 256, 8)}  # (H, I, E, k)


def moe_sweep(bw: float) -> None:
    from reference_engine.kernels import moe

    candidates = [
        (moe.Tiles(16, 16, 256, 4, 4), moe.Tiles(16, 32, 256, 4, 4)),
        (moe.Tiles(16, 16, 256, 2, 5), moe.Tiles(16, 16, 256, 2, 5)),
        (moe.Tiles(16, 32, 256, 4, 4), moe.Tiles(16, 64, 256, 4, 4)),
        (moe.Tiles(16, 16, 128, 4, 5), moe.Tiles(16, 32, 128, 4, 5)),
        (moe.Tiles(16, 32, 128, 4, 4), moe.Tiles(16, 64, 128, 4, 4)),
        (moe.Tiles(16, 64, 128, 4, 3), moe.Tiles(16, 128, 128, 4, 3)),
        (moe.Tiles(32, 32, 128, 4, 4), moe.Tiles(32, 64, 128, 4, 4)),
        (moe.Tiles(64, 64, 64, 4, 4), moe.Tiles(64, 64, 64, 4, 4)),
    ]
    print("MoE experts: us per tile pair (engine's first), GB/s of the distinct experts' bytes")
    for name, (H, inter, E, k) in MOE_SHAPES.items():
        gate_up = torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16) * H**-0.5
        down = torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16) * inter**-0.5
        router = torch.randn(E, H, device="cuda", dtype=torch.bfloat16) * H**-0.5
        for tokens in (1, 2, 4, 16, 64, 256):
            x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
            weights, ids = moe.route_experts(matmul(x, router), k, True)
            distinct = ids.unique().numel()
            floor_us = 1e3 * distinct * 3 * H * inter * 2 / bw / 1e6
            args = (x, weights, ids, gate_up, down)
            engine = moe.experts(*args)
            times, same = [], True
            for pair in (None, *candidates):
                same &= torch.equal(moe.experts(*args, tiles=pair), engine)
                times.append(graph_us(moe.experts, *args, tiles=pair))
            logits = matmul(x, router)
            layouts = ((16, 4), (16, 1), (8, 1), (4, 1), (2, 1), (1, 1), (16, 2))
            route = {lay: graph_us(moe.route_experts, logits, k, True, lay) for lay in layouts}
            route_us = graph_us(moe.route_experts, logits, k, True)
            best = min(range(len(times)), key=times.__getitem__)
            chosen = "engine" if best == 0 else candidates[best - 1]
            print(
                f"{name} tokens={tokens:<4} experts={distinct:<4} floor {floor_us:6.1f} us | engine "
                f"{times[0]:6.1f} best {times[best]:6.1f} ({chosen}) | route {route_us:5.1f} "
                f"({', '.join(f'{lay}: {us:.1f}' for lay, us in route.items())}) "
                f"| bits equal: {same} | " + " ".join(f"{t:.1f}" for t in times[1:])
            )


MOE_PROJECTIONS = {"qkv 30B-A3B": (5120, 2048), "o 30B-A3B": (2048, 4096), "router 30B-A3B": (128, 2048)}


def moe_projection_sweep() -> None:
    """The exact matmul's tile configurations on the MoE targets' dense projections at 1 and
    16 rows, replayed from CUDA graphs: us each (the engine's choice first)."""
    extra = (
        Tiles(16, 32, 256, 4, 4),
        Tiles(16, 16, 128, 4, 4),
        Tiles(16, 32, 128, 4, 3),
        Tiles(16, 64, 128, 4, 3),
    )
    configs = (*CONFIGURATIONS, *extra)
    for name, (N, K) in MOE_PROJECTIONS.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
        for m in (1, 16):
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            engine = graph_us(matmul, x, w)
            times = [graph_us(matmul, x, w, None, t) for t in configs]
            best = min(range(len(configs)), key=times.__getitem__)
            print(
                f"{name:<15} M={m:<3} engine {engine:6.1f} best {times[best]:6.1f} {configs[best]} "
                f"(bytes at 4.3 TB/s {N * K * 2 / 4.3e6:6.1f}) | " + " ".join(f"{t:.1f}" for t in times)
            )


def prefill_in_chunks(q, kc, vc, slots, pos, scale, chunk: int = 512):
    return torch.cat(
        [
            attention(q[:, a : a + chunk], kc, vc, slots, pos[:, a : a + chunk], a + chunk, scale)
            for a in range(0, q.shape[1], chunk)
        ],
        dim=1,
    )


# (warps, query rows a tile, chunk tokens, mask the key blocks a tile sees whole) of the
# prefill sweep; the engine's first
WIDE_VARIANTS = (
    (4, 64, 2048, False),
    (4, 64, 2048, True),
    (4, 64, 512, False),
    (4, 64, 4096, False),
    (4, 32, 2048, False),
    (8, 128, 2048, False),
)


def long_attention(bw: float) -> None:
    """Attention over long caches (Qwen3-8B heads: 32 query, 8 kv, head_dim 128). A prefill of
    16K and 32K tokens in chunks against torch's fused causal attention over the whole prompt
    (flash, kv heads repeated), for each wide-tile variant (warps, rows a tile, chunk size),
    with whether each variant gives the bits of the engine's; then decode (T = 1) and verify
    (T = 16) rows at 8K-32K positions, replayed from CUDA graphs, against the time to read
    their keys and values at the copy bandwidth. The `mask` column says whether the key
    blocks a tile sees whole run unmasked (the engine's) or masked too (the same bits)."""
    from reference_engine.kernels import attention as module

    engine = module.WIDE_WARPS, module.WIDE_ELEMENTS, module.MASK_WHOLE_BLOCKS
    heads, kv_heads, dim = 32, 8, 128
    print("prefill attention | tokens | warps | tile rows | chunk | mask | ms | flash ms | x flash | bits")
    for tokens in (16384, 32768):
        kc = torch.randn(1, tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(1, tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
        slots = torch.zeros(1, dtype=torch.long, device="cuda")
        pos = torch.arange(tokens, device="cuda")[None]
        qh = q.transpose(1, 2).contiguous()
        kh = kc.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1).contiguous()
        vh = vc.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1).contiguous()
        flash = median_ms(torch.nn.functional.scaled_dot_product_attention, qh, kh, vh, None, 0.0, True)
        del qh, kh, vh
        first = None
        for warps, rows, chunk, masked in WIDE_VARIANTS:
            if tokens > 16384 and (warps, rows, chunk) != WIDE_VARIANTS[0][:3]:
                continue
            module.WIDE_WARPS, module.WIDE_ELEMENTS, module.MASK_WHOLE_BLOCKS = warps, rows * dim, masked
            out = prefill_in_chunks(q, kc, vc, slots, pos, dim**-0.5, chunk)
            same = first is None or torch.equal(out, first)
            first = out if first is None else first
            ms = median_ms(prefill_in_chunks, q, kc, vc, slots, pos, dim**-0.5, chunk)
            mask = "every" if masked else "whole"
            print(
                f"prefill attention | {tokens} | {warps} | {rows} | {chunk} | {mask} | "
                f"{ms:.1f} | {flash:.1f} | {ms / flash:.2f} | {'same' if same else 'DIFF'}",
                flush=True,
            )
        del kc, vc, q, first, out
    module.WIDE_WARPS, module.WIDE_ELEMENTS, module.MASK_WHOLE_BLOCKS = engine
    print("long attention | shape | mask | exact us | floor us | x floor")
    for ctx in (32768, 16384, 8192):
        kc = torch.randn(16, ctx + 16, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        for b, T in ((1, 1), (1, 16), (16, 1), (16, 16)):
            q = torch.randn(b, T, heads, dim, device="cuda", dtype=torch.bfloat16)
            slots = torch.arange(b, device="cuda")
            pos = (ctx + torch.arange(T, device="cuda"))[None].expand(b, T).contiguous()
            floor = 1000 * b * (ctx + T) * kv_heads * dim * 2 * 2 / bw / 1e6
            shape = f"ctx={ctx} b={b} T={T}"
            for masked in (False, True):
                module.MASK_WHOLE_BLOCKS = masked
                us = graph_us(attention, q, kc, vc, slots, pos, ctx + T, dim**-0.5)
                mask = "every" if masked else "whole"
                ratio = f"{us:.1f} | {floor:.1f} | {us / floor:.2f}"
                print(f"long attention | {shape} | {mask} | {ratio}", flush=True)
            module.MASK_WHOLE_BLOCKS = engine[2]
        del kc, vc


def delta_sweep() -> None:
    from reference_engine.kernels.gated_delta import DELTA_TILES, DeltaTiles

    H, D = 32, 128
    layouts = [DELTA_TILES] + [
        DeltaTiles(bv, w, f)
        for bv in (16, 32, 64)
        for w in (1, 2, 4, 8)
        for f in (False, True)
        if DeltaTiles(bv, w, f) != DELTA_TILES
    ]
    cases = ((1, 1), (16, 1), (64, 1), (1, 8), (16, 8), (64, 8), (16, 16), (1, 128), (1, 1024))
    print("gated delta: us per layout (block_v, warps, prefetch), engine's first")
    print("layouts:", " ".join(f"{t.block_v}/{t.warps}/{int(t.prefetch)}" for t in layouts))
    slot_state = torch.randn(64, H, D, D, device="cuda") * 0.1
    for batch, T in cases:
        torch.manual_seed(batch * 1000 + T)

        def r(*shape):
            return torch.randn(*shape, device="cuda")

        q = torch.nn.functional.normalize(r(batch, T, H, D), dim=-1)
        k = torch.nn.functional.normalize(r(batch, T, H, D), dim=-1)
        v, g, beta = r(batch, T, H, D), -r(batch, T, H).abs() * 0.1, torch.sigmoid(r(batch, T, H))
        slots = torch.arange(batch, device="cuda")
        every = 8
        states = torch.empty(batch, -(-T // every), H, D, D, device="cuda") if 1 < T <= 16 else None
        times = []
        for tiles in layouts:
            work = slot_state.clone()
            times.append(graph_us(gated_delta, q, k, v, g, beta, work, None, states, slots, every, tiles))
        best = min(range(len(times)), key=times.__getitem__)
        t = layouts[best]
        print(
            f"batch={batch:<3} T={T:<5} engine {times[0]:7.1f} best {times[best]:7.1f} "
            f"({t.block_v}/{t.warps}/{int(t.prefetch)}) | " + " ".join(f"{x:.1f}" for x in times),
            flush=True,
        )
    # each layout's block against its own one-token steps, bit for bit
    batch, T = 4, 8
    q = torch.nn.functional.normalize(torch.randn(batch, T, H, D, device="cuda"), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(batch, T, H, D, device="cuda"), dim=-1)
    v, g = torch.randn(batch, T, H, D, device="cuda"), -torch.rand(batch, T, H, device="cuda") * 0.1
    beta, state = torch.rand(batch, T, H, device="cuda"), torch.randn(batch, H, D, D, device="cuda") * 0.1
    engine = gated_delta(q, k, v, g, beta, state)
    for tiles in layouts:
        out, final = gated_delta(q, k, v, g, beta, state, tiles=tiles)
        step = state
        same = True
        for t in range(T):
            o, step = gated_delta(*(x[:, t : t + 1] for x in (q, k, v, g, beta)), step, tiles=tiles)
            same &= torch.equal(o[:, 0], out[:, t])
        same &= torch.equal(step, final)
        engine_bits = torch.equal(out, engine[0]) and torch.equal(final, engine[1])
        print(f"layout {tiles}: block == its steps: {same}; the engine layout's bits: {engine_bits}")


def graph_us(fn, *args, **kwargs) -> float:
    """Median microseconds of fn(*args) replayed from a CUDA graph."""
    return 1000 * triton.testing.do_bench_cudagraph(lambda: fn(*args, **kwargs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/bench_kernels.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="CSV of every row")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="also time matmul tile configurations (and whether row bits agree)",
    )
    p.add_argument("--moe-sweep", action="store_true", help="time the MoE products' tile pairs")
    p.add_argument("--delta-sweep", action="store_true", help="time the gated delta recurrence's layouts")
    p.add_argument(
        "--long-attention", action="store_true", help="time attention over 8K-32K caches and 8K-32K prefills"
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    rows = []
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw:.0f} GB/s")
    for name, (N, K) in PROJECTIONS.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
        for M in (1, 16, 64, 256, 1024):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            exact = median_ms(matmul, x, w)
            fast = median_ms(ref.linear, x, w)
            floor = (N * K + M * K + M * N) * 2 / bw / 1e6
            rows.append(
                {
                    "kernel": "matmul",
                    "shape": f"{name} M={M}",
                    "exact_ms": exact,
                    "fast_ms": fast,
                    "memory_floor_ms": floor,
                }
            )
    if args.sweep:
        sweep(bw)
    if args.moe_sweep:
        moe_sweep(bw)
        moe_projection_sweep()
    if args.delta_sweep:
        delta_sweep()
    if args.long_attention:
        long_attention(bw)
    x, w = (
        torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16),
        torch.randn(4096, device="cuda", dtype=torch.bfloat16),
    )
    rows.append(
        {
            "kernel": "rms_norm",
            "shape": "64x4096",
            "exact_ms": median_ms(rms_norm, x, w, 1e-6, False),
            "fast_ms": median_ms(ref.rms_norm, x, w, 1e-6, False),
            "memory_floor_ms": 0.0,
        }
    )
    kc = torch.randn(16, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    for b, T, ctx in ((1, 1, 1024), (1, 16, 1024), (16, 1, 1024), (16, 16, 1024)):
        q = torch.randn(b, T, 32, 128, device="cuda", dtype=torch.bfloat16)
        slots = torch.arange(b, device="cuda")
        pos = (ctx + torch.arange(T, device="cuda"))[None].expand(b, T).contiguous()
        rows.append(
            {
                "kernel": "attention",
                "shape": f"b={b} T={T} ctx={ctx}",
                "exact_ms": median_ms(attention, q, kc, vc, slots, pos, ctx + T, 0.088),
                "fast_ms": median_ms(ref.attention, q, kc, vc, slots, pos, ctx + T, 0.088),
                "memory_floor_ms": b * (ctx + T) * 8 * 128 * 2 * 2 / bw / 1e6,
            }
        )
    for b, T in ((1, 1), (1, 16), (16, 16)):
        H, D = 32, 128
        q = torch.nn.functional.normalize(torch.randn(b, T, H, D, device="cuda"), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(b, T, H, D, device="cuda"), dim=-1)
        v, g = torch.randn(b, T, H, D, device="cuda"), -torch.rand(b, T, H, device="cuda")
        beta, s = torch.rand(b, T, H, device="cuda"), torch.randn(b, H, D, D, device="cuda")
        rows.append(
            {
                "kernel": "gated_delta",
                "shape": f"b={b} T={T} H=32 128x128",
                "exact_ms": median_ms(gated_delta, q, k, v, g, beta, s),
                "fast_ms": median_ms(ref.gated_delta, q, k, v, g, beta, s),
                "memory_floor_ms": b * H * D * D * 4 * 2 / bw / 1e6,
            }
        )
    print(f"{'kernel':<12} {'shape':<26} {'exact ms':>9} {'fast ms':>9} {'exact/fast':>10} {'floor ms':>9}")
    for r in rows:
        print(
            f"{r['kernel']:<12} {r['shape']:<26} {r['exact_ms']:9.4f} {r['fast_ms']:9.4f} "
            f"{r['exact_ms'] / r['fast_ms']:10.2f} {r['memory_floor_ms']:9.4f}"
        )
    if args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
