"""Gates for the continuous-batching engine: under concurrent batching every request gets
exactly the tokens plain greedy decode gives it alone; fallbacks, aborts and admission
leave the others untouched; statistics are exact under the oracle proposer."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from reference_engine.errors import RequestError
from reference_engine.runtime.commit import COMMIT_STRATEGIES
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig, EngineFullError
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.verify_width import StepCosts

from .checks import EngineRequest, Pair, assert_batch_equivalent, run_engine
from .faults import planted

BLOCK_SIZE = 8
CONCURRENCY = (1, 4, 8, 16)


def make_requests(pair: Pair, oracle: bool, count: int = 16, seed: int = 0):
    rng = random.Random(seed)
    schedules = random.Random(seed + 1)  # its own stream: prompts do not depend on it
    vocab = pair.target.config.vocab_size
    requests = []
    for i in range(count):
        prompt = tuple(rng.randrange(vocab - 16) for _ in range(rng.choice((1, 5, 23, 70, 130))))
        params = SamplingParams(max_tokens=rng.randint(1, 28), ignore_eos=True)
        schedule = tuple(schedules.randrange(BLOCK_SIZE) for _ in range(6)) if oracle else None
        requests.append(EngineRequest(f"req{i}", prompt, params, arrival_step=2 * i, schedule=schedule))
    return requests


@pytest.fixture(scope="module")
def workload(pair: Pair):
    requests = {kind: make_requests(pair, kind == "oracle") for kind in ("draft", "oracle")}
    references = {
        r.request_id: generate_plain(pair.target, list(r.prompt), r.params).output_ids
        for r in requests["draft"]
    }
    return requests, references


def engine_for(pair: Pair, concurrency: int, strategy: str = "replay", **options) -> Engine:
    config = EngineConfig(
        max_num_seqs=concurrency, block_size=BLOCK_SIZE, commit_strategy=strategy, prefill_chunk=48, **options
    )
    return Engine(pair.target, pair.draft, config)


@pytest.mark.parametrize("proposer", ["draft", "oracle"])
@pytest.mark.parametrize("strategy", COMMIT_STRATEGIES)
@pytest.mark.parametrize("concurrency", CONCURRENCY)
def test_every_request_matches_plain_greedy_alone_under_batching(
    pair: Pair, workload, concurrency: int, strategy: str, proposer: str
) -> None:
    requests, references = workload
    engine = engine_for(pair, concurrency, strategy)
    streamed = run_engine(engine, requests[proposer], references)
    assert_batch_equivalent(streamed, references, f"{pair.name} c{concurrency} {strategy}")
    if proposer == "oracle" and concurrency > 1:
        assert engine.spec_totals.mean_acceptance_length > 2  # mixed acceptance really ran


def test_fallbacks_keep_producing_plain_decode_output(pair: Pair, workload) -> None:
    requests, references = workload
    engine = engine_for(pair, 8, fallback_min_acceptance=1.5, fallback_after_steps=2)
    chosen = requests["draft"][:6]
    logprob_request = EngineRequest(
        "logprobs", chosen[3].prompt, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2), 1
    )
    refs = {r.request_id: references[r.request_id] for r in chosen}
    # asking for logprobs must not change the tokens
    refs["logprobs"] = generate_plain(
        pair.target, list(logprob_request.prompt), replace(logprob_request.params, logprobs=None)
    ).output_ids
    streamed = run_engine(engine, [*chosen, logprob_request], refs)
    assert_batch_equivalent(streamed, refs, f"{pair.name} with fallbacks")
    stats = engine.stats()["fallbacks"]
    assert stats.get("logprobs") == 1
    # the random draft accepts ~nothing: every request that ran 2+ steps fell back
    long_enough = sum(1 for r in chosen if r.params.max_tokens > 3)
    assert stats.get("low_acceptance", 0) >= long_enough - 1 > 0
    assert engine.collect("logprobs").fallback_reason == "logprobs"


def test_abort_mid_flight_leaves_the_others_identical(pair: Pair, workload) -> None:
    requests, references = workload
    engine = engine_for(pair, 4)
    batch = [
        EngineRequest(r.request_id, r.prompt, r.params, i, r.schedule)
        for i, r in enumerate(requests["oracle"][:8])
    ]
    longest = sorted(batch, key=lambda r: -r.params.max_tokens)[:2]
    aborted = {r.request_id: r.arrival_step + 3 for r in longest}
    streamed = run_engine(engine, batch, references, abort=aborted)
    assert_batch_equivalent(streamed, {k: references[k] for k in streamed}, "abort", skip=list(aborted))
    for request_id in aborted:  # really cut mid-flight
        assert len(streamed[request_id]) < len(references[request_id])
    assert engine.scheduler.free_slots == [0, 1, 2, 3]
    with pytest.raises(RequestError, match="unknown request id"):
        engine.abort(longest[0].request_id)


def test_admission_waits_or_refuses_per_policy(pair: Pair, workload) -> None:
    requests, references = workload
    refuse = engine_for(pair, 2, admission="reject")
    refuse.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    refuse.add_request("b", [1, 2, 3], SamplingParams(max_tokens=4))
    refuse.step()
    with pytest.raises(EngineFullError, match="no free slot"):
        refuse.add_request("c", [1, 2, 3], SamplingParams(max_tokens=4))
    waiting = engine_for(pair, 2)
    streamed = run_engine(
        waiting,
        [EngineRequest(r.request_id, r.prompt, r.params, 0) for r in requests["draft"][:6]],
        references,
    )
    assert_batch_equivalent(streamed, {k: references[k] for k in streamed}, "queued admission")


# verify-width costs under which plain steps (width 0), narrow and full blocks all win at
# times (a wide verify costs up to 3.5 plain steps)
WIDTHS_PAY = StepCosts(
    {(rows, w): s for rows in (1, 2, 4, 8) for w, s in ((0, 1.0), (1, 1.3), (3, 1.9), (7, 3.5))},
    measured=True,
)


@pytest.mark.parametrize("costs", ["full_blocks", "widths"])
def test_statistics_are_exact_under_the_oracle(pair: Pair, workload, costs: str) -> None:
    """Each request's recorded steps accept the oracle's scheduled counts of what they
    verified, record the draft tokens they verified (`proposed`, those tokens in `drafted`),
    add up to its output, and the engine's totals add up over requests; with verify-width
    costs (plain steps recorded as none, narrow blocks counted as verified) too."""
    check_statistics(pair, workload, WIDTHS_PAY if costs == "widths" else None)


def check_statistics(pair: Pair, workload, step_costs: StepCosts | None) -> None:
    requests, references = workload
    engine = engine_for(pair, 8)
    if step_costs is not None:
        engine = Engine(pair.target, pair.draft, engine.config, step_costs=step_costs)
    run_engine(engine, requests["oracle"], references)
    totals = {"steps": 0, "accepted": 0, "proposed": 0}
    histogram: dict[int, int] = {}
    plain_tokens = 0
    for r in requests["oracle"]:
        seq = engine.collect(r.request_id)
        lengths = [s.acceptance_length for s in seq.steps]
        # each step accepts the scheduled count, cut only by the budget of the last step
        for i, step in enumerate(seq.steps):
            scheduled = min(r.schedule[i % len(r.schedule)], step.proposed)
            assert step.accepted == scheduled, (r.request_id, i, step)
            assert step.proposed == len(step.drafted) <= BLOCK_SIZE - 1, (r.request_id, i, step)
        plain_tokens += len(seq.output_ids) - 1 - sum(lengths)  # plain steps' tokens
        assert sum(lengths) + 1 <= len(seq.output_ids)
        totals["steps"] += len(seq.steps)
        totals["accepted"] += sum(s.accepted for s in seq.steps)
        totals["proposed"] += sum(s.proposed for s in seq.steps)
        for n in lengths:
            histogram[n] = histogram.get(n, 0) + 1
    stats = engine.stats()
    spec, widths = stats["spec"], stats["verify_widths"]
    assert {k: spec[k] for k in totals} == totals
    assert spec["acceptance_length_histogram"] == dict(sorted(histogram.items()))
    if step_costs is None:
        assert plain_tokens == 0 and set(widths) == {BLOCK_SIZE - 1}, (plain_tokens, widths)
    else:  # not vacuous: plain steps, narrow and full blocks ran
        assert plain_tokens > 0 and {0, 1, 3, 7} <= set(widths), (plain_tokens, widths)


CATCHES = ("commit_wrong_slot", "shared_positions", "proposed_counts_the_drafted_block")


def test_statistics_gate_catches_narrow_steps_counted_as_whole_blocks(pair: Pair, workload) -> None:
    with planted("proposed_counts_the_drafted_block"), pytest.raises(AssertionError) as caught:
        check_statistics(pair, workload, WIDTHS_PAY)
    assert "StepRecord" in str(caught.value)  # a step's record, not another check, failed


@pytest.mark.parametrize("fault", ["commit_wrong_slot", "shared_positions"])
def test_batch_gate_catches_planted_faults(pair: Pair, workload, fault: str) -> None:
    if fault == "commit_wrong_slot" and not pair.target.config.is_hybrid:
        pytest.skip("a misplaced commit corrupts Gated DeltaNet state, which dense targets lack")
    requests, references = workload
    engine = engine_for(pair, 8, "per_token")
    with planted(fault), pytest.raises(AssertionError, match="differs from plain greedy alone"):
        streamed = run_engine(engine, requests["oracle"], references)
        assert_batch_equivalent(streamed, references, fault)
