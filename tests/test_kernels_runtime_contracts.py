"""Contracts of the kernels and of the runtime's small pieces that comparing a kernel with
its reference cannot see, because both sides would change together, because the difference
hides inside a tolerance, or because Triton's interpreter does not run the setting:

- the PyTorch references (reference_engine/kernels/reference.py) keep their precision
  policy: a bfloat16 causal conv sums its taps in float32, beta is the sigmoid rounded to
  b's dtype, a head of zeros normalises to zeros (eps under the root), the gated norm is
  transformers' bit for bit in half precision, and greedy gives
  `vocab` for a row holding a NaN (how the engine tells a numerical failure from a token);
  the Triton kernels keep the same contract;
- the gated delta rule keeps the state after tokens 0, every, 2 * every, ... as its
  checkpoints, in the recurrence as in the engine's decode step;
- the experts' slot sum rounds each add to the model dtype, and the tile choices that only
  move speed (matmul's column tile, the experts' tiles) switch where their docs say;
- the kernel tables hold what they name (the references' table the references, the fast
  numerics cuBLAS products and PyTorch's argmax over the Triton kernels), and every argmax
  of the kernels breaks ties to the lowest index;
- tensor parallelism (runtime/tensor_parallel.py): a rank looks up only its own vocabulary
  rows, a row-parallel sublayer adds its bias and residual once after the sum, and a rank or
  a size that does not fit the group is refused;
- the step's transfers (runtime/transfer.py) keep the dtype asked for and read a device
  token copy once.

Without CUDA the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here
before they are imported), in float32 where they multiply tiles (tests/test_kernels.py says
why), with `tl.dot` row by row as on the device (tests/interpreter.py).
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from reference_engine.kernels import reference as ref  # noqa: E402
from reference_engine.runtime.tensor_parallel import TensorParallel  # noqa: E402
from tests.kernel_inputs import DEVICE, delta_inputs, rand  # noqa: E402

kernels = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]


def kernel_test(test):
    """The marks of the Triton kernel tests (tests/test_kernels.py's)."""
    for mark in kernels:
        test = mark(test)
    return test


@pytest.fixture
def triton_dots():
    """The Triton kernels, skipped where triton is not installed; interpreted, each `tl.dot`
    row by row (tests/interpreter.py)."""
    pytest.importorskip("triton")
    from tests.interpreter import row_invariant_dots

    with row_invariant_dots():
        yield


def implementation(name: str, function: str):
    """`function` of the references or of the Triton kernels (the table the engine runs)."""
    if name == "reference":
        return getattr(ref, function)
    from reference_engine.kernels.triton_ops import TRITON

    return getattr(TRITON, function)


# ----------------------------------------------------------------------------- greedy
def nan_rows() -> torch.Tensor:
    logits = rand(3, 5000)
    logits[0, 10] = float("nan")  # in the first vocabulary block
    logits[1, 3] = 100.0
    logits[1, 4000] = float("nan")  # after a clear maximum, in a later block
    return logits


def test_greedy_gives_vocab_for_a_row_holding_a_nan() -> None:
    """The engine fails a request whose token is `vocab` (runtime/outputs.py): a NaN row must
    not come back as a token id, nor a row of +inf or of -inf throughout."""
    got = ref.greedy(nan_rows())
    assert got.tolist()[:2] == [5000, 5000]
    assert got[2] == nan_rows()[2].argmax()
    infinite = rand(3, 5000)
    infinite[0, 4000] = float("inf")
    infinite[1] = float("-inf")
    infinite[2, :100] = float("-inf")
    assert ref.greedy(infinite).tolist() == [5000, 5000, int(infinite[2].argmax())]


def first_maximal(logits: torch.Tensor) -> torch.Tensor:
    """greedy's contract read off torch.max over the whole row: its first maximal index, or
    `vocab` where that maximum is not finite (a NaN or +inf in the row, or -inf throughout)."""
    best, ids = logits.max(dim=-1)
    return torch.where(best.isfinite(), ids, logits.shape[-1])


def awkward_logits(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Logits with exact ties inside and across chunks of 64, NaNs before and after a row's
    maximum, infinities, signed zeros and whole rows of one value."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, generator=g, dtype=dtype)
    rows = logits.view(-1, shape[-1])
    vocab = shape[-1]
    kind = seed % 6
    if kind == 0:
        rows.copy_((rows * 2).round())  # many exact ties, across chunks
    elif kind == 1:
        rows[0, seed % vocab] = float("nan")
        rows[-1, vocab - 1] = float("nan")
        rows[-1, 0] = 1e9  # the maximum before a NaN in a later chunk
    elif kind == 2:
        rows[:, ::7] = float("inf")
    elif kind == 3:
        rows.copy_(torch.where(rows > 0, -0.0, 0.0))  # only signed zeros: the first wins
    elif kind == 4:
        rows[0] = float("-inf")
        rows[1:] = 3.0
    else:
        rows[:, vocab - 1] = rows.max() + 1  # the maximum in the last chunk
        rows[:, 63] = rows[:, vocab - 1]  # tied with the end of the first chunk
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 4096), (4, 8, 4096), (3, 128), (2, 64), (5, 4160), (3, 100)])
def test_greedy_on_the_cpu_is_the_first_maximal_index_of_the_whole_row(shape, dtype) -> None:
    """On the CPU a vocabulary of whole chunks of 64 is searched chunk by chunk: the same ids as
    torch.max over the whole row (lowest id on an exact tie, `vocab` for a NaN row), for ties
    across chunks, signed zeros, infinities, NaNs after the maximum, non-contiguous logits,
    logits laid out vocabulary-major (the CPU linear's output, searched in that layout) and no
    rows at all; other vocabularies (one chunk, or not whole chunks) as well."""
    for seed in range(12):
        logits = awkward_logits(seed, shape, dtype)
        assert torch.equal(ref.greedy(logits), first_maximal(logits)), seed
        wide = torch.cat([logits, logits], dim=-1)[..., : shape[-1]]  # non-contiguous rows
        assert torch.equal(ref.greedy(wide), first_maximal(wide)), seed
        # vocabulary-major, as the CPU's linear gives its output (a row's logits rows apart)
        by_vocab = logits.reshape(-1, shape[-1]).T.contiguous().T.reshape(shape)
        assert torch.equal(ref.greedy(by_vocab), first_maximal(logits)), seed
    empty = torch.zeros(0, *shape[1:], dtype=dtype)
    assert ref.greedy(empty).shape == empty.shape[:-1]
    if shape[-1] > ref.GREEDY_CHUNK and shape[-1] % ref.GREEDY_CHUNK == 0:
        logits = awkward_logits(0, shape, dtype)
        assert torch.equal(ref._greedy_by_chunks(logits), first_maximal(logits))


