"""Gates for classes of speculative-core bugs that output equality alone cannot see, or sees
only under one batch, pool or chunking pattern:

- A DFlash2 draft's grouped dynamic convolution, as the engine runs it inside every draft
  forward, equals its definition written out tap by tap, and each layer runs its pairs in
  order (the attention's side 0 before it and side 1 after, then the MLP's): a dropped tap or
  a swapped side costs acceptance only, and is the same alone and batched.
- A sampled DFlash2 row's walk draws each slot from the distribution over the edges out of
  the candidate the slot before it drew, and reports that distribution as its q.
- Logit bias applies to every generated token, the first one (chosen from the prefill's
  logits, before any token is out) included, plain and DFlash.
- On a pooled KV cache the draft's context rows live in the requests' cells too: every
  request drafts, step by step, what it drafts on a cache of one room per slot (a draft that
  reads or writes the wrong rows costs acceptance only, so the outputs cannot show it).
- Stop strings cut where their definition cuts, whatever the chunking: the first token that
  completes one ends the output, the text is cut where the earliest stop string in it
  begins (one token often completes two), and no part of a stop string is ever sent.
"""

from __future__ import annotations

import random

import pytest
import torch

from reference_engine.models import dflash2 as dflash2_module
from reference_engine.runtime import speculative_step as speculative_step_module
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams
from reference_engine.serving.stop_strings import StopStringText

from . import test_kv_pool as pool_gate
from .checks import Pair, require_block
from .faults import planted
from .hooks import hooked

BLOCK = 8
CATCHES = (
    "dflash2_conv_drops_last_tap",
    "dflash2_after_conv_reads_before_side",
    "dflash2_sampled_walk_ignores_predecessor",
    "logit_bias_from_second_token",
    "pooled_draft_rows_are_slots",
    "stop_string_first_listed_cuts",
)


def dflash2_only(pair: Pair) -> None:
    if not pair.draft.config.is_dflash2:
        pytest.skip(f"{pair.name}: not a DFlash2 draft")


def run_batch(pair: Pair, params: list[SamplingParams], **options) -> dict[str, list[int]]:
    """The pair's prompts with `params` each, in one eager engine; each request's output."""
    config = EngineConfig(
        max_num_seqs=len(params), block_size=BLOCK, enforce_eager=True, numerics=pair.numerics, **options
    )
    engine = Engine(pair.target, pair.draft, config)
    for i, p in enumerate(params):
        engine.add_request(str(i), list(pair.prompts[i % len(pair.prompts)]), p)
    while engine.has_unfinished():
        engine.step()
    return {str(i): engine.collect(str(i)).output_ids for i in range(len(params))}


