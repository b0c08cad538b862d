"""Every Triton kernel against its PyTorch reference (reference_engine/kernels/reference.py),
on small shapes that hit the masks: ragged tiles, odd sizes, padding rows, several key blocks,
windows, valid lengths, ties across vocabulary blocks.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before
the kernels are imported), so CI on CPUs exercises every kernel's indexing and masking. The
interpreter has no bfloat16 matrix product, so the kernels built on `tl.dot` (matmul,
attention) are checked in float32 there; the row kernels in both. Its `tl.dot` is numpy's
matmul, which does not give every row of a tile the same arithmetic on every processor; the
tests run it row by row (tests/interpreter.py), as the device computes it. With CUDA the same
tests run compiled, in bfloat16 as well. Bitwise invariance on the device: tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from reference_engine import kernels  # noqa: E402
from reference_engine.kernels import reference as ref  # noqa: E402
from reference_engine.kernels.argmax import greedy  # noqa: E402
from reference_engine.kernels.attention import attention  # noqa: E402
from reference_engine.kernels.gated_delta import (  # noqa: E402
    DeltaTiles,
    causal_conv_step,
    gated_delta,
    gated_delta_inputs,
    gated_delta_resume,
)
from reference_engine.kernels.matmul import (  # noqa: E402
    CONFIGURATIONS,
    DEEP_K,
    LARGE,
    MANY_ROW_TILES,
    ROW_TILES,
    VOCAB_N,
    WIDE_N,
    Tiles,
    block_n,
    matmul,
    tiles_for,
    tma_ready,
    weight_class,
)
from reference_engine.kernels.norms import add_rms_norm, gated_rms_norm, rms_norm, silu_mul  # noqa: E402
from reference_engine.kernels.rope import attention_inputs  # noqa: E402
from reference_engine.kernels.rows import conv_state_at, copy_rows  # noqa: E402
from reference_engine.models.layers import RotaryEmbedding  # noqa: E402
from tests.interpreter import row_invariant_dots  # noqa: E402
from tests.kernel_inputs import DEVICE, delta_inputs, rand  # noqa: E402

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]
DOT_DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
ROW_DTYPES = [torch.float32, torch.bfloat16]
PREFILL_ROWS = 512  # past this many rows (batched prefill) every projection takes LARGE


@pytest.fixture(autouse=True)
def _dots_like_the_device():
    """Interpreted, `tl.dot` gives every tile row the same arithmetic, as the device's matrix
    instruction does (tests/interpreter.py says why numpy's product does not)."""
    with row_invariant_dots():
        yield


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all(), "non-finite output (an unwritten or misread element)"
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    err = (got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)
    assert err < tol, f"relative error {err:.3g} over {tol:g}"


def test_every_triton_launch_pins_the_compiler_options() -> None:
    """The exact numerics' bits must not move with a compiler default (FP fusion changes its
    default in Triton 3.10): every launch in the kernels package passes **LAUNCH, or, in the
    attention kernels (two code paths that must agree bit for bit) and the attention inputs
    (RoPE's products rounded before their sum, as the reference rounds), **UNFUSED."""
    import ast
    from pathlib import Path

    from reference_engine.kernels.launch import LAUNCH, UNFUSED

    assert LAUNCH == {"enable_fp_fusion": True} and UNFUSED == {"enable_fp_fusion": False}
    launches, unpinned, unfused = 0, [], []
    for path in sorted(Path(kernels.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id.endswith("_kernel")
            ):
                launches += 1
                options = {
                    k.value.id for k in node.keywords if k.arg is None and isinstance(k.value, ast.Name)
                }
                if options not in ({"LAUNCH"}, {"UNFUSED"}):
                    unpinned.append(f"{path.name}:{node.lineno}")
                if options == {"UNFUSED"}:
                    unfused.append(f"{path.stem}.{node.func.value.id}")
    # the compile test checks these for contractable arithmetic: its list must be the code's
    from tests.test_kernels_compile import UNFUSED_KERNELS

    assert unfused == UNFUSED_KERNELS
    attention = ["attention._attention_kernel", "attention._merge_kernel", "rope._attention_inputs_kernel"]
    assert unfused == attention
    assert launches >= 13 and not unpinned, f"launches without **LAUNCH or **UNFUSED: {unpinned}"


# ----------------------------------------------------------------------------- matmul
@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(("M", "N", "K"), [(1, 20, 70), (37, 130, 64), (16, 16, 200), (3, 1, 5)])
def test_matmul_equals_the_reference_on_ragged_tiles(M: int, N: int, K: int, dtype) -> None:
    x, w, b = rand(M, K, dtype=dtype), rand(N, K, dtype=dtype, seed=1), rand(N, dtype=dtype, seed=2)
    assert_close(matmul(x, w), ref.linear(x, w), dtype)
    assert_close(matmul(x, w, b), ref.linear(x, w, b), dtype)


def test_matmul_keeps_leading_dims_and_handles_no_rows() -> None:
    x, w = rand(2, 3, 24), rand(10, 24, seed=1)
    assert matmul(x, w).shape == (2, 3, 10)
    assert matmul(x[:, :0], w).shape == (2, 0, 10)
    with pytest.raises(ValueError, match="x has 24 columns, weight expects 25"):
        matmul(x, rand(10, 25))


def test_matmul_rows_do_not_depend_on_the_other_rows() -> None:
    x, w = rand(37, 96), rand(50, 96, seed=1)
    full = matmul(x, w)
    for i in range(37):  # every row of a tile, and the ragged last tile
        assert torch.equal(matmul(x[i : i + 1], w), full[i : i + 1]), f"row {i}"


def test_the_column_tile_depends_on_the_weight_shape_only() -> None:
    assert block_n(151936, 132) == 128  # the LM head: plenty of programs at the widest tile
    assert block_n(12288, 132) == 64
    assert block_n(4096, 132) == 32  # a narrow projection is split finer to fill the SMs
    assert block_n(20, 132) == 32


def test_the_tiles_switch_with_the_row_count_in_half_precision_and_never_in_float32() -> None:
    shapes = {
        "narrow": (4096, 4096),
        "deep": (4096, DEEP_K),
        "wide": (WIDE_N, DEEP_K),
        "vocab": (VOCAB_N, 4096),
    }
    assert set(shapes) == set(MANY_ROW_TILES)
    for dtype in (torch.bfloat16, torch.float16):
        for name, (N, K) in shapes.items():
            assert weight_class(N, K) == name
            low = 1
            for bound, tiles in (*ROW_TILES, *MANY_ROW_TILES[name]):
                assert tiles_for(low, N, K, dtype, 132) == tiles_for(bound, N, K, dtype, 132) == tiles
                low = bound + 1
            assert low <= PREFILL_ROWS + 1
            assert tiles_for(low, N, K, dtype, 132) == tiles_for(PREFILL_ROWS + 1, N, K, dtype, 132) == LARGE
    assert weight_class(WIDE_N - 1, DEEP_K - 1) == "narrow"
    assert len({tiles_for(m, 4096, 4096, torch.float32, 132) for m in (1, 64, 65, 4096)}) == 1


@pytest.mark.parametrize(("M", "N", "K"), [(70, 56, 256), (5, 24, 64), (33, 136, 200)])
def test_tiles_loaded_by_the_memory_accelerator_index_as_pointer_loads(M: int, N: int, K: int) -> None:
    """The accelerator's tiles (zeros past M, N and K) against the pointer kernel's masked
    loads, the same tile shape, bias or not."""
    bf16 = torch.bfloat16
    x, w, b = rand(M, K, dtype=bf16), rand(N, K, seed=1, dtype=bf16), rand(N, seed=2, dtype=bf16)
    assert tma_ready(x, w, torch.empty(M, N, dtype=torch.bfloat16, device=x.device))
    for bias in (None, b):
        for tiles in (Tiles(16, 32, 64, 4, 2, tma=True), Tiles(32, 16, 32, 4, 2, tma=True)):
            pointer = matmul(x, w, bias, tiles=tiles._replace(tma=False))
            assert torch.equal(matmul(x, w, bias, tiles=tiles), pointer), tiles


@pytest.mark.parametrize("tiles", CONFIGURATIONS)
@pytest.mark.parametrize("K", [300, 256])  # ragged and even along K
def test_matmul_equals_the_reference_under_each_tile_configuration(tiles, K: int) -> None:
    """In the dtype the configurations serve on the GPU, half precision (float32 keeps its
    own tiles; in float32 the deepest of these would overflow an SM's shared memory), and in
    float32 under the interpreter."""
    dtype = DOT_DTYPES[-1]
    x, w, b = rand(70, K, dtype=dtype), rand(50, K, seed=1, dtype=dtype), rand(50, seed=2, dtype=dtype)
    assert_close(matmul(x, w, b, tiles=tiles), ref.linear(x, w, b), dtype)


# ----------------------------------------------------------------------------- row kernels
@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize("offset", [False, True])
def test_rms_norm_equals_the_reference(dtype, offset: bool) -> None:
    x, w = rand(3, 5, 96, dtype=dtype), rand(96, dtype=dtype, seed=1)
    assert_close(rms_norm(x, w, 1e-6, offset), ref.rms_norm(x, w, 1e-6, offset), dtype)


@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize("offset", [False, True])
def test_add_rms_norm_equals_the_reference(dtype, offset: bool) -> None:
    x, r, w = rand(3, 5, 96, dtype=dtype), rand(3, 5, 96, dtype=dtype, seed=1), rand(96, dtype=dtype, seed=2)
    normed, summed = add_rms_norm(x, r, w, 1e-6, offset)
    want_normed, want_summed = ref.add_rms_norm(x, r, w, 1e-6, offset)
    if CUDA:  # compiled, the add rounds as PyTorch's does (the interpreter may round otherwise)
        assert torch.equal(summed, want_summed)
    assert_close(summed, want_summed, dtype)
    assert_close(normed, want_normed, dtype)
    assert torch.equal(normed, rms_norm(summed, w, 1e-6, offset))  # the same norm, in the same pass


def test_gated_rms_norm_rounds_a_float32_input_to_z_and_reads_z_as_a_column_view() -> None:
    """The Gated DeltaNet output: the recurrence's float32 output, z a column range of the
    fused input projection."""
    x = rand(4, 3, 40)
    fused = rand(4, 3, 50, dtype=torch.bfloat16, seed=1)
    z, w = fused[..., 10:], rand(40, dtype=torch.bfloat16, seed=2)
    got = gated_rms_norm(x, z, w, 1e-6)
    assert got.dtype == torch.bfloat16
    assert_close(got, ref.gated_rms_norm(x, z, w, 1e-6), torch.bfloat16)
    if CUDA:  # compiled, the rounding of x is PyTorch's (the interpreter may round otherwise)
        assert torch.equal(got, gated_rms_norm(x.bfloat16(), z.contiguous(), w, 1e-6))


@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_gated_rms_norm_and_swiglu_equal_the_reference(dtype) -> None:
    x, z, w = rand(4, 3, 40, dtype=dtype), rand(4, 3, 40, dtype=dtype, seed=1), rand(40, dtype=dtype, seed=2)
    assert_close(gated_rms_norm(x, z, w, 1e-6), ref.gated_rms_norm(x, z, w, 1e-6), dtype)
    assert_close(silu_mul(x, z), ref.silu_mul(x, z), dtype)


def test_swiglu_reads_column_views_of_one_fused_projection() -> None:
    fused = rand(2, 3, 2 * 40, seed=3)
    gate, up = fused.split([40, 40], dim=-1)
    assert not gate.is_contiguous()
    assert torch.equal(silu_mul(gate, up), silu_mul(gate.contiguous(), up.contiguous()))
    assert_close(silu_mul(gate, up), ref.silu_mul(gate, up), torch.float32)


def attention_inputs_case(dtype, heads: int, kv_heads: int, dim: int, rotary_dim: int, gated: bool):
    """q, k, v as the column views of one fused projection (the engine's layout), their
    norm weights, cos/sin of two rows' positions, and empty caches."""
    batch, T = 2, 3
    q_width = heads * dim * (2 if gated else 1)
    proj = rand(batch, T, q_width + 2 * kv_heads * dim, dtype=dtype, seed=4)
    q, k, v = proj.split([q_width, kv_heads * dim, kv_heads * dim], dim=-1)
    q = q.view(batch, T, heads, -1)
    if gated:  # Qwen3.5: query and gate interleaved per head, query first
        q = q.chunk(2, dim=-1)[0]
    k, v = k.view(batch, T, kv_heads, dim), v.view(batch, T, kv_heads, dim)
    positions = torch.tensor([[5, 6, 7], [0, 1, 2]], device=DEVICE)
    cos, sin = RotaryEmbedding(rotary_dim, 10000.0).to(DEVICE).cos_sin(positions, dtype)
    weights = rand(dim, dtype=dtype, seed=5), rand(dim, dtype=dtype, seed=6)
    return q, k, v, weights, cos, sin, positions, torch.tensor([3, 1], device=DEVICE)


@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "rotary_dim", "offset", "gated", "norms"),
    [
        (4, 2, 64, 64, False, False, True),
        (4, 2, 48, 16, True, True, True),
        (4, 2, 64, 64, False, False, False),
    ],
)
def test_attention_inputs_equal_the_reference(
    dtype, heads, kv_heads, dim, rotary_dim, offset, gated, norms
) -> None:
    """Norms and RoPE (Qwen3, Qwen3.5), or RoPE alone without per-head norms (Llama)."""
    q, k, v, (qw, kw), cos, sin, positions, slots = attention_inputs_case(
        dtype, heads, kv_heads, dim, rotary_dim, gated
    )
    if not norms:
        qw = kw = None
    caches = {
        name: [torch.zeros(4, 10, kv_heads, dim, dtype=dtype, device=DEVICE) for _ in range(2)]
        for name in ("triton", "reference")
    }
    got = attention_inputs(q, k, v, qw, kw, 1e-6, offset, cos, sin, *caches["triton"], slots, positions)
    want = ref.attention_inputs(
        q, k, v, qw, kw, 1e-6, offset, cos, sin, *caches["reference"], slots, positions
    )
    assert_close(got, want, dtype)
    (k_got, v_got), (k_want, v_want) = caches["triton"], caches["reference"]
    assert_close(k_got, k_want, dtype)
    assert torch.equal(v_got, v_want)  # values are copied as they are
    written = torch.zeros(4, 10, dtype=torch.bool, device=DEVICE)
    written[3, 5:8] = written[1, 0:3] = True
    assert (k_got[~written] == 0).all() and (v_got[~written] == 0).all()  # no stray write
    # keys and values alone (the draft's context rows): the same cache contents
    k_only, v_only = torch.zeros_like(k_got), torch.zeros_like(v_got)
    assert (
        attention_inputs(None, k, v, None, kw, 1e-6, offset, cos, sin, k_only, v_only, slots, positions)
        is None
    )
    assert torch.equal(k_only, k_got) and torch.equal(v_only, v_got)