@kernel_test
def test_the_triton_greedy_gives_vocab_for_a_row_holding_a_nan(triton_dots) -> None:
    """Within one chunk of the first pass, and across chunks: a NaN in a later chunk than the
    row's maximum, and in an earlier one, each gives `vocab`; a row without one its argmax."""
    from reference_engine.kernels.argmax import CHUNK_V, greedy

    logits = nan_rows()
    assert torch.equal(greedy(logits), ref.greedy(logits))
    V = 2 * CHUNK_V + 5
    wide = rand(3, V)
    wide[0, 7] = 100.0
    wide[0, CHUNK_V + 1] = float("nan")
    wide[1, 2 * CHUNK_V + 2] = 100.0
    wide[1, 3] = float("nan")
    assert greedy(wide).tolist() == [V, V, int(wide[2].argmax())]


@kernel_test
def test_the_triton_greedy_gives_vocab_for_a_row_whose_maximum_is_infinite(triton_dots) -> None:
    """A +inf in the first chunk, in a later one, beside a NaN, and a row of -inf throughout
    (the masked tail of the last block is -inf too): each gives `vocab`, as the reference's
    greedy; a row with some -inf entries but a finite maximum gives its argmax."""
    from reference_engine.kernels.argmax import CHUNK_V, greedy

    V = 2 * CHUNK_V + 5
    wide = rand(6, V)
    wide[0, 9] = float("inf")
    wide[1, 2 * CHUNK_V + 1] = float("inf")
    wide[2, 5] = float("inf")
    wide[2, CHUNK_V + 5] = float("nan")
    wide[3] = float("-inf")
    wide[4, : CHUNK_V + 3] = float("-inf")  # a finite maximum after a chunk of -inf
    got = greedy(wide)
    assert got.tolist()[:4] == [V] * 4
    assert got[4] == wide[4].argmax() and got[5] == wide[5].argmax()
    assert torch.equal(got, ref.greedy(wide))


