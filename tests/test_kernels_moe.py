"""The mixture-of-experts kernels (kernels/moe.py) against their references
(kernels/reference.route_experts and experts), on shapes that hit the masks: a ragged token
tile, experts without pairs, an expert with more pairs than a row tile, K and N off the tile
sizes, more experts than the grouping program reads at a time. And the claims the engine leans
on: a token's bits do not depend on the other tokens or on how many pairs its experts get; the
census counts distinct experts; nothing asks the host (the functions run on tensors alone).

Without CUDA the kernels run under Triton's interpreter in float32 (it has no bfloat16 matrix
product) with `tl.dot` row by row as on the device (tests/interpreter.py); with CUDA the same
tests run compiled, in bfloat16 too. Bitwise claims on the device: tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from reference_engine.kernels import moe  # noqa: E402
from reference_engine.kernels import reference as ref  # noqa: E402
from reference_engine.kernels.launch import LAUNCH  # noqa: E402
from tests.interpreter import row_invariant_dots  # noqa: E402

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
HIDDEN, INTER = 72, 40  # off the tile sizes: K = 72 < 128, N = 40 > 32


@pytest.fixture(autouse=True)
def _dots_like_the_device():
    with row_invariant_dots():
        yield


def rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(device=DEVICE, dtype=dtype)


def stacks(experts: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up = rand(experts, 2 * INTER, HIDDEN, dtype=dtype, seed=seed, scale=HIDDEN**-0.5)
    down = rand(experts, HIDDEN, INTER, dtype=dtype, seed=seed + 1, scale=INTER**-0.5)
    return gate_up, down


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (37, 8, 3), (5, 40, 8)])
@pytest.mark.parametrize("renormalise", [True, False])
def test_routing_picks_the_references_experts_in_ascending_order(
    dtype: torch.dtype, tokens: int, experts: int, top_k: int, renormalise: bool
) -> None:
    logits = rand(tokens, experts, dtype=dtype, seed=tokens)
    weights, ids = moe.route_experts(logits, top_k, renormalise)
    want_weights, want_ids = ref.route_experts(logits, top_k, renormalise)
    assert ids.dtype == torch.int64 and weights.dtype == dtype
    assert torch.equal(ids, want_ids)
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(weights, want_weights, rtol=tol, atol=tol)


def test_an_exact_tie_between_experts_goes_to_the_lower_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]], device=DEVICE)
    _, ids = moe.route_experts(logits, 2, renormalise=True)
    assert ids.tolist() == [[1, 3]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (29, 6, 3), (6, 40, 4), (300, 16, 4)])
def test_experts_equal_the_per_expert_loop(dtype: torch.dtype, tokens: int, experts: int, top_k: int) -> None:
    """29 tokens x 3 of 6 experts: every expert gets more pairs than a 16-row tile (grouped a
    program per expert); 40 experts: more than the one grouping program reads at a time, most
    without pairs; 300 x 4: more pairs than a per-expert program reads at a time, and the
    products' widest tiles."""
    x = rand(tokens, HIDDEN, dtype=dtype, seed=3)
    weights, ids = ref.route_experts(rand(tokens, experts, dtype=dtype, seed=4), top_k, True)
    gate_up, down = stacks(experts, dtype)
    got = moe.experts(x, weights, ids, gate_up, down)
    want = ref.experts(x, weights, ids, gate_up, down)
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(3, 40, 4), (10, 40, 8), (29, 6, 3), (300, 16, 4)])
@pytest.mark.parametrize("per_expert", [False, True])
def test_the_grouping_lists_each_experts_pairs_in_pair_order(
    tokens: int, experts: int, top_k: int, per_expert: bool
) -> None:
    """Both grouping kernels, on fewer pairs than experts and on more (300 x 4: more than a
    per-expert program reads at a time): the groups of a stable sort by expert, their
    starts, the experts the product programs take (listed first, or each at its own row)
    and the census, against plain PyTorch."""
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k].sort().values for _ in range(tokens)])
    ids = ids.to(DEVICE)
    census = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    order, starts, active, programs = moe.group_pairs(ids, experts, census, per_expert=per_expert)
    flat = ids.flatten().cpu()
    counts = torch.bincount(flat, minlength=experts)
    assert order.cpu().tolist() == torch.sort(flat, stable=True).indices.tolist()
    assert starts.cpu().tolist() == [0, *torch.cumsum(counts, 0).tolist()]
    used = (counts > 0).nonzero().flatten().tolist()
    if per_expert:
        assert programs == experts
        assert active.cpu().tolist() == [e if counts[e] else -1 for e in range(experts)]
    else:
        assert programs == tokens * top_k
        assert active.cpu().tolist() == used + [-1] * (experts - len(used))
    assert census.tolist() == [len(used), 1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_residual_is_added_after_the_slot_sum_as_one_more_rounded_add(dtype: torch.dtype) -> None:
    """experts(..., residual) is the bits of residual + experts(...): the layer's residual
    connection in the slot sum's launch changes no bit of the layer's output."""
    tokens, experts, top_k = 7, 8, 3
    x = rand(tokens, HIDDEN, dtype=dtype, seed=3)
    residual = rand(tokens, HIDDEN, dtype=dtype, seed=5, scale=4.0)
    weights, ids = ref.route_experts(rand(tokens, experts, dtype=dtype, seed=4), top_k, True)
    gate_up, down = stacks(experts, dtype)
    alone = moe.experts(x, weights, ids, gate_up, down)
    assert torch.equal(moe.experts(x, weights, ids, gate_up, down, residual=residual), residual + alone)
    want = ref.experts(x, weights, ids, gate_up, down, residual=residual)
    assert torch.equal(want, residual + ref.experts(x, weights, ids, gate_up, down))


def test_a_tokens_bits_do_not_depend_on_the_other_tokens() -> None:
    """A token alone, then at another place among tokens that share its experts (their groups
    grow past a tile, so it lands at another tile row) and tokens routed elsewhere."""
    experts, top_k = 6, 2
    x = rand(40, HIDDEN, seed=5)
    weights, ids = ref.route_experts(rand(40, experts, seed=6), top_k, True)
    gate_up, down = stacks(experts, torch.float32)
    alone = moe.experts(x[:1], weights[:1], ids[:1], gate_up, down)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    shuffled = moe.experts(x[order], weights[order], ids[order], gate_up, down)
    at = (order == 0).nonzero().item()
    assert at != 0
    assert torch.equal(shuffled[at], alone[0])
    assert torch.equal(moe.experts(x, weights, ids, gate_up, down)[0], alone[0])


def test_the_census_counts_distinct_experts_and_calls() -> None:
    experts = 40
    gate_up, down = stacks(experts, torch.float32)
    census = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    x = rand(6, HIDDEN, seed=7)
    ids = torch.tensor([[0, 3], [3, 39], [0, 39], [5, 6], [0, 3], [6, 7]], device=DEVICE)
    weights = torch.full((6, 2), 0.5, device=DEVICE)
    moe.experts(x, weights, ids, gate_up, down, census)
    moe.experts(x[:1], weights[:1], ids[:1], gate_up, down, census)
    assert census.tolist() == [6 + 2, 2]
    reference_census = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    ref.experts(x, weights, ids, gate_up, down, reference_census)
    assert reference_census.tolist() == [6, 1]


def test_no_tokens_give_an_empty_output() -> None:
    gate_up, down = stacks(4, torch.float32)
    x = torch.empty(0, HIDDEN, device=DEVICE)
    ids = torch.empty(0, 2, dtype=torch.int64, device=DEVICE)
    assert moe.experts(x, torch.empty(0, 2, device=DEVICE), ids, gate_up, down).shape == (0, HIDDEN)
    assert moe.route_experts(torch.empty(0, 4, device=DEVICE), 2, True)[1].shape == (0, 2)


def test_experts_whose_probabilities_underflow_to_zero_tie_at_the_lower_ids() -> None:
    """A router whose one expert takes all the probability (the others' float32 softmax is
    exactly 0): the next picks are the lowest ids not yet chosen, never a chosen one again, and
    each token still gets k distinct experts."""
    logits = torch.tensor([[0.0, 0.0, 200.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 200.0]], device=DEVICE)
    weights, ids = moe.route_experts(logits, 3, renormalise=True)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 4]]
    assert weights.tolist() == [[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]


@pytest.mark.parametrize("layout", [(4, 1), (16, 4)])
def test_a_routing_layout_of_several_tokens_a_program_leaves_the_last_programs_spare_rows_alone(
    layout: tuple[int, int],
) -> None:
    """5 tokens in programs of 4 or 16 (`layout`, the sweeps' override): the last program's rows
    past the tokens write nothing (the kernel run into the front of larger buffers leaves the
    rows after the tokens as they were), and every token's experts are the one-token layout's."""
    tokens, experts, top_k = 5, 8, 3
    logits = rand(tokens, experts, seed=11)
    want_weights, want_ids = moe.route_experts(logits, top_k, True)
    padded_ids = torch.full((tokens + 16, top_k), -7, dtype=torch.int64, device=DEVICE)
    padded_weights = torch.full((tokens + 16, top_k), -7.0, device=DEVICE)
    block_t, warps = layout
    moe._route_kernel[(triton.cdiv(tokens, block_t),)](
        logits,
        padded_weights,
        padded_ids,
        tokens,
        experts,
        TOP_K=top_k,
        RENORMALISE=True,
        BLOCK_T=block_t,
        BLOCK_E=triton.next_power_of_2(experts),
        num_warps=warps,
        **LAUNCH,
    )
    assert (padded_ids[tokens:] == -7).all() and (padded_weights[tokens:] == -7.0).all()
    assert torch.equal(padded_ids[:tokens], want_ids)
    weights, ids = moe.route_experts(logits, top_k, True, layout=layout)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-6)


def test_a_residual_that_is_a_strided_view_is_read_by_rows() -> None:
    """The residual may be a view with a row stride of its own (a slice of a wider buffer): the
    layer adds each token's own row, as with a contiguous copy of it."""
    tokens, experts, top_k = 7, 8, 3
    x = rand(tokens, HIDDEN, seed=3)
    wide = rand(tokens, 2 * HIDDEN, seed=5, scale=4.0)
    residual = wide[:, HIDDEN:]
    assert not residual.is_contiguous()
    weights, ids = ref.route_experts(rand(tokens, experts, seed=4), top_k, True)
    gate_up, down = stacks(experts, torch.float32)
    got = moe.experts(x, weights, ids, gate_up, down, residual=residual)
    assert torch.equal(got, moe.experts(x, weights, ids, gate_up, down, residual=residual.contiguous()))
