"""Gates for classes of engine-core bugs that a comparison of speculative output with plain
greedy decode cannot see, because plain decode shares the code at fault, because greedy output
does not depend on it, or because only one path or batch pattern shows it:

- The stop set is the definition's on every path (the plain reference loop, the plain engine,
  the DFlash engine): the model's EOS ends an output unless the request ignores EOS, a stop
  token id ends it whatever ignore_eos says, and the earliest of them wins. The reference is
  a run with no stop set at all, cut by the rule written out.
- What a request streams is its output, once: its tokens in order, one finished output and
  nothing after it, whatever ends it (a stop as its first token, a stop later, max_tokens)
  and whichever path decodes it (a plain engine, a DFlash engine, plain decode inside a
  DFlash engine after a fall back), beside requests that run on.
- A seeded sampled request draws the same tokens alone and beside other requests, sampled and
  greedy, in a DFlash engine: each row draws from its own generator only.
- The low-acceptance fall back follows its rule exactly: a request falls back after exactly
  `fallback_after_steps` speculative steps when their mean acceptance length is below the
  threshold, and never when it is at or above it (forced by the oracle proposer).
- A forced oracle (benchmarks on random weights) has each step accept its scheduled count.
"""

from __future__ import annotations

import dataclasses

import pytest

from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.request import SamplingParams

from .checks import Pair, require_block
from .faults import planted

BLOCK = 8
CATCHES = (
    "eos_ends_an_output_that_ignores_eos",
    "finished_rows_keep_decoding",
    "sampled_rows_draw_from_the_first_rows_generator",
    "low_acceptance_judged_a_step_early",
    "forced_schedule_ignored",
)


def run_requests(
    pair: Pair, speculative: bool, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, tuple[list[int], str]]:
    """`requests` in one engine (plain or DFlash), a slot each: each one's output and
    finish reason."""
    config = EngineConfig(
        max_num_seqs=len(requests),
        block_size=BLOCK if speculative else None,
        numerics=pair.numerics,
    )
    engine = Engine(pair.target, pair.draft if speculative else None, config)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        engine.step()
    out = {}
    for rid in requests:
        seq = engine.collect(rid)
        out[rid] = (seq.output_ids, seq.finish_reason)
    return out


# ------------------------------------------------------------------ the stop set
LENGTH = 20


def stop_cases(pair: Pair) -> tuple[list[int], dict[str, tuple[SamplingParams, tuple[list[int], str]]], int]:
    """A prompt, the cases (params -> the output and finish reason the rule gives) and the
    EOS id they run under: the EOS and a stop token id are two tokens of the free output, each
    at its first occurrence, the stop token after the EOS."""
    original = pair.target.config
    pair.target.config = dataclasses.replace(original, eos_token_ids=())
    try:
        prompt = list(pair.prompts[1])
        free = generate_plain(
            pair.target, prompt, SamplingParams(max_tokens=LENGTH, ignore_eos=True), numerics=pair.numerics
        ).output_ids
    finally:
        pair.target.config = original
    new = [i for i in range(2, LENGTH - 2) if free[i] not in free[:i]]
    assert len(new) >= 2, f"{pair.name}: the free output repeats itself: {free}"
    eos_at, stop_at = new[0], new[-1]
    eos, stop = free[eos_at], free[stop_at]
    cases = {
        "ignores eos": (SamplingParams(max_tokens=LENGTH, ignore_eos=True), (free, "length")),
        "stops at eos": (SamplingParams(max_tokens=LENGTH), (free[: eos_at + 1], "stop")),
        "ignores eos, stop id": (
            SamplingParams(max_tokens=LENGTH, ignore_eos=True, stop_token_ids=(stop,)),
            (free[: stop_at + 1], "stop"),
        ),
        "eos before the stop id": (
            SamplingParams(max_tokens=LENGTH, stop_token_ids=(stop,)),
            (free[: eos_at + 1], "stop"),
        ),
    }
    return prompt, cases, eos