def test_greedy_takes_the_lowest_id_on_a_tie_within_and_across_blocks() -> None:
    logits = rand(5, 40000)  # three first-pass chunks of 16384
    logits[0, 4000] = logits[0, 100] = 50.0  # tie across vocabulary blocks
    logits[1, 3] = logits[1, 7] = 50.0  # tie inside one block
    logits[2] = float("-inf")  # no distribution: `vocab`, as a NaN row
    logits[4, 39999] = logits[4, 20000] = 50.0  # tie across chunks
    got = greedy(logits)
    assert got.tolist()[:3] == [100, 3, 40000] and got[4] == 20000
    assert torch.equal(got, ref.greedy(logits))
    assert greedy(logits[:4].reshape(2, 2, 40000)).shape == (2, 2)


# ----------------------------------------------------------------------------- commit copies
def test_copy_rows_and_conv_state_at_equal_the_reference() -> None:
    """The per_token commit's copies: kept states by (slot, row), and the conv state at each
    row's processed boundary of its recorded conv input (a slice of a longer buffer)."""
    states = rand(6, 3, 5, 7)  # [rows * T, ...]
    slots, kept = torch.tensor([2, 0], device=DEVICE), torch.tensor([4, 1], device=DEVICE)
    recorded = rand(4, 70, 3 + 9, seed=1)[..., : 3 + 6]  # T = 6 of a buffer for 9
    processed = torch.tensor([6, 1], device=DEVICE)
    got = [rand(4, 3, 5, 7, seed=2), rand(4, 70, 3, seed=3)]
    want = [t.clone() for t in got]
    copy_rows(got[0], slots, states, kept)
    ref.copy_rows(want[0], slots, states, kept)
    conv_state_at(got[1], slots, recorded, processed)
    ref.conv_state_at(want[1], slots, recorded, processed)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0][2], states[4]) and torch.equal(got[1][0], recorded[0, :, 1:4])


