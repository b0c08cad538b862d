"""The GPU tier (`make gate-gpu`): DFlash equals plain greedy bit for bit in bfloat16 under the
exact numerics (reference_engine/kernels), on the shipped demo pair and on real-shaped random
targets whose logits are full of near-ties; the verify logits of every accepted position
equal plain decode's bitwise; a request's logits do not depend on its batch or on how its
prompt was chunked. Each gate is also run with a planted fault and must fail.

`--gate-numerics fast` runs the same gates on the vendor kernels: they then report every
divergence with its top-2 logit margin, and fail. Skipped without CUDA.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.demo import DEMO_DRAFT, DEMO_TARGET
from reference_engine.kernels import TORCH
from reference_engine.runtime.commit import COMMIT_STRATEGIES
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.request import SamplingParams

from .checks import padding_mix_prompts, run_padding_mix
from .exact import describe, divergences, model_ops, plain_with_logits, run_engine, verify_with
from .faults import planted
from .prompts import gate_prompt_ids

CATCHES = ("prefill_padding_past_cells",)

pytestmark = pytest.mark.gpu

DEMO_TOKENS = 128
# Llama 3.1 8B: a dense family without per-head query/key norms and with llama3 RoPE scaling.
# DFLASH_GATE_SHAPES (comma-separated --random-shape names) runs the real-shape gates on others
SHAPES = tuple(os.environ.get("DFLASH_GATE_SHAPES", "qwen3-8b,qwen3.5-4b,llama3.1-8b").split(","))
SHAPE_TOKENS = 24
SHAPE_REQUESTS = 16


@pytest.fixture(scope="module")
def numerics(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--gate-numerics")


def gate_prompts(request: pytest.FixtureRequest, tokenizer_dir, count: int) -> list[list[int]]:
    return gate_prompt_ids(request.config, tokenizer_dir, count)


# ----------------------------------------------------------------------------- 7: the demo pair
@pytest.fixture(scope="module")
def demo(request: pytest.FixtureRequest, numerics: str):
    """The pair under test (the shipped demo pair, or --target-model/--draft-model) in
    bfloat16 on CUDA, its prompts, and plain greedy with logits for each prompt alone."""
    config = request.config
    target_dir = config.getoption("--target-model") or str(DEMO_TARGET)
    draft_dir = config.getoption("--draft-model") or str(DEMO_DRAFT)
    target = load_target(target_dir, dtype=torch.bfloat16, device="cuda")
    draft = load_draft(draft_dir, target)
    max_tokens = config.getoption("--gate-max-tokens") or DEMO_TOKENS
    prompts = {f"p{i}": p for i, p in enumerate(gate_prompts(request, target_dir, 32))}
    ops = model_ops(target, numerics)
    plain = {rid: plain_with_logits(target, p, max_tokens, ops) for rid, p in prompts.items()}
    return target, draft, prompts, max_tokens, plain


@pytest.mark.parametrize("strategy", COMMIT_STRATEGIES)
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_demo_pair_dflash_equals_plain_greedy_in_bfloat16(
    demo, numerics: str, block_size: int, strategy: str
) -> None:
    target, draft, prompts, max_tokens, plain = demo
    if block_size > draft.config.block_size:
        pytest.skip(f"the draft supports block sizes up to {draft.config.block_size}")
    references = {rid: out for rid, (out, _) in plain.items()}
    logits = {rid: lg for rid, (_, lg) in plain.items()}
    config = EngineConfig(
        max_num_seqs=len(prompts),
        block_size=block_size,
        commit_strategy=strategy,
        numerics=numerics,
        max_model_len=max(map(len, prompts.values())) + max_tokens,
    )
    outputs = run_engine(
        target,
        draft,
        prompts,
        max_tokens,
        config,
        check=(prompts, references, logits) if numerics != "fast" else None,
    )
    found = divergences(references, logits, outputs)
    assert not found, describe(found, len(prompts))


def test_cuda_graphs_change_no_bit(demo, numerics: str) -> None:
    """The replayed decode, draft and verify graphs give what the eager forwards give: plain
    and DFlash engines with graphs equal the eager plain runs, drafts included. The DFlash
    engines verify the whole block (a fixed width): the automatic width is chosen from step
    costs measured from the graphs, so an eager engine would choose other widths and draft
    from other anchors (gates/test_verify_width.py gates that choice)."""
    if numerics == "fast":
        pytest.skip("only the exact numerics promise the bits of the eager forwards")
    target, draft, prompts, max_tokens, plain = demo
    references = {rid: out for rid, (out, _) in plain.items()}
    common = dict(
        max_num_seqs=len(prompts),
        block_size=8,
        commit_strategy="per_token",
        max_model_len=max(map(len, prompts.values())) + max_tokens,
    )
    assert run_engine(target, None, prompts, max_tokens, EngineConfig(**common)) == references
    drafted = {}
    for eager in (False, True):
        engine = Engine(target, draft, EngineConfig(**common, enforce_eager=eager, verify_width="fixed"))
        assert (not engine.runner.captured) == eager
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished():
            engine.step()
        drafted[eager] = {rid: (engine.get(rid).output_ids, engine.get(rid).steps) for rid in prompts}
    assert drafted[False] == drafted[True]
    assert {rid: out for rid, (out, _) in drafted[False].items()} == references


def test_demo_gate_fails_on_vendor_kernels_in_the_verify_path(demo, numerics: str) -> None:
    if numerics == "fast":
        pytest.skip("the fault is the fast kernels themselves")
    target, draft, prompts, max_tokens, plain = demo
    references = {rid: out for rid, (out, _) in plain.items()}
    logits = {rid: lg for rid, (_, lg) in plain.items()}
    config = EngineConfig(
        max_num_seqs=len(prompts),
        block_size=8,
        commit_strategy="per_token",
        max_model_len=max(map(len, prompts.values())) + max_tokens,
    )
    with verify_with(linear=TORCH.linear, attention=TORCH.attention, rms_norm=TORCH.rms_norm):
        outputs = run_engine(target, draft, prompts, max_tokens, config)
    assert divergences(references, logits, outputs), "the vendor kernels changed nothing"


def padding_mix_references(demo, numerics: str) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """The padding mix's prompts (gates/checks.py PADDING_MIX) and each one's plain greedy
    decode alone."""
    from .checks import PADDING_MIX

    target, _, prompts, _, _ = demo
    mixed = padding_mix_prompts(next(iter(prompts.values())))
    ops = model_ops(target, numerics)
    return mixed, {
        rid: plain_with_logits(target, ids, PADDING_MIX[rid][1], ops)[0] for rid, ids in mixed.items()
    }


@pytest.mark.parametrize("mode", ["plain", "dflash"])
def test_captured_prefills_on_a_pooled_cache_write_only_their_own_cells(
    demo, numerics: str, mode: str
) -> None:
    """A captured prefill writes its padding's keys and values: on a pooled KV cache a short
    prompt batched with a longer one must not be padded past the cells it holds into the next
    request's (gates/checks.py PADDING_MIX puts a live request right after it). Every output
    equals plain greedy alone, under CUDA graphs."""
    if numerics == "fast":
        pytest.skip("only the exact numerics promise the bits of plain decode alone")
    target, draft, _, _, _ = demo
    mixed, references = padding_mix_references(demo, numerics)
    outputs = run_padding_mix(target, draft if mode == "dflash" else None, mixed, numerics)
    assert outputs == references, f"{mode} on a pooled KV cache under CUDA graphs != plain greedy"


def test_pooled_padding_gate_fails_when_a_short_prompt_is_padded_to_a_longer_ones_bucket(
    demo, numerics: str
) -> None:
    if numerics == "fast":
        pytest.skip("only the exact numerics promise the bits of plain decode alone")
    target, _, _, _, _ = demo
    mixed, references = padding_mix_references(demo, numerics)
    with planted("prefill_padding_past_cells"):
        outputs = run_padding_mix(target, None, mixed, numerics)
    assert outputs["c"] != references["c"], (
        "a short prompt padded into the next request's cells changed nothing"
    )


# ----------------------------------------------------------------------------- 8: real shapes
@pytest.fixture(scope="module", params=SHAPES)
def shaped(request: pytest.FixtureRequest, numerics: str):
    """A real-shaped random target (plain random init: its logits have near-ties), 16
    prompts of mixed lengths, and plain greedy with logits for each alone."""
    from reference_engine.bench.shapes import random_pair

    target, draft = random_pair(request.param, "cuda", torch.bfloat16, seed=3, block_size=16)
    rng = random.Random(5)
    vocab = target.config.vocab_size
    prompts = {
        f"r{i}": [rng.randrange(vocab - 1) for _ in range(rng.randint(5, 160))] for i in range(SHAPE_REQUESTS)
    }
    ops = model_ops(target, numerics)
    plain = {
        rid: plain_with_logits(target, p, SHAPE_TOKENS, ops, prefill_chunk=64) for rid, p in prompts.items()
    }
    yield request.param, target, draft, prompts, plain
    del target, draft
    torch.cuda.empty_cache()


def shaped_run(shaped, numerics: str, concurrency: int, strategy: str = "per_token"):
    name, target, draft, prompts, plain = shaped
    references = {rid: out for rid, (out, _) in plain.items()}
    logits = {rid: lg for rid, (_, lg) in plain.items()}
    rng = random.Random(concurrency)
    oracles = {
        rid: OracleProposer(references[rid], [rng.randrange(16) for _ in range(7)], target.config.vocab_size)
        for rid in prompts
    }
    arrivals = {rid: 3 * i for i, rid in enumerate(prompts)}  # staggered: rows join and leave
    config = EngineConfig(
        max_num_seqs=concurrency,
        block_size=16,
        commit_strategy=strategy,
        prefill_chunk=64,
        numerics=numerics,
        max_model_len=max(map(len, prompts.values())) + SHAPE_TOKENS,
    )
    outputs = run_engine(
        target, draft, prompts, SHAPE_TOKENS, config, arrivals, oracles, check=(prompts, references, logits)
    )
    return references, logits, outputs


@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_real_shapes_dflash_equals_plain_alone_and_verify_logits_are_bitwise(
    shaped, numerics: str, concurrency: int
) -> None:
    strategy = "per_token" if concurrency != 4 else "recompute"
    references, logits, outputs = shaped_run(shaped, numerics, concurrency, strategy)
    found = divergences(references, logits, outputs)
    assert not found, describe(found, len(references))


def test_real_shape_gate_fails_on_a_vendor_matmul_in_verify(shaped, numerics: str) -> None:
    if numerics == "fast":
        pytest.skip("the fault is the fast kernels themselves")
    with verify_with(linear=TORCH.linear), pytest.raises(AssertionError, match="differ"):
        shaped_run(shaped, numerics, 4)


def split_k_when_many_rows(exact_linear):
    """A fault in the style of vendor GEMMs: more than one row reduces K in two halves."""

    def linear(x, weight, bias=None):
        if x.reshape(-1, x.shape[-1]).shape[0] == 1:
            return exact_linear(x, weight, bias)
        half = weight.shape[1] // 2
        lo = exact_linear(x[..., :half].contiguous(), weight[:, :half].contiguous()).float()
        hi = exact_linear(x[..., half:].contiguous(), weight[:, half:].contiguous(), bias).float()
        return (lo + hi).to(x.dtype)

    return linear


def test_real_shape_gate_fails_on_a_split_k_matmul(shaped, numerics: str) -> None:
    if numerics == "fast":
        pytest.skip("the fault is a kernel of the exact table")
    exact = model_ops(shaped[1], numerics)
    with (
        verify_with(linear=split_k_when_many_rows(exact.linear)),
        pytest.raises(AssertionError, match="differ"),
    ):
        shaped_run(shaped, numerics, 4)


def slots_reversed_when_many_tokens(exact_experts):
    """A fault in the style of a batch-dependent MoE reduction: a step of several tokens adds
    each token's k expert outputs in the opposite order."""

    def experts(x, weights, ids, gate_up, down, census=None, residual=None):
        if x.shape[0] == 1:
            return exact_experts(x, weights, ids, gate_up, down, census, residual)
        return exact_experts(x, weights.flip(-1), ids.flip(-1), gate_up, down, census, residual)

    return experts