# ----------------------------------------------------------------------------- gated norm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gated_norm_is_transformers_bit_for_bit_in_half_precision(dtype: torch.dtype) -> None:
    """Qwen3.5's gated RMSNorm: the normed row rounded to the model dtype before the weight's
    product, then times silu(z) in float32 and rounded once more; in half precision dropping
    the first rounding changes bits, well inside a kernel test's tolerance."""
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 9, 128, generator=gen) * 3).to(dtype)
    z = torch.randn(6, 9, 128, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(128, generator=gen)).to(dtype)
    hf = modeling.Qwen3_5RMSNormGated(128, eps=1e-6).to(dtype)
    hf.weight.data.copy_(weight)
    assert torch.equal(ref.gated_rms_norm(x, z, weight, 1e-6), hf(x, z))


# ----------------------------------------------------------------------------- causal conv
@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=kernels)])
def test_a_bfloat16_causal_conv_sums_its_taps_in_float32(request, impl: str) -> None:
    """Taps 1024, 1, 1, -1024 with unit weights sum to 2 in float32; summed in bfloat16 the
    ones vanish beside 1024 (its spacing there is 8) and the output would be silu(0) = 0."""
    if impl == "triton":
        request.getfixturevalue("triton_dots")
    conv_step = implementation(impl, "causal_conv_step")
    state = torch.tensor([[[1024.0, 1.0, 1.0]]], device=DEVICE).bfloat16()  # [slots, C, kernel-1]
    x = torch.tensor([[[-1024.0]]], device=DEVICE).bfloat16()  # [batch, T, C]
    weight = torch.ones(1, 1, 4, dtype=torch.bfloat16, device=DEVICE)
    out = conv_step(x, state, torch.tensor([0], device=DEVICE), weight)
    want = torch.nn.functional.silu(torch.tensor(2.0).bfloat16())
    assert out.item() == want.item()


# ----------------------------------------------------------------------------- attention inputs
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=kernels)])
def test_a_head_of_zeros_is_normed_to_zeros_not_nan(request, impl: str, offset: bool) -> None:
    """q_norm and k_norm add eps under the root: a head of zeros (a zero projection row) stays
    zero in the queries and in the cache, where a missing eps gives 0 / 0."""
    if impl == "triton":
        request.getfixturevalue("triton_dots")
    from reference_engine.models.layers import RotaryEmbedding

    attention_inputs = implementation(impl, "attention_inputs")
    heads, kv_heads, dim = 2, 1, 16
    q = rand(1, 1, heads, dim)
    q[0, 0, 1] = 0.0
    k, v = torch.zeros(1, 1, kv_heads, dim, device=DEVICE), rand(1, 1, kv_heads, dim, seed=1)
    positions, slots = torch.tensor([[3]], device=DEVICE), torch.tensor([1], device=DEVICE)
    cos, sin = RotaryEmbedding(dim, 10000.0).to(DEVICE).cos_sin(positions, torch.float32)
    weights = rand(dim, seed=2), rand(dim, seed=3)
    k_cache, v_cache = (torch.full((2, 5, kv_heads, dim), 7.0, device=DEVICE) for _ in range(2))
    out = attention_inputs(q, k, v, *weights, 1e-6, offset, cos, sin, k_cache, v_cache, slots, positions)
    assert torch.isfinite(out).all() and (out[0, 0, 1] == 0).all()
    assert (k_cache[1, 3] == 0).all() and torch.equal(v_cache[1, 3], v[0, 0])