# ----------------------------------------------------------------------------- attention
def cache(dtype, slots: int = 3, length: int = 150, kv_heads: int = 2, dim: int = 24):
    return rand(slots, length, kv_heads, dim, dtype=dtype), rand(
        slots, length, kv_heads, dim, dtype=dtype, seed=1
    )


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(
    ("causal", "window", "valid"),
    [(True, None, None), (True, 16, None), (False, None, [3, 5]), (False, None, None)],
    ids=["causal", "sliding", "block-valid-len", "block"],
)
def test_attention_equals_the_reference(dtype, causal: bool, window, valid) -> None:
    k_cache, v_cache = cache(dtype)
    T = 5
    slots = torch.tensor([2, 0], device=DEVICE)
    positions = torch.tensor([[100 + i for i in range(T)], [7 + i for i in range(T)]], device=DEVICE)
    q = rand(2, T, 4, 24, dtype=dtype, seed=3)
    valid_len = torch.tensor(valid, device=DEVICE) if valid else None
    args = (q, k_cache, v_cache, slots, positions, 120, 24**-0.5, causal, window, valid_len)
    assert_close(attention(*args), ref.attention(*args), dtype)


def test_a_query_gets_the_same_bits_alone_and_inside_a_verify_block() -> None:
    k_cache, v_cache = cache(torch.float32)
    slots = torch.tensor([1], device=DEVICE)
    block = torch.arange(130, 146, device=DEVICE)[None]  # 16 positions across a key-block edge
    q = rand(1, 16, 4, 24, seed=4)
    together = attention(q, k_cache, v_cache, slots, block, 146, 0.2)
    for t in (0, 9, 15):
        alone = attention(q[:, t : t + 1], k_cache, v_cache, slots, block[:, t : t + 1], 131 + t, 0.2)
        assert torch.equal(alone[0, 0], together[0, t])