def check_stop_set(pair: Pair) -> None:
    prompt, cases, eos = stop_cases(pair)
    original = pair.target.config
    pair.target.config = dataclasses.replace(original, eos_token_ids=(eos,))
    try:
        got = {
            "plain decode": {
                name: (r.output_ids, r.finish_reason)
                for name, (params, _) in cases.items()
                for r in [generate_plain(pair.target, prompt, params, numerics=pair.numerics)]
            },
        }
        requests = {name: (prompt, params) for name, (params, _) in cases.items()}
        got["plain engine"] = run_requests(pair, False, requests)
        got["DFlash engine"] = run_requests(pair, True, requests)
    finally:
        pair.target.config = original
    for path, outputs in got.items():
        for name, (_, want) in cases.items():
            assert outputs[name] == want, (
                f"{pair.name}, {path}, {name} (EOS {eos}): got {outputs[name]}, the stop rule gives {want}"
            )


def test_the_stop_set_is_eos_unless_ignored_and_the_stop_ids_on_every_path(pair: Pair) -> None:
    require_block(pair, BLOCK)
    check_stop_set(pair)


def test_the_stop_set_gate_catches_an_eos_that_ends_an_output_ignoring_it(pair: Pair) -> None:
    require_block(pair, BLOCK)
    with (
        planted("eos_ends_an_output_that_ignores_eos"),
        pytest.raises(AssertionError, match="stop rule gives"),
    ):
        check_stop_set(pair)


# ------------------------------------------------------------------ what a request streams
STREAM_MAX = 12


def stream_requests(
    pair: Pair,
) -> tuple[dict[str, tuple[list[int], SamplingParams]], dict[str, tuple[list[int], str]]]:
    """Requests that end in every way, and the output and finish reason plain decode gives each
    alone: a stop as the first token, a stop later on, max_tokens, a single token."""
    prompt, other = list(pair.prompts[0]), list(pair.prompts[1])
    free = generate_plain(
        pair.target, prompt, SamplingParams(max_tokens=STREAM_MAX, ignore_eos=True), numerics=pair.numerics
    ).output_ids
    later = next(i for i in range(3, STREAM_MAX) if free[i] not in free[:i])
    requests = {
        "first token stops": (
            prompt,
            SamplingParams(max_tokens=STREAM_MAX, ignore_eos=True, stop_token_ids=(free[0],)),
        ),
        "later stop": (
            prompt,
            SamplingParams(max_tokens=STREAM_MAX, ignore_eos=True, stop_token_ids=(free[later],)),
        ),
        "runs to max_tokens": (other, SamplingParams(max_tokens=STREAM_MAX, ignore_eos=True)),
        "one token": (other, SamplingParams(max_tokens=1, ignore_eos=True)),
    }
    want = {}
    for rid, (ids, params) in requests.items():
        ref = generate_plain(pair.target, ids, params, numerics=pair.numerics)
        want[rid] = (ref.output_ids, ref.finish_reason)
    return requests, want


def check_streams(pair: Pair) -> None:
    requests, want = stream_requests(pair)
    paths = {
        "plain engine": (False, {}),
        "DFlash engine": (True, {}),
        "DFlash engine, fallen back": (True, {"logprobs": 0}),
    }
    for path, (speculative, extra) in paths.items():
        config = EngineConfig(
            max_num_seqs=len(requests), block_size=BLOCK if speculative else None, numerics=pair.numerics
        )
        engine = Engine(pair.target, pair.draft if speculative else None, config)
        for rid, (ids, params) in requests.items():
            engine.add_request(rid, ids, dataclasses.replace(params, **extra))
        streamed: dict[str, list] = {rid: [] for rid in requests}
        while engine.has_unfinished():
            for out in engine.step():
                streamed[out.request_id].append(out)
        for rid, outs in streamed.items():
            seq = engine.collect(rid)
            assert seq.speculative == (speculative and not extra), f"{path}, {rid}: not on its path"
            tokens = [t for out in outs for t in out.new_token_ids]
            ends = [i for i, out in enumerate(outs) if out.finished]
            assert ends == [len(outs) - 1], (
                f"{pair.name}, {path}, {rid}: finished outputs at {ends} of {len(outs)} streamed "
                f"(tokens {[out.new_token_ids for out in outs]})"
            )
            got = (tokens, outs[-1].finish_reason)
            assert got == want[rid] == (seq.output_ids, seq.finish_reason), (
                f"{pair.name}, {path}, {rid}: streamed {got}, the request holds "
                f"{(seq.output_ids, seq.finish_reason)}, plain decode alone gives {want[rid]}"
            )