# ----------------------------------------------------------------------------- gated delta rule
@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=kernels)])
def test_beta_is_the_sigmoid_rounded_to_b_dtype(request, impl: str) -> None:
    """As transformers computes b.sigmoid() in the model dtype; the result is then float32.
    Interpreted, Triton's cast to bfloat16 may land on the other neighbouring value (one
    ulp): compiled, the kernel's bits are PyTorch's."""
    if impl == "triton":
        request.getfixturevalue("triton_dots")
    inputs = implementation(impl, "gated_delta_inputs")
    batch, T, k_heads, v_heads, k_dim, v_dim = 1, 2, 1, 2, 16, 16
    mixed = rand(batch, 2 * k_heads * k_dim + v_heads * v_dim, T, dtype=torch.bfloat16, seed=1)
    a, b = rand(batch, T, v_heads, dtype=torch.bfloat16, seed=2), rand(batch, T, v_heads, seed=3) * 3
    b = b.bfloat16()
    A_log, dt_bias = rand(v_heads, seed=4), rand(v_heads, seed=5)
    beta = inputs(mixed, a, b, A_log, dt_bias, k_heads, k_dim, v_dim)[4]
    assert beta.dtype == torch.float32
    assert torch.equal(beta, beta.bfloat16().float())  # every value a bfloat16 one
    if impl == "reference" or CUDA:
        assert torch.equal(beta, torch.sigmoid(b).float())


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=kernels)])
def test_a_key_head_of_zeros_is_normalised_to_zeros_not_nan(request, impl: str) -> None:
    """q and k are L2-normalised with eps under the root: a token whose query and key channels
    are all zero reads and writes nothing, where a missing eps gives 0 / 0."""
    if impl == "triton":
        request.getfixturevalue("triton_dots")
    inputs = implementation(impl, "gated_delta_inputs")
    k_heads, v_heads, k_dim, v_dim = 1, 2, 16, 16
    mixed = rand(1, 2 * k_heads * k_dim + v_heads * v_dim, 2, seed=1)
    mixed[:, : 2 * k_dim, 1] = 0.0  # token 1: q and k of its key head
    a, b = rand(1, 2, v_heads, seed=2), rand(1, 2, v_heads, seed=3)
    q, k, *_ = inputs(mixed, a, b, rand(v_heads, seed=4), rand(v_heads, seed=5), k_heads, k_dim, v_dim)
    assert torch.isfinite(q).all() and torch.isfinite(k).all()
    assert (q[:, 1] == 0).all() and (k[:, 1] == 0).all() and (q[:, 0] != 0).any()


def test_the_recurrence_keeps_the_state_after_tokens_0_every_2_every_and_so_on() -> None:
    q, k, v, g, beta, state = delta_inputs(2, 5)
    each = torch.full((2, 5, *state.shape[1:]), float("nan"), device=DEVICE)
    spaced = torch.full((2, 3, *state.shape[1:]), float("nan"), device=DEVICE)
    ref.gated_delta_recurrent(q, k, v, g, beta, state, None, each, every=1)
    ref.gated_delta_recurrent(q, k, v, g, beta, state, None, spaced, every=2)
    assert torch.equal(spaced, each[:, ::2])


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=kernels)])
def test_a_decode_step_keeps_its_state_as_the_first_checkpoint_whatever_the_spacing(request, impl) -> None:
    if impl == "triton":
        request.getfixturevalue("triton_dots")
    step = implementation(impl, "gated_delta")
    q, k, v, g, beta, state = delta_inputs(2, 1)
    kept = torch.full((2, 1, *state.shape[1:]), float("nan"), device=DEVICE)
    _, final = step(q, k, v, g, beta, state, None, kept, every=3)
    assert torch.equal(kept[:, 0], final)


