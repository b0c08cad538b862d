"""Bitwise invariance of the exact kernels on the device, at real model sizes in bfloat16:
a row's result does not depend on how many rows run with it (M = 1 .. 1000), on the other
rows' contents, or on whether a token runs alone or inside a verify block. The vendor kernels
are shown to move under the same probe, so the probe can see a difference. Skipped without
CUDA; the interpreter tests of the same kernels are tests/test_kernels.py."""

from __future__ import annotations

import pytest
import torch

from reference_engine.kernels import reference as ref

pytestmark = pytest.mark.gpu

PROJECTIONS = [(4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096), (2560, 9216)]  # (N, K)
ROW_COUNTS = [1, 2, 3, 7, 16, 17, 31, 48, 49, 64, 65, 96, 97, 256, 1000]  # both sides of each tile switch


def randn(*shape: int, seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


@pytest.mark.parametrize(("N", "K"), PROJECTIONS)
def test_matmul_row_bits_do_not_depend_on_the_number_of_rows(N: int, K: int) -> None:
    from reference_engine.kernels.matmul import matmul

    x = randn(max(ROW_COUNTS), K)
    w = randn(N, K, seed=1) * K**-0.5
    alone = matmul(x[:1], w)
    for m in ROW_COUNTS:
        x_m = x[:m].clone()
        if m > 1:
            x_m[1:] = randn(m - 1, K, seed=m)  # other rows' contents must not matter either
        assert torch.equal(matmul(x_m, w)[:1], alone), f"row 0 moved at M={m}"
    want = ref.linear(x[:64], w).float()
    assert (matmul(x[:64], w).float() - want).norm() / want.norm() < 1e-2


def test_the_probe_sees_vendor_matmul_rows_move() -> None:
    """cuBLAS changes a row's bits with M on at least one projection (else the probe above
    could not tell an invariant kernel from a lucky one)."""
    moved = []
    for N, K in PROJECTIONS:
        x, w = randn(256, K), randn(N, K, seed=1) * K**-0.5
        alone = ref.linear(x[:1], w)
        moved += [(N, K, m) for m in ROW_COUNTS if not torch.equal(ref.linear(x[:m], w)[:1], alone)]
    assert moved


@pytest.mark.parametrize("dim", [128, 2560, 4096])
def test_norm_rows_do_not_depend_on_the_batch(dim: int) -> None:
    from reference_engine.kernels.norms import gated_rms_norm, rms_norm

    x, w, z = randn(1000, dim), randn(dim, seed=1), randn(1000, dim, seed=2)
    for offset in (False, True):
        alone = rms_norm(x[:1], w, 1e-6, offset)
        for m in (2, 16, 1000):
            assert torch.equal(rms_norm(x[:m], w, 1e-6, offset)[:1], alone)
    assert torch.equal(gated_rms_norm(x[:3], z[:3], w, 1e-6)[:1], gated_rms_norm(x[:1], z[:1], w, 1e-6))


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(32, 8, 128), (16, 4, 256)])
def test_attention_bits_alone_in_a_verify_block_and_in_a_batch(heads: int, kv_heads: int, dim: int) -> None:
    from reference_engine.kernels.attention import attention

    slots, length, B = 4, 2048, 16
    k_cache = randn(slots, length, kv_heads, dim, seed=1)
    v_cache = randn(slots, length, kv_heads, dim, seed=2)
    q = randn(3, B, heads, dim, seed=3)
    positions = torch.tensor(
        [[1000 + t for t in range(B)], [5 + t for t in range(B)], [1500 + t for t in range(B)]], device="cuda"
    )
    slot_ids = torch.tensor([2, 0, 3], device="cuda")
    block = attention(q, k_cache, v_cache, slot_ids, positions, 1516, dim**-0.5)
    for t in (0, 7, 15):  # decode of one token alone, row 0
        alone = attention(
            q[:1, t : t + 1], k_cache, v_cache, slot_ids[:1], positions[:1, t : t + 1], 1001 + t, dim**-0.5
        )
        assert torch.equal(alone[0, 0], block[0, t]), f"token {t} of the block moved"
    one_row = attention(q[:1], k_cache, v_cache, slot_ids[:1], positions[:1], 1016, dim**-0.5)
    assert torch.equal(one_row[0], block[0])
    want = ref.attention(q, k_cache, v_cache, slot_ids, positions, 1516, dim**-0.5)
    assert (block.float() - want.float()).norm() / want.float().norm() < 1e-2


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(32, 8, 128), (16, 4, 256)])
def test_a_prefill_row_gets_the_bits_of_the_same_query_decoded_alone(
    heads: int, kv_heads: int, dim: int
) -> None:
    """A prompt of 300 tokens prefilled from position 0 in one chunk (wide tiles, the causal
    edge inside them) and in chunks of 17 and 100: each row equals that query decoded alone
    (narrow tile)."""
    from reference_engine.kernels.attention import attention

    k_cache, v_cache = randn(2, 512, kv_heads, dim, seed=1), randn(2, 512, kv_heads, dim, seed=2)
    q = randn(1, 300, heads, dim, seed=3)
    slots, scale = torch.tensor([1], device="cuda"), dim**-0.5
    pos = torch.arange(300, device="cuda")[None]
    whole = attention(q, k_cache, v_cache, slots, pos, 300, scale)
    for size in (17, 100):
        parts = [
            attention(q[:, a : a + size], k_cache, v_cache, slots, pos[:, a : a + size], a + size, scale)
            for a in range(0, 300, size)
        ]
        assert torch.equal(torch.cat(parts, dim=1), whole), f"chunks of {size} moved a row"
    for t in (0, 63, 64, 127, 199, 299):
        alone = attention(q[:, t : t + 1], k_cache, v_cache, slots, pos[:, t : t + 1], t + 1, scale)
        assert torch.equal(alone[0, 0], whole[0, t]), f"row {t} of the prefill moved"
    want = ref.attention(q, k_cache, v_cache, slots, pos, 300, scale)
    assert (whole.float() - want.float()).norm() / want.float().norm() < 1e-2


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(32, 8, 128), (16, 4, 256)])
def test_long_context_attention_bits_from_either_split_path(heads: int, kv_heads: int, dim: int) -> None:
    """32K-position caches (16 splits): a query decoded alone (narrow tile, splits apart,
    merged), inside a verify block of 16, inside a prefill chunk of 64 (wide tile, one
    program), and over a longer cache (more splits launched) gets the same bits; near the
    reference."""
    from reference_engine.kernels.attention import SPLIT, attention

    length = 16 * SPLIT
    k_cache, v_cache = randn(2, length, kv_heads, dim, seed=1), randn(2, length, kv_heads, dim, seed=2)
    q = randn(1, 64, heads, dim, seed=3)
    slots = torch.tensor([1], device="cuda")
    chunk_pos = torch.arange(length - 100, length - 36, device="cuda")[None]  # row 40 at length - 60
    scale = dim**-0.5
    chunk = attention(q, k_cache, v_cache, slots, chunk_pos, length - 36, scale)
    alone = attention(q[:, 40:41], k_cache, v_cache, slots, chunk_pos[:, 40:41], length - 59, scale)
    block = attention(q[:, 32:48], k_cache, v_cache, slots, chunk_pos[:, 32:48], length - 52, scale)
    assert torch.equal(alone[0, 0], chunk[0, 40])
    assert torch.equal(block[0, 8], chunk[0, 40])
    longer_k = torch.cat([k_cache, randn(2, SPLIT, kv_heads, dim, seed=4)], dim=1)
    longer_v = torch.cat([v_cache, randn(2, SPLIT, kv_heads, dim, seed=5)], dim=1)
    longer = attention(q[:, 40:41], longer_k, longer_v, slots, chunk_pos[:, 40:41], length - 59, scale)
    assert torch.equal(longer[0, 0], alone[0, 0])
    want = ref.attention(q[:, 40:41], k_cache, v_cache, slots, chunk_pos[:, 40:41], length - 59, scale)
    assert (alone.float() - want.float()).norm() / want.float().norm() < 1e-2


