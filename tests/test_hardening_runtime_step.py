"""Contracts of the runtime's step core (engine.py, sequence.py, speculative_step.py, decode.py,
oracle.py, one_request.py), checked from outside on small CPU shapes:

- fallbacks: a speculative request whose mean acceptance length stays below
  `fallback_min_acceptance` after `fallback_after_steps` drafted steps moves to plain decode
  for the rest of its life, counted once under `low_acceptance`; its output is plain greedy
  decode's either way.
- one request (one_request.py): `generate_speculative` reports the acceptance length each
  drafted step kept (a block cut at max_tokens counts the tokens emitted; the prefill's token
  counts in none), and a sampled request draws from the generator it is given, as the engine
  does with that generator.
- statistics: a request's own counters (`Sequence.spec`) count its steps as the engine's
  totals do, also after the request is pickled; without a pooled cache the KV cache usage and
  the `running` count take every slot held, a prompt still prefilling in chunks included.
- admission: under `reject` with a pooled KV cache, a request that would wait for a run of
  cells is refused at once, leaving no trace.
- the oracle (oracle.py): a schedule is non-empty counts >= 0; with `forced` the engine
  accepts exactly the scheduled count and commits the proposals, one step a turn.
- first tokens: a first token left on the device after its prefill counts as generated, so a
  request's step records do not depend on when the host read that token; the first tokens of
  a batched prefill go each to its own request.
- plain decode (decode.py): the bare loop samples a seeded request with the generator it is
  given, as the engine's plain decode does.
- request checks (request.py): top logprobs in [0, 20] and non-negative stop token ids, one
  step outside refused by name.

The tiny dense Qwen3 target in float64 with a tiny block-8 DFlash draft; captured prefills stand
in as in test_graphs.py; outputs are compared with plain greedy decode of each request alone
(`generate_plain`).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.errors import ConfigError, RequestError
from reference_engine.models import CausalLM
from reference_engine.models.dflash import DFlashDraft
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig, EngineFullError, StepOutput
from reference_engine.runtime.one_request import generate_speculative
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.request import SamplingParams, validate_prompt
from reference_engine.runtime.sequence import StepRecord
from tests.test_graphs import prefill_graphs

TinyPair = Callable[..., tuple[Path, Path]]
F64 = torch.float64
BLOCK = 8
VOCAB = 512
PROMPTS = [
    [17, 301, 5, 88, 260, 42, 7, 199, 33, 410, 2, 95, 61],
    [400, 3, 77, 120, 9],
]


@pytest.fixture(scope="module")
def dense(tiny_pair: TinyPair) -> tuple[CausalLM, DFlashDraft]:
    target_dir, draft_dir = tiny_pair("qwen3", block_size=BLOCK)
    target = load_target(target_dir, dtype=F64)
    return target, load_draft(draft_dir, target)


def greedy(max_tokens: int, **options) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **options)


def plain_output(target: CausalLM, prompt: list[int], params: SamplingParams) -> list[int]:
    return generate_plain(target, prompt, params).output_ids


def engine_for(pair: tuple[CausalLM, DFlashDraft] | CausalLM, **config) -> Engine:
    """An engine over the pair (speculative) or a target alone (plain)."""
    target, draft = pair if isinstance(pair, tuple) else (pair, None)
    if draft is not None:
        config.setdefault("block_size", BLOCK)
    return Engine(target, draft, EngineConfig(**config))


def drain(engine: Engine, limit: int = 400) -> list[StepOutput]:
    """Step until every request is done; every step's outputs, in order."""
    outputs: list[StepOutput] = []
    for _ in range(limit):
        if not engine.has_unfinished():
            return outputs
        outputs += engine.step()
    raise AssertionError(f"engine still busy after {limit} steps")