# ------------------------------------------------------------------ DFlash2 convolution
def conv_by_definition(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """out[b, i, c] = sum over taps t <= i of (base[t, c] + delta[b, i, t, c // group]) * x[b, i - t, c],
    in float64, one tap at a time."""
    batch, length, hidden = x.shape
    taps, groups = delta.shape[-2:]
    group = hidden // groups
    x, base, delta = x.double(), base.double(), delta.double()
    out = torch.zeros_like(x)
    for i in range(length):
        for t in range(min(taps, i + 1)):
            weight = base[t] + delta[:, i, t].repeat_interleave(group, dim=-1)  # [batch, hidden]
            out[:, i] += weight * x[:, i - t]
    return out


def test_dflash2_convolution_in_the_engine_equals_its_definition(pair: Pair) -> None:
    dflash2_only(pair)
    require_block(pair, BLOCK)
    check_dflash2_convolution(pair)


@pytest.mark.parametrize(
    ("fault", "caught"),
    [
        ("dflash2_conv_drops_last_tap", "differs from its definition"),
        ("dflash2_after_conv_reads_before_side", "another tap table"),
    ],
)
def test_the_convolution_gate_catches_a_dropped_tap_and_a_swapped_side(
    pair: Pair, fault: str, caught: str
) -> None:
    dflash2_only(pair)
    require_block(pair, BLOCK)
    with planted(fault), pytest.raises(AssertionError, match=caught):
        check_dflash2_convolution(pair)


def check_dflash2_convolution(pair: Pair) -> None:
    seen: list[tuple[torch.Tensor, ...]] = []

    def recording(correct):
        def grouped_conv(x, base, delta):
            out = correct(x, base, delta)
            seen.append((x.clone(), base.clone(), delta.clone(), out.clone()))
            return out

        return grouped_conv

    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    with hooked((dflash2_module, "grouped_conv", recording)):
        run_batch(pair, [greedy] * 3)
    assert seen and max(x.shape[1] for x, *_ in seen) > pair.draft.config.conv_kernel_size
    # each layer, in order: the attention's pair (side 0 before it, side 1 after), the MLP's pair
    sides = [
        (f"layer {i} {name} side {side}", conv.base_kernel[side])
        for i, layer in enumerate(pair.draft.layers)
        for name, conv in (("attention", layer.attention_conv), ("mlp", layer.mlp_conv))
        for side in (0, 1)
    ]
    assert len({tuple(base.flatten().tolist()) for _, base in sides}) == len(sides)  # all told apart
    assert len(seen) % len(sides) == 0
    for n, (x, base, delta, out) in enumerate(seen):
        where, want = sides[n % len(sides)]
        assert torch.equal(base, want), f"{pair.name}: convolution {n} ({where}) runs another tap table"
        error = float((out.double() - conv_by_definition(x, base, delta)).abs().max())
        assert error <= 1e-9, (
            f"{pair.name}: convolution {n} ({where}) differs from its definition by {error:.3g}"
        )


# ------------------------------------------------------------------ DFlash2 sampled walk
TEMPERATURE = 0.7


def test_a_sampled_dflash2_walk_draws_from_the_edges_of_the_candidate_drawn_before(pair: Pair) -> None:
    dflash2_only(pair)
    require_block(pair, BLOCK)
    check_sampled_walk(pair)


def test_the_walk_gate_catches_a_walk_from_the_first_candidate(pair: Pair) -> None:
    dflash2_only(pair)
    require_block(pair, BLOCK)
    with (
        planted("dflash2_sampled_walk_ignores_predecessor"),
        pytest.raises(AssertionError, match="drawn before"),
    ):
        check_sampled_walk(pair)


def check_sampled_walk(pair: Pair) -> None:
    seen: list[tuple[torch.Tensor, ...]] = []

    def recording(correct):
        def sample_walk(candidates, edges, *args, **kwargs):
            tokens, q = correct(candidates, edges, *args, **kwargs)
            seen.append((candidates.clone(), edges.clone(), tokens.clone(), q.clone()))
            return tokens, q

        return sample_walk

    sampled = [
        SamplingParams(max_tokens=16, ignore_eos=True, temperature=TEMPERATURE, seed=s) for s in range(3)
    ]
    with hooked((speculative_step_module, "sample_walk", recording)):
        run_batch(pair, sampled)
    assert len(seen) > 3
    moved = 0  # slots whose predecessor was not the first candidate
    for n, (candidates, edges, tokens, q) in enumerate(seen):
        previous = 0  # slot 1's row: the anchor
        for j in range(candidates.shape[0]):
            scores = edges[j, previous].double() / TEMPERATURE
            expected = torch.zeros(q.shape[-1], dtype=torch.float64)
            expected[candidates[j]] = torch.softmax(scores, dim=-1)
            error = float((q[j].double() - expected).abs().max())
            assert error <= 1e-6, (
                f"{pair.name}: walk {n}, slot {j + 1}: q is not the distribution over the edges out of "
                f"the candidate drawn before (|diff| {error:.3g})"
            )
            drawn = int(tokens[j])
            assert drawn in candidates[j].tolist(), f"walk {n}, slot {j + 1}: drew {drawn}, not a candidate"
            previous = candidates[j].tolist().index(drawn)
            moved += previous != 0
    assert moved > 0, "every draw took the first candidate: the check does not see a predecessor"


# ------------------------------------------------------------------ logit bias from the first token
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_logit_bias_applies_to_the_first_token_too(pair: Pair, speculative: bool) -> None:
    """A bias large enough to decide every token: the output is that token from the first on,
    in a batch beside an unbiased request that decodes as plain greedy alone."""
    require_block(pair, BLOCK)
    check_logit_bias(pair, speculative)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_the_logit_bias_gate_catches_a_bias_that_skips_the_first_token(pair: Pair, speculative: bool) -> None:
    require_block(pair, BLOCK)
    with planted("logit_bias_from_second_token"), pytest.raises(AssertionError, match="did not decide"):
        check_logit_bias(pair, speculative)


def check_logit_bias(pair: Pair, speculative: bool) -> None:
    free = SamplingParams(max_tokens=6, ignore_eos=True)
    first = generate_plain(pair.target, list(pair.prompts[0]), free).output_ids[0]
    favoured = (first + 1) % pair.target.config.vocab_size  # never the unbiased first token
    biased = SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=((favoured, 100.0),))
    config = EngineConfig(max_num_seqs=2, block_size=BLOCK if speculative else None, numerics=pair.numerics)
    engine = Engine(pair.target, pair.draft if speculative else None, config)
    engine.add_request("biased", list(pair.prompts[0]), biased)
    engine.add_request("free", list(pair.prompts[1]), free)
    while engine.has_unfinished():
        engine.step()
    biased_ids = engine.collect("biased").output_ids
    assert biased_ids == [favoured] * 6, (
        f"{pair.name}: a logit bias of 100 on {favoured} did not decide every token: {biased_ids}"
    )
    want = generate_plain(pair.target, list(pair.prompts[1]), free).output_ids
    assert engine.collect("free").output_ids == want