def test_real_shape_gate_fails_on_an_expert_sum_order_of_its_own_in_verify(shaped, numerics: str) -> None:
    """A mixture of experts whose verify adds each token's k expert outputs in another order
    than decode does (an engine with a separate MoE path for many tokens). The per-expert
    products through cuBLAS in verify are no fault to plant here: on both MoE shapes they
    gave every bit of ours (no split K at these sizes), and the gate rightly passed them."""
    if not shaped[1].config.is_moe:
        pytest.skip("a dense target has no experts")
    if numerics == "fast":
        pytest.skip("the fault is a kernel of the exact table")
    exact = model_ops(shaped[1], numerics)
    with (
        verify_with(experts=slots_reversed_when_many_tokens(exact.experts)),
        pytest.raises(AssertionError, match="differ"),
    ):
        shaped_run(shaped, numerics, 4)


# ----------------------------------------------------------------------------- 9: batch invariance
@torch.inference_mode()
def batched_plain_logits(
    target, prompts: dict[str, list[int]], max_tokens: int, ops, prefill_chunk: int
) -> dict[str, torch.Tensor]:
    """Plain greedy of every request in one batch whose rows join (staggered) and leave:
    one target forward per step over the rows then running. Returns each request's logits."""
    from reference_engine.runtime.decode import new_state

    device = target.model.embed_tokens.weight.device
    ids = list(prompts)
    state = new_state(target, max(map(len, prompts.values())) + max_tokens, num_slots=len(ids))
    rows: dict[str, list[torch.Tensor]] = {rid: [] for rid in ids}
    last: dict[str, int] = {}
    step = 0
    while any(len(rows[r]) < max_tokens for r in ids):
        for slot, rid in enumerate(ids):  # request `slot` arrives at step 2 * slot
            if step == 2 * slot:
                prompt = prompts[rid]
                for start in range(0, len(prompt), prefill_chunk):
                    chunk = prompt[start : start + prefill_chunk]
                    end = start + len(chunk)
                    out = target(
                        torch.tensor([chunk], device=device),
                        torch.arange(start, end, device=device)[None],
                        torch.tensor([slot], device=device),
                        state,
                        end,
                        last_only=True,
                        ops=ops,
                    )
                    state.lengths[slot] = end
                rows[rid].append(out.logits[0, -1])
                last[rid] = int(ops.greedy(out.logits[0, -1]))
        running = [
            s for s, rid in enumerate(ids) if rid in last and len(rows[rid]) < max_tokens and step > 2 * s
        ]
        if running:
            lengths = [state.lengths[s] for s in running]
            out = target(
                torch.tensor([[last[ids[s]]] for s in running], device=device),
                torch.tensor([[n] for n in lengths], device=device),
                torch.tensor(running, device=device),
                state,
                max(lengths) + 1,
                ops=ops,
            )
            for i, s in enumerate(running):
                state.lengths[s] += 1
                rows[ids[s]].append(out.logits[i, -1])
                last[ids[s]] = int(ops.greedy(out.logits[i, -1]))
        step += 1
    return {rid: torch.stack(r) for rid, r in rows.items()}