def test_each_request_streams_its_output_once_however_it_ends_on_every_path(pair: Pair) -> None:
    require_block(pair, BLOCK)
    check_streams(pair)


def test_the_stream_gate_catches_finished_rows_that_keep_decoding(pair: Pair) -> None:
    require_block(pair, BLOCK)
    with planted("finished_rows_keep_decoding"), pytest.raises(AssertionError, match="streamed"):
        check_streams(pair)


# ------------------------------------------------------------------ seeded sampling, alone and batched
SAMPLED_MAX = 14


def sampled_outputs(
    pair: Pair, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, list[int]]:
    return {rid: out for rid, (out, _) in run_requests(pair, True, requests).items()}


def check_seeded_sampling(pair: Pair) -> None:
    requests = {
        f"sampled {i}": (
            list(pair.prompts[i % len(pair.prompts)]),
            SamplingParams(max_tokens=SAMPLED_MAX, ignore_eos=True, temperature=0.8, seed=10 + i),
        )
        for i in range(3)
    }
    requests["greedy"] = (list(pair.prompts[0]), SamplingParams(max_tokens=SAMPLED_MAX, ignore_eos=True))
    alone = {rid: sampled_outputs(pair, {rid: request})[rid] for rid, request in requests.items()}
    batched = sampled_outputs(pair, requests)
    for rid, want in alone.items():
        assert batched[rid] == want, (
            f"{pair.name}: {rid} draws other tokens beside other requests than alone: {batched[rid]} "
            f"against {want}"
        )


def test_a_seeded_sampled_request_draws_the_same_tokens_alone_and_batched(pair: Pair) -> None:
    require_block(pair, BLOCK)
    check_seeded_sampling(pair)


def test_the_seeded_sampling_gate_catches_rows_that_draw_from_a_neighbours_generator(pair: Pair) -> None:
    require_block(pair, BLOCK)
    with (
        planted("sampled_rows_draw_from_the_first_rows_generator"),
        pytest.raises(AssertionError, match="beside other requests"),
    ):
        check_seeded_sampling(pair)


# ------------------------------------------------------------------ the low-acceptance fall back
AFTER_STEPS = 3
THRESHOLD = 2.0
# accepted draft tokens per step -> acceptance lengths; the first AFTER_STEPS steps' mean
# decides: below THRESHOLD falls back after exactly AFTER_STEPS steps, at or above never,
# nor when the deciding step ends the request (nothing is left to decode plainly); max_tokens
# ends each request at the end of a whole step: a last step cut by max_tokens commits fewer
# tokens than it accepted
FALLBACK_SCHEDULES = {
    "below": ((1, 0, 0), 20, True),  # lengths 2, 1, 1: mean 4/3; after two steps 1.5
    "below, ending on the deciding step": ((1, 0, 0), 5, False),  # the first token and 2 + 1 + 1
    "at": ((1, 1, 1), 21, False),  # lengths 2, 2, 2: mean 2.0
    "above after a slow start": ((0, 0, 5), 25, False),  # lengths 1, 1, 6: mean 8/3; after two steps 1.0
}