@pytest.mark.parametrize(
    ("causal", "window", "T"),
    [(True, None, 1), (True, None, 16), (True, None, 40), (True, 100, 1), (False, None, 8)],
    ids=["decode", "verify", "prefill", "sliding-decode", "block"],
)
def test_split_attention_equals_the_reference(causal: bool, window, T: int) -> None:
    """Keys cut into splits of 64 positions: a decode step and a verify block run each split in
    a program of its own and merge them, a prefill chunk runs them one after the other."""
    k_cache, v_cache = cache(torch.float32, length=300)
    slots = torch.tensor([2, 0], device=DEVICE)
    positions = torch.stack([torch.arange(230, 230 + T), torch.arange(90, 90 + T)]).to(DEVICE)
    q = rand(2, T, 4, 24, seed=3)
    args = (q, k_cache, v_cache, slots, positions, 230 + T, 24**-0.5, causal, window)
    assert_close(attention(*args, split=64), ref.attention(*args), torch.float32)


def test_a_query_gets_the_same_bits_from_either_split_path_and_any_split_count() -> None:
    """Position 200 of slot 1 over splits of 64: decoded alone (splits apart, then merged),
    inside a verify block (apart), inside a prefill chunk (one program, combined as it goes),
    and over a cache twice as long (more splits launched, each past the query a no-op)."""
    k_cache, v_cache = cache(torch.float32, length=300)
    long_k = torch.cat([k_cache, rand(*k_cache.shape, seed=9)], dim=1)
    long_v = torch.cat([v_cache, rand(*v_cache.shape, seed=10)], dim=1)
    slots = torch.tensor([1], device=DEVICE)
    q = rand(1, 40, 4, 24, seed=4)
    prefill = torch.arange(170, 210, device=DEVICE)[None]  # position 200 is row 30
    chunk = attention(q, k_cache, v_cache, slots, prefill, 210, 0.2, split=64)
    alone = attention(q[:, 30:31], k_cache, v_cache, slots, prefill[:, 30:31], 201, 0.2, split=64)
    block = attention(q[:, 24:40], k_cache, v_cache, slots, prefill[:, 24:40], 210, 0.2, split=64)
    longer = attention(q[:, 30:31], long_k, long_v, slots, prefill[:, 30:31], 201, 0.2, split=64)
    assert torch.equal(alone[0, 0], chunk[0, 30])
    assert torch.equal(block[0, 6], chunk[0, 30])
    assert torch.equal(longer[0, 0], alone[0, 0])


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(
    ("causal", "window", "T"),
    [(True, None, 1), (True, None, 16), (True, None, 40), (True, 150, 40), (False, None, 8)],
    ids=["decode", "verify", "prefill", "sliding-prefill", "block"],
)
def test_the_key_blocks_a_tile_sees_whole_give_the_same_bits_unmasked(
    monkeypatch, dtype, causal: bool, window, T: int
) -> None:
    """The blocks every row of a tile sees whole run without the mask; masking them as well
    (MASK_WHOLE_BLOCKS) must change no bit, in one split and across splits."""
    from reference_engine.kernels import attention as module

    k_cache, v_cache = cache(dtype, length=300)
    slots = torch.tensor([2, 0], device=DEVICE)
    positions = torch.stack([torch.arange(230, 230 + T), torch.arange(150, 150 + T)]).to(DEVICE)
    q = rand(2, T, 4, 24, dtype=dtype, seed=3)
    args = (q, k_cache, v_cache, slots, positions, 230 + T, 24**-0.5, causal, window)
    for split in (module.SPLIT, 64):
        unmasked = attention(*args, split=split)
        monkeypatch.setattr(module, "MASK_WHOLE_BLOCKS", True)
        masked = attention(*args, split=split)
        monkeypatch.setattr(module, "MASK_WHOLE_BLOCKS", False)
        assert torch.equal(unmasked, masked)
        assert_close(unmasked, ref.attention(*args), dtype)