# ----------------------------------------------------------------------------- matmul tiles
@kernel_test
def test_the_column_tile_is_the_widest_that_gives_every_sm_a_program() -> None:
    """Exactly one column program per SM still fills the GPU: the wider tile is kept there,
    and the next narrower one is taken one program short of it."""
    pytest.importorskip("triton")
    from reference_engine.kernels.matmul import block_n

    assert block_n(128 * 132, 132) == 128
    assert block_n(128 * 131, 132) == 64
    assert block_n(64 * 132, 132) == 64
    assert block_n(64 * 131, 132) == 32


@kernel_test
def test_matmul_adds_a_strided_bias_as_the_reference_does(triton_dots) -> None:
    from reference_engine.kernels.matmul import matmul

    x, w, every_other = rand(3, 32), rand(20, 32, seed=1), rand(40, seed=2)
    bias = every_other[::2]
    assert not bias.is_contiguous()
    torch.testing.assert_close(matmul(x, w, bias), ref.linear(x, w, bias), rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------------------- mixture of experts
@kernel_test
def test_the_experts_slot_sum_rounds_each_add_to_the_model_dtype(triton_dots) -> None:
    """Slots 1, 2^-8, 2^-8 in bfloat16: added one at a time and rounded as the reference's
    sum of bfloat16 tensors, 1 + 2^-8 is a tie that rounds to 1, and so is the next add; one
    float32 sum would give 1 + 2^-7. The slot sum is launched alone: the interpreter has no
    bfloat16 matrix product for the products before it."""
    import triton

    from reference_engine.kernels import moe
    from reference_engine.kernels.launch import LAUNCH

    tokens, top_k, hidden = 2, 3, 5
    weighted = torch.tensor([1.0, 2.0**-8, 2.0**-8] * tokens, device=DEVICE)[:, None].expand(-1, hidden)
    weighted = weighted.bfloat16().contiguous()  # [tokens * top_k, hidden], a token's slots in order
    out = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=DEVICE)
    moe._slot_sum_kernel[(tokens, triton.cdiv(hidden, moe.SUM_BLOCK))](
        weighted, weighted, out, hidden, TOP_K=top_k, RESIDUAL=False, BLOCK=moe.SUM_BLOCK, **LAUNCH
    )
    slots = weighted.view(tokens, top_k, hidden)
    assert torch.equal(out, slots[:, 0] + slots[:, 1] + slots[:, 2])
    assert (out == 1.0).all()


@kernel_test
def test_a_decode_step_of_one_request_takes_the_one_token_expert_tiles() -> None:
    """One token routed to 8 experts (Qwen3.5-35B-A3B's top k) is 8 pairs: the one-token tiles
    up to there, the few-pairs tiles from the next pair on."""
    pytest.importorskip("triton")
    from reference_engine.kernels import moe

    assert moe.expert_tiles(moe.ONE_TOKEN_PAIRS, torch.bfloat16) == moe.ONE
    assert moe.expert_tiles(moe.ONE_TOKEN_PAIRS + 1, torch.bfloat16) == moe.FEW
    assert moe.expert_tiles(moe.FEW_PAIRS, torch.bfloat16) == moe.FEW
    assert moe.expert_tiles(moe.FEW_PAIRS + 1, torch.bfloat16) == moe.MANY


# ----------------------------------------------------------------------------- tables
def test_the_torch_table_holds_the_reference_of_each_name() -> None:
    """Every entry of the references' table is reference.py's function of that name. By
    default the references keep no checkpoints (state.NO_CHECKPOINTS), so the engine's tests
    on the CPU never call copy_rows through the table: a wrong entry would go unseen there."""
    from dataclasses import fields

    from reference_engine.kernels import TORCH

    for field in fields(TORCH):
        if field.name not in ("name", "capturable"):
            assert getattr(TORCH, field.name) is getattr(ref, field.name), field.name
    assert TORCH.name == "torch" and not TORCH.capturable