def check_low_acceptance_fallback(pair: Pair) -> None:
    config = EngineConfig(
        max_num_seqs=len(FALLBACK_SCHEDULES),
        block_size=BLOCK,
        numerics=pair.numerics,
        fallback_min_acceptance=THRESHOLD,
        fallback_after_steps=AFTER_STEPS,
    )
    engine = Engine(pair.target, pair.draft, config)
    want = {}
    for i, (rid, (schedule, max_tokens, _)) in enumerate(FALLBACK_SCHEDULES.items()):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        prompt = list(pair.prompts[i % len(pair.prompts)])
        want[rid] = generate_plain(pair.target, prompt, params, numerics=pair.numerics).output_ids
        oracle = OracleProposer(want[rid], list(schedule), pair.target.config.vocab_size)
        engine.add_request(rid, prompt, params, oracle=oracle)
    while engine.has_unfinished():
        engine.step()
    for rid, (schedule, max_tokens, falls_back) in FALLBACK_SCHEDULES.items():
        seq = engine.collect(rid)
        assert seq.output_ids == want[rid], f"{pair.name}: {rid}: output != plain greedy"
        steps = len(seq.steps)
        if falls_back:
            assert (seq.fallback_reason, steps) == ("low_acceptance", AFTER_STEPS), (
                f"{pair.name}: {rid} (schedule {schedule}): fall back {seq.fallback_reason!r} after {steps} "
                f"speculative steps, the rule falls back after exactly {AFTER_STEPS}"
            )
        else:
            assert (
                seq.fallback_reason is None and sum(s.acceptance_length for s in seq.steps) + 1 == max_tokens
            ), (
                f"{pair.name}: {rid} (schedule {schedule}): fall back {seq.fallback_reason!r} after {steps} "
                f"speculative steps, where the rule keeps it speculative"
            )
        assert (seq.spec.steps, seq.spec.accepted) == (steps, sum(s.accepted for s in seq.steps)), (
            f"{pair.name}: {rid}: the request's counters {seq.spec} are not the sums of its {steps} steps"
        )


def test_the_low_acceptance_fallback_follows_its_rule_exactly(pair: Pair) -> None:
    require_block(pair, BLOCK)
    check_low_acceptance_fallback(pair)


def test_the_fallback_gate_catches_a_rule_judged_a_step_early(pair: Pair) -> None:
    require_block(pair, BLOCK)
    with planted("low_acceptance_judged_a_step_early"), pytest.raises(AssertionError, match="the rule"):
        check_low_acceptance_fallback(pair)


# ------------------------------------------------------------------ forced acceptance (benchmarks)
FORCED = (3, 0, 6, 1, 7, 2)


def check_forced_acceptance(pair: Pair) -> None:
    """Forced oracles (benchmarks on random weights) over a continuation the target never
    gives: each step accepts its scheduled count, committed whole, in a batch of two."""
    max_tokens = 1 + sum(k + 1 for k in FORCED)
    config = EngineConfig(max_num_seqs=2, block_size=BLOCK, numerics=pair.numerics)
    engine = Engine(pair.target, pair.draft, config)
    vocab = pair.target.config.vocab_size
    for i in range(2):
        oracle = OracleProposer([i] * max_tokens, list(FORCED), vocab, forced=True)
        engine.add_request(
            str(i),
            list(pair.prompts[i]),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            oracle=oracle,
        )
    while engine.has_unfinished():
        engine.step()
    for i in range(2):
        seq = engine.collect(str(i))
        got = [(s.accepted, s.acceptance_length) for s in seq.steps]
        want = [(k, k + 1) for k in FORCED]
        assert got == want, (
            f"{pair.name}: request {i}: forced steps (accepted, length) {got}, scheduled {want}"
        )
        assert len(seq.output_ids) == max_tokens
    assert engine.stats()["spec"]["accepted"] == 2 * sum(FORCED)


def test_forced_acceptance_takes_the_scheduled_counts(pair: Pair) -> None:
    require_block(pair, BLOCK)
    check_forced_acceptance(pair)


def test_the_forced_acceptance_gate_catches_a_schedule_compared_not_taken(pair: Pair) -> None:
    require_block(pair, BLOCK)
    with planted("forced_schedule_ignored"), pytest.raises(AssertionError, match="scheduled"):
        check_forced_acceptance(pair)