def test_gated_delta_bits_per_token_and_per_block() -> None:
    from reference_engine.kernels.gated_delta import gated_delta

    b, T, H, DK, DV = 3, 16, 32, 128, 128
    q = torch.nn.functional.normalize(randn(b, T, H, DK, dtype=torch.float32), dim=-1) * DK**-0.5
    k = torch.nn.functional.normalize(randn(b, T, H, DK, seed=1, dtype=torch.float32), dim=-1)
    v = randn(b, T, H, DV, seed=2, dtype=torch.float32)
    g = -torch.rand(b, T, H, device="cuda")
    beta = torch.rand(b, T, H, device="cuda")
    s0 = randn(b, H, DK, DV, seed=3, dtype=torch.float32) * 0.1
    states = torch.empty(b, T, H, DK, DV, device="cuda")
    out, final = gated_delta(q, k, v, g, beta, s0, torch.full((b,), T, device="cuda"), states)
    s = s0[:1]
    for t in range(T):  # row 0 decoded one token at a time, alone
        o, s = gated_delta(
            q[:1, t : t + 1], k[:1, t : t + 1], v[:1, t : t + 1], g[:1, t : t + 1], beta[:1, t : t + 1], s
        )
        assert torch.equal(o[0, 0], out[0, t]) and torch.equal(s[0], states[0, t])
    assert torch.equal(s[0], final[0])
    want_out, want_final = ref.gated_delta(q, k, v, g, beta, s0)
    assert (out - want_out).norm() / want_out.norm() < 1e-4