# ------------------------------------------------------------------ the draft's cache in a pool
def drafted_by_request(pair: Pair, pooled: bool) -> dict[str, list[list[int]]]:
    """The pooled-cache gate's mix of long and short requests (gates/test_kv_pool.py) on a
    DFlash engine, with or without the pool: each request's drafted tokens, step by step."""
    config = EngineConfig(
        max_num_seqs=4,
        block_size=pool_gate.BLOCK,
        max_model_len=pool_gate.MAX_MODEL_LEN,
        kv_cache_tokens=pool_gate.POOL if pooled else None,
        kv_cell_tokens=pool_gate.CELL,
        numerics=pair.numerics,
    )
    engine = Engine(pair.target, pair.draft, config)
    wanted = pool_gate.requests(pair)
    for rid, (ids, params) in wanted.items():
        engine.add_request(rid, ids, params)
    while engine.has_unfinished():
        engine.step()
    return {rid: [step.drafted for step in engine.collect(rid).steps] for rid in wanted}


def test_a_pooled_cache_changes_no_draft_proposal(pair: Pair) -> None:
    """The draft's context keys and values live in the pool's cells too: with cells taken in
    turn by requests that come and go, every request drafts, step by step, the tokens it
    drafts on a cache of one room per slot (the draft is batch-invariant, and the default
    verify width is the whole block, so the steps are the same ones)."""
    require_block(pair, pool_gate.BLOCK)
    check_pooled_drafts(pair)


def test_the_pooled_draft_gate_catches_draft_rows_that_ignore_the_cells(pair: Pair) -> None:
    require_block(pair, pool_gate.BLOCK)
    with planted("pooled_draft_rows_are_slots"), pytest.raises(AssertionError, match="pooled KV cache"):
        check_pooled_drafts(pair)


def check_pooled_drafts(pair: Pair) -> None:
    pooled, slots = drafted_by_request(pair, True), drafted_by_request(pair, False)
    assert sum(len(steps) for steps in slots.values()) > 10
    for rid, want in slots.items():
        got = pooled[rid]
        if got != want:
            k = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            raise AssertionError(
                f"{pair.name}: request {rid} drafts other tokens on a pooled KV cache from its step {k}: "
                f"{got[k : k + 1]} against {want[k : k + 1]} on one room per slot"
            )


# ------------------------------------------------------------------ stop strings by definition
def stop_by_definition(pieces: list[str], ids: list[int], stops: tuple[str, ...]) -> tuple[str, list[int]]:
    """The rule written out: the first token whose text completes a stop string ends the
    output, the text cut where the earliest stop string in it begins, the ids kept through
    that token; without a stop, all of it."""
    for k in range(1, len(ids) + 1):
        text = "".join(pieces[i] for i in ids[:k])
        found = [at for at in (text.find(stop) for stop in stops) if at >= 0]
        if found:
            return text[: min(found)], ids[:k]
    return "".join(pieces[i] for i in ids), list(ids)


def test_stop_strings_cut_by_their_definition_for_every_chunking() -> None:
    """Toy vocabularies of short pieces over a few letters (so stop strings start inside a
    token, span tokens, and one token often completes two stop strings at once), stop strings
    cut from the text itself or absent, each output pushed in chunks of 1, 2, 3 and 8
    tokens: the text and ids are the definition's, and the streamed text never holds a part
    of a stop string that the output's end then completes."""
    check_stop_strings()


def test_the_stop_string_gate_catches_a_cut_at_the_first_listed_stop() -> None:
    with (
        planted("stop_string_first_listed_cuts"),
        pytest.raises(AssertionError, match="the definition gives"),
    ):
        check_stop_strings()


def check_stop_strings() -> None:
    rng = random.Random(5)
    cases = 0
    for _ in range(150):
        pieces = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 3))) for _ in range(12)]
        ids = [rng.randrange(len(pieces)) for _ in range(rng.randint(1, 14))]
        whole = "".join(pieces[i] for i in ids)
        stops = tuple(
            whole[a : a + rng.randint(2, 5)]
            if whole and rng.random() < 0.8
            else "cccc" + "a" * rng.randint(0, 2)
            for a in (rng.randrange(max(len(whole), 1)) for _ in range(rng.randint(1, 3)))
        )
        stops = tuple(s for s in stops if len(s) > 1) or ("zz",)
        want = stop_by_definition(pieces, ids, stops)
        for size in (1, 2, 3, 8):
            text = StopStringText(
                lambda token_ids, pieces=pieces: "".join(pieces[i] for i in token_ids), stops
            )
            got_text, got_ids = "", []
            chunks = [ids[i : i + size] for i in range(0, len(ids), size)]
            for n, chunk in enumerate(chunks):
                out, taken = text.push(chunk, final=n == len(chunks) - 1)
                got_text += out
                got_ids += taken
            assert (got_text, got_ids) == want, (
                f"pieces {pieces}, ids {ids}, stops {stops}, chunks of {size}: got {(got_text, got_ids)}, "
                f"the definition gives {want}"
            )
            cases += 1
    assert cases == 600