# ----------------------------------------------------------------------------- fallbacks
def test_a_request_whose_acceptance_stays_low_falls_back_to_plain_decode_once(
    dense: tuple[CausalLM, DFlashDraft],
) -> None:
    """With `fallback_min_acceptance` set, a speculative request whose mean acceptance length
    (bonus included) is below it after `fallback_after_steps` drafted steps falls back to
    plain decode: it drafts no more steps, its fallback reason is `low_acceptance`, the engine
    counts it once; a request whose acceptance is high keeps drafting. Both give plain greedy
    decode's output."""
    target = dense[0]
    after = 2
    engine = engine_for(dense, max_num_seqs=2, fallback_min_acceptance=2.0, fallback_after_steps=after)
    low_truth = plain_output(target, PROMPTS[0], greedy(20 + BLOCK))
    high_truth = plain_output(target, PROMPTS[1], greedy(30 + BLOCK))
    engine.add_request("low", PROMPTS[0], greedy(20), oracle=OracleProposer(low_truth, [0], VOCAB))
    engine.add_request("high", PROMPTS[1], greedy(30), oracle=OracleProposer(high_truth, [BLOCK - 1], VOCAB))
    drain(engine)
    low, high = engine.collect("low"), engine.collect("high")
    assert low.output_ids == low_truth[:20] and high.output_ids == high_truth[:30]
    assert low.fallback_reason == "low_acceptance" and not low.speculative
    assert len(low.steps) == after  # judged after its drafted steps, then no more drafts
    assert high.fallback_reason is None and high.speculative and len(high.steps) >= 3
    assert engine.stats()["fallbacks"] == {"low_acceptance": 1}


# ----------------------------------------------------------------------------- one request
def test_one_requests_acceptance_lengths_count_what_each_step_kept(
    dense: tuple[CausalLM, DFlashDraft],
) -> None:
    """generate_speculative reports one acceptance length per drafted step, the tokens that step
    committed (bonus included) as the output kept them: a last block cut at max_tokens counts
    only the tokens emitted, and the prefill's first token counts in none, so the lengths and
    that token add up to the output (z-lab's per-step acceptance lengths)."""
    target, draft = dense
    budget = 2 * BLOCK - 4  # a full block, then a block cut short
    truth = plain_output(target, PROMPTS[0], greedy(budget + BLOCK))
    oracle = OracleProposer(truth, [BLOCK - 1], VOCAB)
    config = EngineConfig(block_size=BLOCK, commit_strategy="per_token")
    result = generate_speculative(target, draft, PROMPTS[0], greedy(budget), config, oracle=oracle)
    assert result.output_ids == truth[:budget] and result.finish_reason == "length"
    assert result.acceptance_lengths == [BLOCK, budget - 1 - BLOCK]
    assert [s.acceptance_length for s in result.steps] == result.acceptance_lengths
    assert 1 + sum(result.acceptance_lengths) == len(result.output_ids)