def test_a_split_must_be_whole_key_blocks() -> None:
    k_cache, v_cache = cache(torch.float32)
    q, pos, slots = rand(1, 1, 4, 24), torch.tensor([[5]], device=DEVICE), torch.tensor([0], device=DEVICE)
    with pytest.raises(ValueError, match="not a multiple of 64"):
        attention(q, k_cache, v_cache, slots, pos, 6, 0.2, split=100)


# ----------------------------------------------------------------------------- gated delta rule
def test_gated_delta_equals_the_reference_with_valid_lengths_and_per_token_states() -> None:
    q, k, v, g, beta, state = delta_inputs()
    valid = torch.tensor([2, 4], device=DEVICE)
    got_states = torch.full((2, 4, 3, 16, 40), float("nan"), device=DEVICE)
    want_states = torch.zeros_like(got_states)
    out, final = gated_delta(q, k, v, g, beta, state, valid, got_states)
    # the per-token recurrence, which the kernel follows step for step (padded tokens' outputs
    # included; the chunked reference the CPU runs gives its own there)
    want_out, want_final = ref.gated_delta_recurrent(q, k, v, g, beta, state, valid, want_states)
    assert_close(out, want_out, torch.float32)
    assert_close(final, want_final, torch.float32)
    assert_close(got_states, want_states, torch.float32)
    assert torch.equal(final[0], got_states[0, 1])  # row 0 stopped after its 2 valid tokens