@pytest.mark.parametrize(("N", "K"), PROJECTIONS)
def test_every_tile_configuration_gives_the_same_bits(N: int, K: int) -> None:
    """The matmul's tiles change with M (ROW_TILES), which keeps
    invariance only if no configuration changes any element's bits: full outputs of every
    configuration, and of a few others, compared at row counts on both sides of the switch.
    Inputs span six decades of magnitude, so a different order of the sum would round
    differently somewhere."""
    from reference_engine.kernels.matmul import CONFIGURATIONS, Tiles, matmul

    w = randn(N, K, seed=1) * K**-0.5
    scale = torch.logspace(-3, 3, K, device="cuda")[torch.randperm(K, device="cuda")]
    used = list(CONFIGURATIONS)
    others = [Tiles(16, 64, 128, 4, 4), Tiles(32, 32, 64, 4, 3), Tiles(64, 128, 64, 8, 4)]
    for m in (1, 16, 100, 256):
        x = (randn(m, K, seed=m).float() * scale).to(torch.bfloat16)
        want = matmul(x, w, tiles=used[0])
        for tiles in (*used[1:], *others):
            assert torch.equal(matmul(x, w, tiles=tiles), want), f"{tiles} moved bits at M={m}"


def test_fused_projections_give_the_bits_of_separate_ones() -> None:
    """FusedLinears with the exact kernels: a hybrid model (attention, MLP, Gated DeltaNet
    fused) gives the same logits, bit for bit, fused and unfused, in a prefill and a decode."""
    import copy

    from reference_engine.bench.shapes import random_pair
    from reference_engine.kernels.triton_ops import TRITON
    from reference_engine.models import fuse_projections
    from reference_engine.runtime.decode import new_state

    target, _ = random_pair("qwen3.5-small", "cuda", torch.bfloat16, 0, block_size=8)
    fused = copy.deepcopy(target)
    fuse_projections(fused)
    prompt = torch.randint(0, 4000, (3, 20), device="cuda")
    slots = torch.arange(3, device="cuda")
    logits = []
    for model in (target, fused):
        state = new_state(model, 32, num_slots=3)
        out = model(prompt, torch.arange(20, device="cuda")[None].repeat(3, 1), slots, state, 20, ops=TRITON)
        step = model(prompt[:, :1], torch.full((3, 1), 20, device="cuda"), slots, state, 21, ops=TRITON)
        logits.append((out.logits, step.logits))
    assert torch.equal(logits[0][0], logits[1][0]) and torch.equal(logits[0][1], logits[1][1])


# (hidden, expert intermediate, experts, k) of Qwen3-30B-A3B and Qwen3.5-35B-A3B
MOE_SHAPES = [(2048, 768, 128, 8), (2048, 512, 256, 8)]
TOKEN_COUNTS = [1, 2, 16, 64, 256, 1024, 4096]  # a decode step to a prefill chunk


def moe_inputs(hidden: int, inter: int, experts: int, tokens: int):
    gate_up = randn(experts, 2 * inter, hidden, seed=11) * hidden**-0.5
    down = randn(experts, hidden, inter, seed=12) * inter**-0.5
    x = randn(tokens, hidden, seed=13)
    router = randn(experts, hidden, seed=14) * hidden**-0.5
    return x, router, gate_up, down