def test_one_request_draws_from_the_generator_it_is_given(dense: tuple[CausalLM, DFlashDraft]) -> None:
    """A sampled request run by generate_speculative draws from the caller's generator: the
    same generator state gives the same tokens, the engine given that generator for the same
    request gives them too, and another state gives other tokens."""
    target, draft = dense
    params = SamplingParams(max_tokens=14, temperature=1.0, ignore_eos=True)
    config = EngineConfig(block_size=BLOCK)

    def run(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return generate_speculative(target, draft, PROMPTS[1], params, config, generator=generator).output_ids

    first = run(5)
    assert run(5) == first
    assert run(6) != first
    engine = engine_for(dense, max_num_seqs=2)
    engine.add_request("r", PROMPTS[1], params, generator=torch.Generator().manual_seed(5))
    drain(engine)
    assert engine.collect("r").output_ids == first


# ----------------------------------------------------------------------------- statistics
def test_a_requests_own_counters_are_the_engines_for_it_alone(dense: tuple[CausalLM, DFlashDraft]) -> None:
    """A request's speculative counters (`Sequence.spec`, what the server returns per request
    as spec_decode) count its steps as the engine's totals count them: for a request alone, the
    two are the same, a last block cut at max_tokens counted by the tokens it kept (the
    histogram of acceptance lengths included); a pickled request (what crosses to the server's
    process) is the same request, step records and counters alike."""
    target = dense[0]
    budget = 2 * BLOCK - 4
    truth = plain_output(target, PROMPTS[0], greedy(budget + BLOCK))
    engine = engine_for(dense, max_num_seqs=1)
    engine.add_request("r", PROMPTS[0], greedy(budget), oracle=OracleProposer(truth, [BLOCK - 1], VOCAB))
    drain(engine)
    seq = engine.collect("r")
    totals = engine.stats()["spec"]
    assert seq.spec.as_dict() == totals
    assert totals["acceptance_length_histogram"] == {BLOCK: 1, budget - 1 - BLOCK: 1}
    again = pickle.loads(pickle.dumps(seq))
    assert again.steps == seq.steps and all(isinstance(s, StepRecord) for s in again.steps)
    assert again.spec.as_dict() == totals
    assert (again.output_ids, again.finish_reason) == (seq.output_ids, seq.finish_reason)


def test_the_kv_cache_usage_counts_every_slot_held_prefilling_ones_included(
    dense: tuple[CausalLM, DFlashDraft],
) -> None:
    """Without a pooled cache each request holds a whole slot from its admission: the usage is
    the share of slots taken, a request still prefilling its prompt in chunks included, and
    every slot is free again once the requests are done."""
    target = dense[0]
    engine = engine_for(target, max_num_seqs=4, prefill_chunk=4)
    engine.add_request("long", PROMPTS[0], greedy(3))  # 13 tokens: four chunks
    engine.add_request("short", PROMPTS[1][:3], greedy(6))
    engine.step()
    assert engine.get("long").prefilled < len(PROMPTS[0])
    assert engine.kv_cache_usage() == 0.5
    stats = engine.stats()
    assert (stats["running"], stats["waiting"]) == (2, 0)
    drain(engine)
    assert engine.kv_cache_usage() == 0.0


# ----------------------------------------------------------------------------- admission
def test_reject_admission_refuses_a_request_that_would_wait_for_kv_cache_cells(
    dense: tuple[CausalLM, DFlashDraft],
) -> None:
    """Under admission `reject` with a pooled KV cache, a request whose run of cells is not
    free (the running requests hold the rest) is refused at add_request with EngineFullError
    naming the cells it needs, though a slot is free; it leaves no trace (its id is free, the
    queue unchanged), and a request that fits is taken."""
    target = dense[0]
    engine = engine_for(
        target, max_num_seqs=3, max_model_len=40, kv_cache_tokens=48, kv_cell_tokens=8, admission="reject"
    )
    engine.add_request("a", [3] * 10, greedy(20))  # 30 tokens: 4 of the 6 cells
    engine.step()
    with pytest.raises(EngineFullError, match="no free run of 4 KV cache cells"):
        engine.add_request("b", [3] * 10, greedy(20))
    assert engine.stats()["waiting"] == 0
    engine.add_request("small", [3] * 4, greedy(4))  # 8 tokens: one cell
    drain(engine)
    engine.add_request("b", [3] * 10, greedy(20))  # the refused id is free; the cells are too
    drain(engine)
    assert engine.collect("b").output_ids == plain_output(target, [3] * 10, greedy(20))


# ----------------------------------------------------------------------------- the oracle
@pytest.mark.parametrize("schedule", [[], [-1], [3, -1, 2]], ids=["empty", "negative", "one-negative"])
def test_an_oracle_schedule_must_be_counts_of_at_least_zero(schedule: list[int]) -> None:
    """The oracle's schedule is accepted draft tokens per step: an empty schedule, or any
    negative count in it, is refused when the proposer is built (a negative count would make
    a step accept fewer than nothing and mark the block's last slot wrong instead)."""
    with pytest.raises(ConfigError, match="counts >= 0"):
        OracleProposer([1, 2, 3], schedule, VOCAB)
    OracleProposer([1, 2, 3], [0, 3], VOCAB)  # zero is a count


# ----------------------------------------------------------------------------- first tokens
@pytest.mark.parametrize("budget", [3, 6])
def test_a_first_token_left_on_the_device_counts_as_generated(
    dense: tuple[CausalLM, DFlashDraft], budget: int
) -> None:
    """A first token that the prefill left on the device (prefill.py, `defer_first`, forced
    on here) counts as generated before the host has read it: the first drafted step of a
    request with few tokens left drafts only what it may still commit (max_tokens less that
    token, less one for the bonus at most), so its step records, like its output, are those
    of the same request whose first token was read at once."""
    target = dense[0]
    truth = plain_output(target, PROMPTS[0], greedy(budget + BLOCK))

    def run(defer: bool) -> tuple[list[int], list[tuple]]:
        engine = engine_for(dense, max_num_seqs=1)
        engine.prefill.defer_first = defer
        engine.add_request("r", PROMPTS[0], greedy(budget), oracle=OracleProposer(truth, [BLOCK - 1], VOCAB))
        drain(engine)
        seq = engine.collect("r")
        return seq.output_ids, [tuple(step) for step in seq.steps]

    read_at_once = run(False)
    assert read_at_once[0] == truth[:budget]
    assert read_at_once[1][0][0] == budget - 1  # proposed: every token it had left
    assert run(True) == read_at_once


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_first_tokens_of_a_batched_prefill_left_on_the_device_go_to_their_own_requests(
    dense: tuple[CausalLM, DFlashDraft], speculative: bool
) -> None:
    """Requests admitted together prefill their first chunks in one captured forward (stand-in
    graphs running the real body), and their greedy first tokens stay on the device, one row
    each: every request's stream starts with its own first token, and every output is plain
    greedy decode's."""
    target = dense[0]
    engine = engine_for(dense if speculative else target, max_num_seqs=4, prefill_chunk=16)
    stand_ins = prefill_graphs(engine, 16, pad_slot=3)
    engine.prefill.defer_first = True
    prompts = {"a": PROMPTS[0], "b": PROMPTS[1], "c": [13, 4, 4]}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy(9))
    firsts: dict[str, int] = {}
    for out in drain(engine):
        if out.new_token_ids:
            firsts.setdefault(out.request_id, out.new_token_ids[0])
    for rid, prompt in prompts.items():
        expected = plain_output(target, prompt, greedy(9))
        assert firsts[rid] == expected[0], rid
        assert engine.collect(rid).output_ids == expected, rid
    assert any(len(rows) > 1 for e in stand_ins.values() for rows in e.replays)  # one batch