@pytest.mark.parametrize("kernel", [gated_delta, ref.gated_delta], ids=["triton", "reference"])
def test_the_checkpoints_spacing_is_read_with_states_out_alone(kernel) -> None:
    """A forward keeping no checkpoints ignores `every` (a state that keeps none has spacing
    0, state.NO_CHECKPOINTS): the same bits as with every = 1; a forward keeping them refuses
    a spacing below 1."""
    q, k, v, g, beta, state = delta_inputs()
    want = kernel(q, k, v, g, beta, state.clone(), None, None, every=1)
    got = kernel(q, k, v, g, beta, state.clone(), None, None, every=0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="every must be >= 1"):
        kernel(q, k, v, g, beta, state.clone(), None, torch.zeros(2, 4, 3, 16, 40, device=DEVICE), every=0)


@pytest.mark.parametrize("kernel", [gated_delta, ref.gated_delta], ids=["triton", "reference"])
def test_a_verify_that_does_not_keep_its_final_state_leaves_the_slots_alone(kernel) -> None:
    """A per_token verify (`keep_final` False): the same outputs and checkpoints, bit for
    bit, and the slots' states as they were (the commit writes them from the checkpoints);
    with it, the rows' slots hold the final state and the other slots are untouched."""
    batch, T, heads, dk, dv = 2, 5, 2, 16, 40
    q, k, v, g, beta, state = delta_inputs(batch, T, heads, dk, dv)
    slots = torch.tensor([3, 1], device=DEVICE)
    runs = {}
    for keep in (True, False):
        slot_states = rand(4, heads, dk, dv, seed=9)
        slot_states[slots] = state
        checkpoints = torch.zeros(batch, 3, heads, dk, dv, device=DEVICE)
        out, _ = kernel(q, k, v, g, beta, slot_states, None, checkpoints, slots, 2, keep_final=keep)
        runs[keep] = out, checkpoints, slot_states
    assert torch.equal(runs[True][0], runs[False][0]) and torch.equal(runs[True][1], runs[False][1])
    untouched = rand(4, heads, dk, dv, seed=9)
    untouched[slots] = state
    assert torch.equal(runs[False][2], untouched)
    _, final = kernel(q, k, v, g, beta, state, None, torch.zeros_like(runs[True][1]), every=2)
    assert torch.equal(runs[True][2][slots], final)
    assert torch.equal(runs[True][2][[0, 2]], untouched[[0, 2]])