@pytest.mark.parametrize(("hidden", "inter", "experts", "k"), MOE_SHAPES)
def test_moe_token_bits_do_not_depend_on_the_other_tokens(
    hidden: int, inter: int, experts: int, k: int
) -> None:
    """Routing and experts of token 0 alone, then among 1 .. 4095 other tokens (new contents
    at every count, so its experts' groups and its place in them change)."""
    from reference_engine.kernels.matmul import matmul
    from reference_engine.kernels.moe import experts as grouped
    from reference_engine.kernels.moe import route_experts

    x, router, gate_up, down = moe_inputs(hidden, inter, experts, max(TOKEN_COUNTS))
    w1, id1 = route_experts(matmul(x[:1], router), k, True)
    alone = grouped(x[:1], w1, id1, gate_up, down)
    for m in TOKEN_COUNTS[1:]:
        x_m = x[:m].clone()
        x_m[1:] = randn(m - 1, hidden, seed=m)
        w, ids = route_experts(matmul(x_m, router), k, True)
        assert torch.equal(ids[:1], id1) and torch.equal(w[:1], w1), f"routing moved at {m} tokens"
        assert torch.equal(grouped(x_m, w, ids, gate_up, down)[:1], alone), f"experts moved at {m} tokens"


@pytest.mark.parametrize(("hidden", "inter", "experts", "k"), MOE_SHAPES)
def test_grouped_experts_give_the_bits_of_one_expert_at_a_time(
    hidden: int, inter: int, experts: int, k: int
) -> None:
    """The grouped products equal one expert at a time through the exact matmul and SwiGLU
    kernels, bit for bit (kernels/moe.py's claim), and the references' loop with cuBLAS to a
    tolerance."""
    from reference_engine.kernels.matmul import matmul
    from reference_engine.kernels.moe import experts as grouped
    from reference_engine.kernels.norms import silu_mul

    x, router, gate_up, down = moe_inputs(hidden, inter, experts, 300)
    weights, ids = ref.route_experts(ref.linear(x, router), k, True)
    got = grouped(x, weights, ids, gate_up, down)
    weighted = torch.empty(*ids.shape, hidden, dtype=x.dtype, device="cuda")
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        projected = matmul(x[token], gate_up[e])
        out = matmul(silu_mul(projected[:, :inter], projected[:, inter:]), down[e])
        weighted[token, slot] = out * weights[token, slot, None]
    one_at_a_time = weighted[:, 0]
    for j in range(1, k):
        one_at_a_time = one_at_a_time + weighted[:, j]
    assert torch.equal(got, one_at_a_time)
    vendor = ref.experts(x, weights, ids, gate_up, down).float()
    assert (got.float() - vendor).norm() / vendor.norm() < 1e-2


def test_moe_kernels_replay_in_a_cuda_graph_for_any_routing() -> None:
    """Captured once, replayed with other tokens (other experts, other group sizes): the same
    bits as eager runs, and the census counts every replay."""
    from reference_engine.kernels.matmul import matmul
    from reference_engine.kernels.moe import experts as grouped
    from reference_engine.kernels.moe import route_experts

    hidden, inter, n_experts, k = MOE_SHAPES[0]
    x, router, gate_up, down = moe_inputs(hidden, inter, n_experts, 64)
    census = torch.zeros(2, dtype=torch.int64, device="cuda")
    static = x.clone()

    def step():
        w, ids = route_experts(matmul(static, router), k, True)
        return grouped(static, w, ids, gate_up, down, census)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    census.zero_()
    for seed in range(3):
        static.copy_(randn(64, hidden, seed=100 + seed))
        graph.replay()
        w, ids = route_experts(matmul(static, router), k, True)
        assert torch.equal(out, grouped(static, w, ids, gate_up, down))
    assert census[1].item() == 3 and 3 * k <= census[0].item() <= 3 * n_experts


@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_every_moe_tile_pair_gives_the_same_bits(tokens: int) -> None:
    from reference_engine.kernels import moe

    hidden, inter, n_experts, k = MOE_SHAPES[1]
    x, router, gate_up, down = moe_inputs(hidden, inter, n_experts, tokens)
    weights, ids = moe.route_experts(ref.linear(x, router), k, True)
    want = moe.experts(x, weights, ids, gate_up, down)
    for pair in (moe.ONE, moe.FEW, moe.MANY, (moe.Tiles(64, 64, 64, 4, 4), moe.Tiles(32, 128, 128, 8, 3))):
        assert torch.equal(moe.experts(x, weights, ids, gate_up, down, tiles=pair), want), pair