# ----------------------------------------------------------------------------- plain decode
def test_the_bare_plain_loop_samples_a_seeded_request_as_the_engine_does(
    dense: tuple[CausalLM, DFlashDraft],
) -> None:
    """generate_plain samples at temperature > 0 with the generator it is given, whatever else
    the request names (a seed among them): given a generator seeded as the engine seeds the
    request's own, it gives the engine's plain-decode tokens, and those are not the greedy
    chain."""
    target = dense[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    bare = generate_plain(target, PROMPTS[0], params, generator=torch.Generator().manual_seed(3)).output_ids
    engine = engine_for(target, max_num_seqs=1)
    engine.add_request("r", PROMPTS[0], params)
    drain(engine)
    assert engine.collect("r").output_ids == bare
    assert bare != plain_output(target, PROMPTS[0], greedy(12))


# ----------------------------------------------------------------------------- a forced oracle
@pytest.mark.parametrize("steps_per_turn", [1, 4])
def test_a_forced_oracle_commits_its_scheduled_count_whatever_the_target_says(
    dense: tuple[CausalLM, DFlashDraft], steps_per_turn: int
) -> None:
    """With `forced=True` (benchmarks on random weights) the engine takes the oracle's
    scheduled count as accepted instead of comparing: each drafted step accepts exactly
    min(schedule[step], n) of the proposals, commits those proposals and one token after them
    (a + 1, cut at max_tokens), whatever the target would have chosen, and the engine's
    totals count those acceptances. An oracle's proposals are the host's, so its request runs
    one step a turn whatever `steps_per_turn` allows."""
    budget, schedule = 30, [2, 5, 0, 7]
    continuation = [(7 * i + 3) % VOCAB for i in range(budget + BLOCK)]  # not the target's
    engine = engine_for(dense, max_num_seqs=1, steps_per_turn=steps_per_turn)
    oracle = OracleProposer(continuation, schedule, VOCAB, forced=True)
    engine.add_request("r", PROMPTS[0], greedy(budget), oracle=oracle)
    drain(engine)
    seq = engine.collect("r")
    assert len(seq.output_ids) == budget and len(seq.steps) >= len(schedule)
    at = 1  # the prefill's token
    for k, step in enumerate(seq.steps):
        assert step.accepted == min(schedule[k % len(schedule)], step.proposed), (k, step)
        assert step.acceptance_length == min(step.accepted + 1, budget - at), (k, step)
        kept = seq.output_ids[at : at + step.acceptance_length]
        assert kept[: step.accepted] == list(step.drafted[: step.accepted]), (k, step)
        at += step.acceptance_length
    assert at == budget
    assert engine.stats()["spec"]["accepted"] == sum(step.accepted for step in seq.steps)


# ----------------------------------------------------------------------------- request checks
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\], got 21"),
        ({"logprobs": -1}, r"logprobs must be in \[0, 20\], got -1"),
        ({"stop_token_ids": (5, -1)}, r"stop_token_ids must be non-negative integers, got \[-1\]"),
    ],
    ids=["logprobs-21", "logprobs-negative", "stop-id-negative"],
)
def test_sampling_params_refuse_what_lies_just_outside_their_ranges(options: dict, message: str) -> None:
    """SamplingParams are checked when built: top logprobs in [0, 20] (OpenAI's range, both ends
    taken), stop token ids non-negative (0 taken); one step outside is refused, naming the
    value."""
    with pytest.raises(RequestError, match=message):
        SamplingParams(**options)
    SamplingParams(logprobs=0, stop_token_ids=(0,))
    SamplingParams(logprobs=20)