@kernel_test
def test_the_fast_numerics_take_the_products_and_argmax_from_pytorch_and_the_rest_from_triton() -> None:
    pytest.importorskip("triton")
    from dataclasses import fields

    from reference_engine.kernels.triton_ops import TRITON, VENDOR

    for field in fields(VENDOR):
        mine, exact = getattr(VENDOR, field.name), getattr(TRITON, field.name)
        if field.name in ("linear", "greedy"):
            assert mine is getattr(ref, field.name), field.name
        elif field.name != "name":
            assert mine is exact, field.name


# ----------------------------------------------------------------------------- ties
def test_every_kernel_argmax_breaks_ties_to_the_lowest_index() -> None:
    """Greedy and the experts' top k promise the lowest id on an exact tie. Triton's
    interpreter always takes the first maximum (numpy's argmax), whatever `tie_break_left`
    says, so the tie tests cannot see the setting off CUDA: every `tl.argmax` of the kernels
    must leave it at its default, True, or pass True."""
    import ast
    from pathlib import Path

    calls, wrong = 0, []
    for path in sorted(Path(ref.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr not in ("argmax", "argmin") or getattr(node.func.value, "id", None) != "tl":
                    continue
                calls += 1
                for keyword in node.keywords:
                    if keyword.arg == "tie_break_left" and not (
                        isinstance(keyword.value, ast.Constant) and keyword.value.value is True
                    ):
                        wrong.append(f"{path.name}:{node.lineno}")
    assert calls >= 2 and not wrong, f"argmax calls that do not break ties to the left: {wrong}"


# ----------------------------------------------------------------------------- tensor parallelism
class LocalGroup(TensorParallel):
    """A tensor-parallel group simulated in one process: rank r's tensor in a collective is
    parts[r] (this rank's, the one passed in), or, without parts, the same on every rank."""

    def __init__(self, rank: int, world_size: int, parts: list[torch.Tensor] | None = None) -> None:
        super().__init__(rank, world_size, "exact")
        self.parts = parts

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts is None:
            return torch.stack([x] * self.world_size)
        return torch.stack([x if r == self.rank else part for r, part in enumerate(self.parts)])


def test_a_row_parallel_sublayer_adds_its_bias_once_after_the_sum() -> None:
    """Two ranks with the same partial sum p: the sublayer's output is p + p + bias, and the
    residual the layer handed the sublayer is added once as well."""
    from reference_engine.runtime.tensor_parallel import RowParallelOutput

    bias = torch.tensor([10.0, 20.0])
    hooks = RowParallelOutput(LocalGroup(0, 2), bias)
    _, kwargs = hooks.take_residual(None, (), {"residual": torch.tensor([100.0, 100.0])})
    assert "residual" not in kwargs  # the sublayer itself must not add it to each part
    out = hooks(None, (), torch.tensor([1.0, 2.0]))
    assert out.tolist() == [112.0, 124.0]


def test_the_vocabulary_parallel_embedding_looks_up_its_own_rows_only() -> None:
    """Rank 1 of 2 holds ids 4..7: id 8 (past its last row) and id 3 (before its first) look
    up zeros there, which rank 0's or no rank's row fills in the sum."""
    from reference_engine.runtime.tensor_parallel import VocabParallelEmbedding

    weight = torch.arange(12.0).reshape(4, 3) + 1
    embed = VocabParallelEmbedding(weight, 4, LocalGroup(1, 2, [torch.zeros(4, 3), None]))
    rows = embed(torch.tensor([3, 4, 7, 8]))
    assert torch.equal(rows, torch.stack([torch.zeros(3), weight[0], weight[3], torch.zeros(3)]))


def test_a_rank_outside_the_group_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 out of range for a group of 2"):
        TensorParallel(2, 2, "exact")


def test_a_size_of_one_inside_a_larger_group_fails_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun started two processes for a size of 1: each would run the whole model alone."""
    from reference_engine.errors import RequestError
    from reference_engine.runtime.tensor_parallel import init_tensor_parallel

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RequestError, match="--tensor-parallel-size 1 needs 1 processes"):
        init_tensor_parallel(1, torch.device("cpu"), "exact", "generate")


# ----------------------------------------------------------------------------- transfers
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.bool])
def test_small_step_inputs_reach_the_device_in_the_dtype_asked_for(dtype: torch.dtype) -> None:
    from reference_engine.runtime.transfer import to_device

    t = to_device([[1, 0], [3, 4]], DEVICE, dtype)
    assert t.dtype == dtype and t.device.type == torch.device(DEVICE).type
    assert t.tolist() == torch.tensor([[1, 0], [3, 4]], dtype=dtype).tolist()


@pytest.mark.parametrize(
    "values",
    [
        [3, -1, 0, 2**63 - 1, -(2**63)],  # flat ints, int64's ends included
        [[1, 2, 3], [4, 5, 6]],  # rows of one length
        [[7], [8]],
        [1, True, 2],  # a bool after an int: an int to both
        [True, 2],  # first a bool: torch.tensor's own
        [1, 2.5],  # a float: torch.tensor's own (it truncates)
        [[1, 2], (3, 4)],  # a tuple row
        (5, 6),  # a tuple
        [],
        [[]],
        [torch.tensor(4), 5],
    ],
)
def test_small_int_inputs_reach_the_device_as_torch_tensor_makes_them(values) -> None:
    """The step's int inputs take a faster way to a tensor than `torch.tensor` (int64_tensor):
    every shape of list it takes gives the values, shape and dtype torch.tensor gives, and
    what it does not take goes to torch.tensor itself."""
    from reference_engine.runtime.transfer import int64_tensor, to_device, to_pinned

    want = torch.tensor(values, dtype=torch.int64)
    for got in (to_device(values, DEVICE), to_pinned(values)):
        assert got.dtype == torch.int64 and got.shape == want.shape and got.tolist() == want.tolist()
    fast = int64_tensor(values)
    if fast is not None:
        assert fast.dtype == torch.int64 and fast.shape == want.shape and torch.equal(fast, want)


@pytest.mark.parametrize("values", [[[1, 2], [3]], [2**63], [-(2**63) - 1], [[1], [2**64]], [1, "2"]])
def test_int_inputs_torch_tensor_refuses_are_refused_alike(values) -> None:
    """Ragged rows, a number past int64 and a string fail in to_device as in torch.tensor
    (the faster way leaves them to it) rather than giving a tensor."""
    from reference_engine.runtime.transfer import int64_tensor, to_device

    assert int64_tensor(values) is None
    with pytest.raises((ValueError, TypeError, RuntimeError, OverflowError)):
        torch.tensor(values, dtype=torch.int64)
    with pytest.raises((ValueError, TypeError, RuntimeError, OverflowError)):
        to_device(values, DEVICE)


def test_a_step_input_tensor_does_not_change_with_the_list_it_came_from() -> None:
    """The tensor made from a list is its own: changing the list after (the engine reuses
    its lists) changes nothing in it."""
    from reference_engine.runtime.transfer import to_device

    values = [1, 2, 3]
    t = to_device(values, DEVICE)
    values[0] = 9
    assert t.tolist() == [1, 2, 3]


def test_device_tokens_read_their_host_copy_once_for_all_their_tokens() -> None:
    """On CUDA each read of the copy waits for the device: the values are read once, at the
    first token asked for, and kept."""
    from reference_engine.runtime.transfer import DeviceTokens

    tokens = DeviceTokens(torch.tensor([7, 8, 9], device=DEVICE))
    reads = []
    read = tokens.copy.tolist
    tokens.copy.tolist = lambda: reads.append(1) or read()
    assert [tokens.value(i) for i in (2, 0, 1, 2)] == [9, 7, 8, 9]
    assert len(reads) == 1