def assert_batch_invariant(target, prompts, plain, ops) -> None:
    batched = batched_plain_logits(target, prompts, SHAPE_TOKENS, ops, prefill_chunk=48)
    differing = [rid for rid in prompts if not torch.equal(batched[rid], plain[rid][1])]
    assert not differing, (
        f"{len(differing)} of {len(prompts)} requests' logits differ alone "
        f"(prefill chunk 64) and in a batch (prefill chunk 48): {differing}"
    )


def test_logits_are_the_same_alone_in_a_batch_and_for_two_prefill_chunk_sizes(shaped, numerics: str) -> None:
    _, target, _, prompts, plain = shaped
    assert_batch_invariant(target, prompts, plain, model_ops(target, numerics))


def test_batch_gate_fails_on_a_matmul_that_splits_k_for_many_rows(shaped, numerics: str) -> None:
    if numerics == "fast":
        pytest.skip("the fault is a kernel of the exact table")
    _, target, _, prompts, plain = shaped
    ops = model_ops(target, numerics)
    faulty = replace(ops, linear=split_k_when_many_rows(ops.linear))
    with pytest.raises(AssertionError, match="logits differ alone"):
        assert_batch_invariant(target, prompts, plain, faulty)


def test_batch_gate_fails_on_an_expert_sum_whose_order_depends_on_the_step(shaped, numerics: str) -> None:
    _, target, _, prompts, plain = shaped
    if not target.config.is_moe:
        pytest.skip("a dense target has no experts")
    if numerics == "fast":
        pytest.skip("the fault is a kernel of the exact table")
    ops = model_ops(target, numerics)
    faulty = replace(ops, experts=slots_reversed_when_many_tokens(ops.experts))
    with pytest.raises(AssertionError, match="logits differ alone"):
        assert_batch_invariant(target, prompts, plain, faulty)