@pytest.mark.parametrize(
    "fields",
    [
        {"top_k": True},
        {"top_k": 2.5},
        {"logprobs": True},
        {"logprobs": 1.5},
        {"stop_token_ids": (True,)},
        {"logit_bias": ((False, 1.0),)},
        {"max_tokens": True},
        {"seed": False},
    ],
    ids=lambda f: ",".join(f"{k}={v!r}" for k, v in f.items()),
)
def test_a_boolean_or_fraction_where_a_request_takes_an_integer_is_refused(fields: dict) -> None:
    """True and False are Python ints but not a count, a token id or a seed: each integer
    field of SamplingParams refuses them (and fractions) by name."""
    with pytest.raises(RequestError, match=next(iter(fields)).split("_ids")[0]):
        SamplingParams(**fields)


def test_a_boolean_prompt_token_is_refused() -> None:
    with pytest.raises(RequestError, match="outside the vocabulary"):
        validate_prompt([1, True], vocab_size=8, context_len=16, max_tokens=2)


def test_a_seeded_sampled_request_decodes_the_same_in_the_bare_loop_and_the_engine(tmp_path: Path) -> None:
    """generate_plain without a generator seeds one from the request's `seed`, as the engine
    seeds a request's: the same seeded sampled request gives the same tokens from both, and
    again from the bare loop."""
    from reference_engine.checkpoint.synthetic import make_tiny_target

    target = load_target(make_tiny_target(tmp_path / "t", arch="qwen3"), dtype=torch.float64)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    prompt = [5, 9, 2, 7]
    first = generate_plain(target, prompt, params).output_ids
    assert generate_plain(target, prompt, params).output_ids == first
    engine = Engine(target, None, EngineConfig(max_num_seqs=1))
    engine.add_request("r", prompt, params)
    while engine.has_unfinished():
        engine.step()
    assert engine.collect("r").output_ids == first