@pytest.mark.parametrize("every", [2, 3, 8])
def test_checkpoints_every_few_tokens_and_a_resume_from_them_reach_every_state_bit_for_bit(
    every: int,
) -> None:
    """The per_token commit's path: a verify keeps the state after tokens 0, every, ...; the
    commit runs a row on from the checkpoint at or before its boundary over the inputs. For
    each boundary of each row, the state reached is the very state a verify keeping every
    token passed through there (the same kernel, the same arithmetic). Rows resume in an
    order other than their own and write into slots other than their own."""
    batch, T, heads, dk, dv = 3, 7, 2, 16, 40
    q, k, v, g, beta, state = delta_inputs(batch, T, heads, dk, dv)
    all_states = torch.zeros(batch, T, heads, dk, dv, device=DEVICE)
    gated_delta(q, k, v, g, beta, state, None, all_states)
    kept = -(-T // every)
    checkpoints = torch.full((batch, kept, heads, dk, dv), float("nan"), device=DEVICE)
    gated_delta(q, k, v, g, beta, state, None, checkpoints, every=every)
    assert torch.equal(checkpoints, all_states[:, ::every])
    steps = min(every, T) - 1
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    for processed in range(1, T + 1):
        last = torch.tensor([processed - 1, (processed + 2) % T, T - 1 - (processed - 1)], device=DEVICE)
        at = last // every
        rows = torch.arange(batch, device=DEVICE) * kept + at
        where = (checkpoints.flatten(0, 1), rows, at * every + 1, last - at * every, steps)
        slot_states = torch.full((6, heads, dk, dv), float("nan"), device=DEVICE)
        gated_delta_resume(q, k, v, g, beta, *where, slot_states, slots)
        want = all_states[torch.arange(batch, device=DEVICE), last]
        assert torch.equal(slot_states[slots], want), processed
        assert slot_states[[1, 3, 5]].isnan().all()  # other slots untouched
        reference = torch.full_like(slot_states, float("nan"))
        ref.gated_delta_resume(q, k, v, g, beta, *where, reference, slots)
        assert_close(reference[slots], want, torch.float32)


@pytest.mark.parametrize(
    "tiles", [DeltaTiles(32, 4, False), DeltaTiles(32, 4, True), DeltaTiles(16, 2, True)]
)
def test_a_block_and_its_tokens_one_at_a_time_reach_the_same_bits_under_each_layout(tiles) -> None:
    """Decode, verify and prefill run one layout: under it, a block of T tokens gives each
    token's output and the state after it with the bits of T one-token steps. The inputs
    loaded a token ahead (`prefetch`) change no bit of the layout without."""
    batch, T, heads, dk, dv = 2, 5, 2, 16, 40
    q, k, v, g, beta, state = delta_inputs(batch, T, heads, dk, dv)
    states = torch.zeros(batch, T, heads, dk, dv, device=DEVICE)
    out, final = gated_delta(q, k, v, g, beta, state, None, states, tiles=tiles)
    step_state = state.clone()
    for t in range(T):
        one = [x[:, t : t + 1] for x in (q, k, v, g, beta)]
        step_out, step_state = gated_delta(*one, step_state, tiles=tiles)
        assert torch.equal(step_out[:, 0], out[:, t]) and torch.equal(step_state, states[:, t]), t
    assert torch.equal(step_state, final)
    plain = gated_delta(q, k, v, g, beta, state, None, tiles=tiles._replace(prefetch=not tiles.prefetch))
    assert torch.equal(plain[0], out) and torch.equal(plain[1], final)


def test_gated_delta_inputs_write_into_the_buffers_given() -> None:
    batch, T, k_heads, v_heads, k_dim, v_dim = 2, 3, 2, 4, 16, 24
    mixed = rand(batch, 2 * k_heads * k_dim + v_heads * v_dim, T, seed=7)
    a, b = rand(batch, T, v_heads, seed=8), rand(batch, T, v_heads, seed=9)
    A_log, dt_bias = rand(v_heads, seed=9), rand(v_heads, seed=10)
    want = gated_delta_inputs(mixed, a, b, A_log, dt_bias, k_heads, k_dim, v_dim)
    out = tuple(torch.full_like(w, float("nan")) for w in want)
    got = gated_delta_inputs(mixed, a, b, A_log, dt_bias, k_heads, k_dim, v_dim, out=out)
    assert all(g is o for g, o in zip(got, out))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    with pytest.raises(ValueError, match="out q must be contiguous float32"):
        gated_delta_inputs(mixed, a, b, A_log, dt_bias, k_heads, k_dim, v_dim, out=(out[0][:, :2], *out[1:]))


@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize("T", [1, 5, 20])
def test_causal_conv_step_equals_the_reference_and_moves_slot_states_on_in_place(dtype, T: int) -> None:
    """The conv over each row's slot state and its new inputs (a column view of a fused
    projection), rows of different valid lengths, more tokens than one tile holds."""
    batch, C, kernel = 3, 70, 4
    fused = rand(batch, T, C + 9, dtype=dtype, seed=11)
    x = fused[..., 9:]
    weight = rand(C, 1, kernel, dtype=dtype, seed=12)
    states = rand(6, C, kernel - 1, dtype=dtype, seed=13)
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    valid = torch.tensor([T, max(T - 3, 1), 1], device=DEVICE)
    got_states, want_states = states.clone(), states.clone()
    got = causal_conv_step(x, got_states, slots, weight, valid)
    want = ref.causal_conv_step(x, want_states, slots, weight, valid)
    assert got.shape == want.shape == (batch, C, T)
    assert_close(got, want, dtype)
    assert torch.equal(got_states, want_states)  # the kept inputs are copied, not computed
    assert torch.equal(got_states[[1, 3, 5]], states[[1, 3, 5]])  # other slots untouched
    # a verify's conv keeps its input for the commit, in a buffer longer than the block
    full = torch.cat([states[slots], x.transpose(1, 2)], -1)
    for impl in (causal_conv_step, ref.causal_conv_step):
        record = torch.full((6, C, kernel - 1 + T + 2), -7.0, dtype=dtype, device=DEVICE)
        kept = states.clone()
        out = impl(x, kept, slots, weight, valid, record=record)
        assert torch.equal(out, impl(x, states.clone(), slots, weight, valid))  # nothing else moves
        assert torch.equal(kept, got_states)
        assert torch.equal(record[slots, :, : kernel - 1 + T], full)
        assert (record[slots, :, kernel - 1 + T :] == -7).all() and (record[[1, 3, 5]] == -7).all()
    with pytest.raises(ValueError, match="record must be"):
        causal_conv_step(
            x, states.clone(), slots, weight, valid, record=torch.zeros(6, C, T, dtype=dtype, device=DEVICE)
        )


@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_gated_delta_inputs_equal_the_reference(dtype) -> None:
    """q, k normalised per key head and shared by value heads 2i, 2i+1; v; g; beta. a and b
    are column views of one fused projection, as the engine passes them."""
    batch, T, k_heads, v_heads, k_dim, v_dim = 2, 3, 2, 4, 16, 24
    mixed = rand(batch, 2 * k_heads * k_dim + v_heads * v_dim, T, dtype=dtype, seed=7)
    fused = rand(batch, T, 5 + 2 * v_heads, dtype=dtype, seed=8) * 10  # a's tail past softplus's threshold
    a, b = fused[..., 5 : 5 + v_heads], fused[..., 5 + v_heads :]
    A_log, dt_bias = rand(v_heads, seed=9), rand(v_heads, seed=10)
    got = gated_delta_inputs(mixed, a, b, A_log, dt_bias, k_heads, k_dim, v_dim)
    want = ref.gated_delta_inputs(mixed, a, b, A_log, dt_bias, k_heads, k_dim, v_dim)
    for name, g, w in zip(("q", "k", "v", "g", "beta"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype == torch.float32, name
        # beta is sigmoid(b) rounded to b's dtype: a last-place difference there is one ulp of it
        assert_close(g, w, dtype if name == "beta" else torch.float32)
    assert torch.equal(got[0][:, :, 0], got[0][:, :, 1])  # value heads 0 and 1 share key head 0


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_gated_delta_reads_and_writes_slot_states_in_place(impl: str) -> None:
    """With `slots`, rows start from their slot's state and leave their final state there,
    the same bits as gathering, running and scattering; other slots are untouched."""
    fn = gated_delta if impl == "triton" else ref.gated_delta
    q, k, v, g, beta, state = delta_inputs()
    slots = torch.tensor([3, 0], device=DEVICE)
    states = rand(5, *state.shape[1:], seed=9)
    valid = torch.tensor([2, 4], device=DEVICE)
    want_out, want_final = fn(q, k, v, g, beta, states[slots], valid)
    in_place = states.clone()
    out, none = fn(q, k, v, g, beta, in_place, valid, slots=slots)
    assert none is None and torch.equal(out, want_out)
    assert torch.equal(in_place[slots], want_final)
    others = [1, 2, 4]
    assert torch.equal(in_place[others], states[others])


def test_gated_delta_steps_give_the_same_bits_as_one_block() -> None:
    q, k, v, g, beta, state = delta_inputs()
    block_out, block_final = gated_delta(q, k, v, g, beta, state)
    s = state
    for t in range(4):
        out, s = gated_delta(
            q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1], beta[:, t : t + 1], s
        )
        assert torch.equal(out[:, 0], block_out[:, t])
    assert torch.equal(s, block_final)


# ----------------------------------------------------------------------------- the switch
def test_the_switch_runs_references_off_cuda_and_triton_in_exact_mode_on_cuda() -> None:
    assert kernels.select("exact", "cpu", torch.bfloat16) is kernels.TORCH
    assert kernels.select(None, "cpu", torch.float64) is kernels.TORCH
    fast = kernels.select("fast", "cuda", torch.bfloat16)
    exact = kernels.select(None, "cuda", torch.bfloat16)
    assert exact.name == "triton" and fast.name == "vendor"
    # the fast numerics differ from the exact ones in the matrix products (cuBLAS) and argmax
    # alone, and both are captured as CUDA graphs; the references are not
    assert fast.linear is kernels.TORCH.linear and fast.attention is exact.attention
    assert fast.capturable and exact.capturable and not kernels.TORCH.capturable
    assert kernels.select("fast", "cuda", torch.float64) is kernels.TORCH
    assert kernels.default_numerics("cuda") == "exact" and kernels.default_numerics("cpu") == "fast"
    assert kernels.select(None, "cuda", torch.float64) is kernels.TORCH  # no float64 Triton dots
    with pytest.raises(ValueError, match="numerics must be one of exact, fast, got 'loose'"):
        kernels.select("loose", "cpu", torch.float32)
    with pytest.raises(ValueError, match="not torch.float64; use numerics 'fast'"):
        kernels.select("exact", "cuda", torch.float64)


def test_a_whole_model_runs_through_the_triton_table(tiny_pair) -> None:
    """Every layer routes through the table: a hybrid target's prefill and decode and a
    draft's block pass with the Triton kernels equal the references (float32)."""
    from reference_engine.checkpoint import load_draft, load_target
    from reference_engine.kernels.triton_ops import TRITON
    from reference_engine.models.dflash import DraftState
    from reference_engine.runtime.decode import new_state

    target_dir, draft_dir = tiny_pair("qwen3_5", block_size=4)
    target = load_target(target_dir, dtype=torch.float32, device=DEVICE)
    draft = load_draft(draft_dir, target)
    prompt = torch.tensor([[5, 9, 3, 77, 12, 40, 8]], device=DEVICE)
    slots = torch.tensor([0], device=DEVICE)
    results = {}
    for ops in (kernels.TORCH, TRITON):
        state = new_state(target, 16)
        out = target(
            prompt,
            torch.arange(7, device=DEVICE)[None],
            slots,
            state,
            7,
            capture_layers=draft.config.target_layer_ids,
            ops=ops,
        )
        step = target(prompt[:, :1], torch.tensor([[7]], device=DEVICE), slots, state, 8, ops=ops)
        dstate = DraftState(draft.config, 1, 16, torch.float32, DEVICE)
        draft.append_context(out.features, torch.arange(7, device=DEVICE)[None], slots, dstate, ops)
        block = target.embed(torch.tensor([[8, 1, 1, 1]], device=DEVICE))
        hidden = draft(block, torch.arange(7, 11, device=DEVICE)[None], slots, dstate, 11, ops=ops)
        results[ops.name] = (out.logits, step.logits, draft.logits(hidden, target.lm_head_weight, ops))
    for got, want in zip(results["triton"], results["torch"]):
        assert_close(got, want, torch.float32)
