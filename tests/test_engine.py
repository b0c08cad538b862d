"""The continuous-batching engine (engine.py): request lifecycle and slots, streamed step
outputs, chunked prefill, refusal of bad input without harm to other requests, config
validation, admission, statistics, seeded sampling, logprobs and fallbacks.

Outputs are compared with plain greedy decode of each request alone (`generate_plain`)
on a tiny float64 Qwen3 target with a tiny random block-8 draft."""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.errors import ConfigError, RequestError
from reference_engine.models import CausalLM
from reference_engine.models.dflash import DFlashDraft, DraftState
from reference_engine.runtime.decode import decode_step, generate_plain, new_state, prefill
from reference_engine.runtime.engine import Engine, EngineConfig, EngineFullError, StepOutput
from reference_engine.runtime.forwards import StepInputs
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.sequence import Phase, Sequence
from reference_engine.runtime.speculative_step import DraftAhead, SpeculativeStep
from reference_engine.runtime.state import NO_CHECKPOINTS
from reference_engine.runtime.stats import RecentAcceptance, SpecCounters
from reference_engine.runtime.verify_width import StepCosts

TinyCheckpoint = Callable[..., Path]
TinyPair = Callable[..., tuple[Path, Path]]
BLOCK_SIZE = 8
VOCAB = 512
PROMPTS = [
    [17, 301, 5, 88, 260, 42, 7, 199, 33, 410, 2, 95, 61],
    [400, 3, 77, 120, 9],
    [250, 251, 13, 480, 66, 1, 305, 222, 18, 90, 400, 21, 7, 7, 350, 11, 64, 128, 256, 31],
    [8],
]
LONG_PROMPT = [(37 * i + 11) % 500 for i in range(37)]


@pytest.fixture(scope="module")
def target(tiny_checkpoint: TinyCheckpoint) -> CausalLM:
    return load_target(tiny_checkpoint("qwen3"), dtype=torch.float64)


@pytest.fixture(scope="module")
def draft(tiny_pair: TinyPair, target: CausalLM) -> DFlashDraft:
    _, draft_dir = tiny_pair("qwen3", block_size=BLOCK_SIZE)
    return load_draft(draft_dir, target)


@pytest.fixture(scope="module")
def hybrid(tiny_pair: TinyPair) -> tuple[CausalLM, DFlashDraft]:
    """A Qwen3.5 (Gated DeltaNet + attention) target and its draft."""
    target_dir, draft_dir = tiny_pair("qwen3_5", block_size=BLOCK_SIZE)
    target = load_target(target_dir, dtype=torch.float64)
    return target, load_draft(draft_dir, target)


def greedy(max_tokens: int, **options) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **options)


def reference(target: CausalLM, prompt: list[int], params: SamplingParams) -> list[int]:
    return generate_plain(target, prompt, params).output_ids


def drain(engine: Engine, limit: int = 500) -> list[StepOutput]:
    """Step until every request is done; all step outputs in order."""
    outputs = []
    for _ in range(limit):
        if not engine.has_unfinished():
            return outputs
        outputs += engine.step()
    raise AssertionError(f"engine still busy after {limit} steps")


def by_request(outputs: list[StepOutput]) -> dict[str, list[StepOutput]]:
    grouped: dict[str, list[StepOutput]] = {}
    for out in outputs:
        grouped.setdefault(out.request_id, []).append(out)
    return grouped


def make_engine(target: CausalLM, draft: DFlashDraft | None, **config) -> Engine:
    if draft is not None:
        config.setdefault("block_size", BLOCK_SIZE)
    return Engine(target, draft, EngineConfig(**config))


# ----------------------------------------------------------------------------- lifecycle
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_requests_added_at_different_steps_finish_and_give_back_their_slots(
    target: CausalLM, draft: DFlashDraft, speculative: bool
) -> None:
    engine = make_engine(target, draft if speculative else None, max_num_seqs=2)
    requests = {
        "a": (PROMPTS[0], greedy(10)),
        "b": (PROMPTS[1], greedy(6)),
        "c": (PROMPTS[2], greedy(12)),
        "d": (PROMPTS[3], greedy(3)),
    }
    arrivals = {0: ["a"], 1: ["b"], 3: ["c", "d"]}
    assert not engine.has_unfinished()
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for rid in arrivals.get(step, []):
            engine.add_request(rid, *requests[rid])
        if step == 3:  # both slots busy: the newcomers queue
            assert engine.get("c").phase is Phase.WAITING
            assert engine.stats()["waiting"] == 2
        assert engine.has_unfinished()
        engine.step()
        stats = engine.stats()
        assert len(engine.scheduler.free_slots) + stats["running"] == 2
        step += 1
        assert step < 100
    assert engine.scheduler.free_slots == [0, 1]
    stats = engine.stats()
    assert (stats["requests_finished"], stats["running"], stats["waiting"]) == (4, 0, 0)
    for rid, (prompt, params) in requests.items():
        seq = engine.collect(rid)
        assert isinstance(seq, Sequence)
        assert seq.phase is Phase.FINISHED and seq.finish_reason == "length"
        assert seq.output_ids == reference(target, prompt, params), rid
        with pytest.raises(RequestError, match=f"request '{rid}' is not finished"):
            engine.collect(rid)
        with pytest.raises(RequestError, match=f"unknown request id '{rid}'"):
            engine.get(rid)
    # a collected id is free again
    engine.add_request("a", PROMPTS[3], greedy(2))
    drain(engine)
    assert engine.collect("a").output_ids == reference(target, PROMPTS[3], greedy(2))


def test_abort_frees_the_slot_and_leaves_the_other_requests_alone(
    target: CausalLM, draft: DFlashDraft
) -> None:
    engine = make_engine(target, draft, max_num_seqs=2)
    engine.add_request("keep", PROMPTS[0], greedy(14))
    engine.add_request("drop", PROMPTS[1], greedy(14))
    engine.add_request("queued", PROMPTS[2], greedy(5))
    engine.step()
    engine.step()
    engine.abort("drop")
    assert engine.get("queued").phase is Phase.WAITING
    assert len(engine.scheduler.free_slots) == 1
    with pytest.raises(RequestError, match="unknown request id 'drop'"):
        engine.abort("drop")
    streamed = by_request(drain(engine))
    assert "drop" not in streamed
    for rid, prompt, n in (("keep", PROMPTS[0], 14), ("queued", PROMPTS[2], 5)):
        assert engine.collect(rid).output_ids == reference(target, prompt, greedy(n))
    assert engine.scheduler.free_slots == [0, 1]


# ----------------------------------------------------------------------------- streaming
def test_step_outputs_stream_each_requests_tokens_in_order(target: CausalLM, draft: DFlashDraft) -> None:
    """Full-block oracle acceptance: steps commit B tokens at once; the stream of each
    request concatenates to its output, times never go back, and only the last is final."""
    full = reference(target, PROMPTS[0], greedy(21))
    engine = make_engine(target, draft, max_num_seqs=3)
    engine.add_request("oracle", PROMPTS[0], greedy(21), oracle=OracleProposer(full, [BLOCK_SIZE - 1], VOCAB))
    engine.add_request("draft", PROMPTS[1], greedy(9))
    streamed = by_request(drain(engine))
    for rid, expected in (("oracle", full), ("draft", reference(target, PROMPTS[1], greedy(9)))):
        outs = streamed[rid]
        tokens = [t for out in outs for t in out.new_token_ids]
        assert tokens == engine.collect(rid).output_ids == expected
        times = [out.time_s for out in outs]
        assert times == sorted(times)
        assert [out.finished for out in outs] == [False] * (len(outs) - 1) + [True]
        assert [out.finish_reason for out in outs] == [None] * (len(outs) - 1) + ["length"]
    sizes = [len(out.new_token_ids) for out in streamed["oracle"]]
    assert sizes == [1, BLOCK_SIZE, BLOCK_SIZE, 4]  # prefill token, two full blocks, the cut rest


def test_a_stop_token_inside_an_accepted_block_ends_the_stream_there(
    target: CausalLM, draft: DFlashDraft
) -> None:
    full = reference(target, PROMPTS[0], greedy(24))
    stop = full[10]
    end = full.index(stop)
    assert end > 1
    engine = make_engine(target, draft, max_num_seqs=1)
    engine.add_request(
        "r",
        PROMPTS[0],
        greedy(24, stop_token_ids=(stop,)),
        oracle=OracleProposer(full, [BLOCK_SIZE - 1], VOCAB),
    )
    outs = drain(engine)
    last = outs[-1]
    assert last.finished and last.finish_reason == "stop"
    assert last.new_token_ids[-1] == stop
    assert [t for out in outs for t in out.new_token_ids] == full[: end + 1]
    assert engine.collect("r").finish_reason == "stop"


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_a_stop_token_that_is_also_the_last_allowed_token_finishes_with_stop(
    target: CausalLM, draft: DFlashDraft, speculative: bool
) -> None:
    """A request whose max_tokens-th token is one of its stop ids ends on both at once; the
    stop wins, as in generate_plain: finish_reason "stop" on the stream and the request, the
    stop token the output's last."""
    full = reference(target, PROMPTS[0], greedy(24))
    end = next(k for k in range(3, len(full)) if full[k] not in full[:k])  # its first occurrence
    engine = make_engine(target, draft if speculative else None, max_num_seqs=1)
    engine.add_request("r", PROMPTS[0], greedy(end + 1, stop_token_ids=(full[end],)))
    outs = drain(engine)
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    seq = engine.collect("r")
    assert seq.output_ids == full[: end + 1] and seq.finish_reason == "stop"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_chunked_prefill_gives_the_plain_decode_output(
    request: pytest.FixtureRequest, speculative: bool, arch: str
) -> None:
    if arch == "qwen3":
        target, draft = request.getfixturevalue("target"), request.getfixturevalue("draft")
    else:
        target, draft = request.getfixturevalue("hybrid")
    chunk = 8
    engine = make_engine(target, draft if speculative else None, max_num_seqs=2, prefill_chunk=chunk)
    engine.add_request("long", LONG_PROMPT, greedy(12))
    engine.add_request("short", PROMPTS[2], greedy(12))
    first_step, started = {}, {}
    step = 0
    while engine.has_unfinished():
        started[step] = time.monotonic()
        for out in engine.step():
            first_step.setdefault(out.request_id, step)
        step += 1
    # one chunk per step: the first token comes with the last chunk
    assert first_step == {
        "long": math.ceil(len(LONG_PROMPT) / chunk) - 1,
        "short": math.ceil(len(PROMPTS[2]) / chunk) - 1,
    }
    long, short = engine.collect("long"), engine.collect("short")
    assert long.output_ids == reference(target, LONG_PROMPT, greedy(12))
    assert short.output_ids == reference(target, PROMPTS[2], greedy(12))
    # the time to first token ends in the step that gave the token, not at the first chunk
    assert long.first_token_s >= started[first_step["long"]] > started[0]


def test_a_prompt_is_run_to_its_last_token_whatever_its_last_chunk_holds(target: CausalLM) -> None:
    """Prompts of 1 to 2 * chunk + 1 tokens in chunks of 4: a prompt counts as run only once
    its last token has run (a last chunk of a single token included), so each first token
    comes from the whole prompt and every output is plain greedy decode's."""
    chunk = 4
    prompts = {str(n): LONG_PROMPT[:n] for n in range(1, 2 * chunk + 2)}
    engine = make_engine(target, None, max_num_seqs=len(prompts), prefill_chunk=chunk)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy(3))
    drain(engine)
    for rid, prompt in prompts.items():
        assert engine.collect(rid).output_ids == reference(target, prompt, greedy(3)), rid


# ----------------------------------------------------------------------------- bad input
BAD_REQUESTS = [
    (
        lambda e: e.add_request("x", [1, 2], SamplingParams(temperature=-1)),
        r"temperature must be >= 0, got -1",
    ),
    (lambda e: e.add_request("x", [1, 2], SamplingParams(top_p=0)), r"top_p must be in \(0, 1\], got 0"),
    (
        lambda e: e.add_request("x", [1, 2], SamplingParams(top_k=-1)),
        r"top_k must be >= 0 \(0 disables it\), got -1",
    ),
    (
        lambda e: e.add_request("x", [1, 2], SamplingParams(max_tokens=0)),
        r"max_tokens must be positive, got 0",
    ),
    (lambda e: e.add_request("x", [1, 2], {"max_tokens": 4}), r"params must be SamplingParams, got dict"),
    (
        lambda e: e.add_request("x", list(range(50)), greedy(20)),
        r"prompt \(50 tokens\) \+ max_tokens \(20\) = 70 exceeds the context of 64 tokens",
    ),
    (
        lambda e: e.add_request("x", list(range(64)), greedy(1)),
        r"the prompt has 64 tokens but the context holds 64",
    ),
    (lambda e: e.add_request("x", [], greedy(4)), r"the prompt is empty"),
    (
        lambda e: e.add_request("x", [1, 512, 3, 9999], greedy(4)),
        r"prompt token id\(s\) \[512, 9999\] outside the vocabulary \[0, 512\)",
    ),
    (lambda e: e.add_request("x", [4, -1], greedy(4)), r"prompt token id\(s\) \[-1\] outside the vocabulary"),
    (lambda e: e.add_request("good1", [1, 2], greedy(4)), r"duplicate request id 'good1'"),
    (lambda e: e.abort("nope"), r"unknown request id 'nope'"),
    (lambda e: e.collect("good1"), r"request 'good1' is not finished"),
    (lambda e: e.get("nope"), r"unknown request id 'nope'"),
]
BAD_IDS = [
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "params-type",
    "past-context",
    "prompt-fills-context",
    "empty-prompt",
    "out-of-vocab",
    "negative-id",
    "duplicate-id",
    "abort-unknown",
    "collect-unfinished",
    "get-unknown",
]


@pytest.mark.parametrize(("bad", "pattern"), BAD_REQUESTS, ids=BAD_IDS)
def test_a_bad_request_is_refused_by_name_and_the_others_are_unaffected(
    target: CausalLM, draft: DFlashDraft, bad: Callable[[Engine], object], pattern: str
) -> None:
    engine = make_engine(target, draft, max_num_seqs=2, max_model_len=64)
    good = {
        "good1": (PROMPTS[0], greedy(10)),
        "good2": (PROMPTS[1], greedy(8)),
        "good3": (PROMPTS[3], greedy(6)),
    }
    for rid, (prompt, params) in good.items():
        engine.add_request(rid, prompt, params)
    engine.step()
    before = (
        sorted(engine.scheduler.known),
        len(engine.scheduler.waiting),
        list(engine.scheduler.free_slots),
    )
    with pytest.raises(RequestError, match=pattern):
        bad(engine)
    assert (
        sorted(engine.scheduler.known),
        len(engine.scheduler.waiting),
        list(engine.scheduler.free_slots),
    ) == before
    drain(engine)
    for rid, (prompt, params) in good.items():
        assert engine.collect(rid).output_ids == reference(target, prompt, params), rid


def test_a_finished_but_uncollected_id_is_still_taken(target: CausalLM, draft: DFlashDraft) -> None:
    engine = make_engine(target, draft, max_num_seqs=2)
    engine.add_request("short", PROMPTS[1], greedy(1))
    engine.add_request("other", PROMPTS[0], greedy(6))
    engine.step()
    assert engine.get("short").phase is Phase.FINISHED
    with pytest.raises(RequestError, match="duplicate request id 'short'"):
        engine.add_request("short", PROMPTS[2], greedy(3))
    assert engine.collect("short").output_ids == reference(target, PROMPTS[1], greedy(1))
    engine.add_request("short", PROMPTS[2], greedy(3))  # collected: the id is free
    drain(engine)
    assert engine.collect("short").output_ids == reference(target, PROMPTS[2], greedy(3))
    assert engine.collect("other").output_ids == reference(target, PROMPTS[0], greedy(6))


def test_an_oracle_with_a_sampling_request_is_refused_at_add_request(
    target: CausalLM, draft: DFlashDraft
) -> None:
    """The oracle proposer is greedy-only (generate_speculative refuses the pair); the
    engine must refuse it up front rather than fail inside a step shared with others."""
    engine = make_engine(target, draft, max_num_seqs=2)
    engine.add_request("good", PROMPTS[0], greedy(8))
    oracle = OracleProposer(reference(target, PROMPTS[1], greedy(8)), [3], VOCAB)
    with pytest.raises((RequestError, ConfigError), match="greedy"):
        engine.add_request(
            "sampled", PROMPTS[1], SamplingParams(max_tokens=8, temperature=0.8, seed=0), oracle=oracle
        )
    drain(engine)
    assert engine.collect("good").output_ids == reference(target, PROMPTS[0], greedy(8))


# ----------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"max_num_seqs": 0}, r"max_num_seqs must be positive, got 0"),
        ({"prefill_chunk": 0}, r"prefill_chunk must be positive, got 0"),
        ({"admission": "bogus"}, r"admission must be one of wait, reject, got 'bogus'"),
        ({"block_size": 1}, r"block size must be >= 2, got 1"),
        (
            {"commit_strategy": "eager"},
            r"unknown commit strategy 'eager', expected one of replay, per_token, recompute",
        ),
        ({"fallback_after_steps": 0}, r"fallback_after_steps must be positive, got 0"),
        (
            {"max_num_batched_tokens": 256},
            r"max_num_batched_tokens must be at least prefill_chunk \(2048\), got 256",
        ),
        ({"checkpoint_every": 0}, r"checkpoint_every must be >= 1, got 0"),
    ],
    ids=[
        "max_num_seqs",
        "prefill_chunk",
        "admission",
        "block_size",
        "commit_strategy",
        "fallback_after_steps",
        "max_num_batched_tokens",
        "checkpoint_every",
    ],
)
def test_engine_config_out_of_range_is_rejected_with_the_value(options: dict, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        EngineConfig(**options)


@pytest.mark.parametrize(
    ("options", "pattern"),
    [({"max_waiting": -1}, r"max_waiting .*-1"), ({"max_model_len": 0}, r"max_model_len .*0")],
    ids=["negative-max_waiting", "zero-max_model_len"],
)
def test_engine_config_rejects_a_negative_queue_bound_and_an_empty_context(
    options: dict, pattern: str
) -> None:
    with pytest.raises(ConfigError, match=pattern):
        EngineConfig(**options)


def test_a_block_size_larger_than_the_draft_supports_is_rejected_at_construction(
    target: CausalLM, draft: DFlashDraft
) -> None:
    with pytest.raises(ConfigError, match=r"block size 16 is larger than the draft supports \(8\)"):
        Engine(target, draft, EngineConfig(block_size=16))
    assert Engine(target, draft, EngineConfig(block_size=4)).block_size == 4
    assert Engine(target, draft, EngineConfig()).block_size == BLOCK_SIZE


# ----------------------------------------------------------------------------- admission
def test_reject_admission_refuses_a_request_when_every_slot_is_busy(
    target: CausalLM, draft: DFlashDraft
) -> None:
    engine = make_engine(target, draft, max_num_seqs=2, admission="reject")
    engine.add_request("a", PROMPTS[0], greedy(6))
    engine.add_request("b", PROMPTS[1], greedy(9))
    engine.step()
    with pytest.raises(EngineFullError, match=r"no free slot for request 'c': all 2 are busy"):
        engine.add_request("c", PROMPTS[2], greedy(4))
    drain(engine)
    assert engine.collect("a").output_ids == reference(target, PROMPTS[0], greedy(6))
    assert engine.collect("b").output_ids == reference(target, PROMPTS[1], greedy(9))
    engine.add_request("c", PROMPTS[2], greedy(4))  # slots free again
    drain(engine)
    assert engine.collect("c").output_ids == reference(target, PROMPTS[2], greedy(4))


def test_reject_admission_counts_requests_already_queued_for_a_slot(target: CausalLM) -> None:
    """Requests added since the last step hold the free slots they will be admitted to:
    with admission 'reject' a request beyond max_num_seqs must not end up waiting."""
    engine = make_engine(target, None, max_num_seqs=2, admission="reject")
    engine.add_request("a", PROMPTS[0], greedy(4))
    engine.add_request("b", PROMPTS[1], greedy(4))
    with pytest.raises(EngineFullError, match="no free slot for request 'c'"):
        engine.add_request("c", PROMPTS[2], greedy(4))


def test_the_waiting_queue_is_bounded_by_max_waiting(target: CausalLM, draft: DFlashDraft) -> None:
    engine = make_engine(target, draft, max_num_seqs=1, max_waiting=2)
    engine.add_request("a", PROMPTS[0], greedy(5))
    engine.step()  # a holds the only slot
    engine.add_request("b", PROMPTS[1], greedy(5))
    engine.add_request("c", PROMPTS[2], greedy(5))
    with pytest.raises(EngineFullError, match=r"waiting queue full \(2 requests\)"):
        engine.add_request("d", PROMPTS[3], greedy(5))
    assert engine.stats()["waiting"] == 2
    drain(engine)
    for rid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1]), ("c", PROMPTS[2])):
        assert engine.collect(rid).output_ids == reference(target, prompt, greedy(5))


# ----------------------------------------------------------------------------- statistics
def test_mean_acceptance_length_includes_the_bonus_token() -> None:
    counters = SpecCounters()
    assert counters.mean_acceptance_length == 0.0 and counters.acceptance_rate == 0.0
    counters.record(proposed=7, accepted=3, acceptance_length=4)
    counters.record(proposed=7, accepted=0, acceptance_length=1)
    assert counters.mean_acceptance_length == 2.5  # (3 + 1 + 0 + 1) / 2, not 1.5
    assert counters.acceptance_rate == 3 / 14
    assert counters.as_dict()["accepted_per_position"] == {1: 1, 2: 1, 3: 1}
    assert counters.as_dict()["acceptance_length_histogram"] == {1: 1, 4: 1}


def test_statistics_under_an_oracle_schedule_are_exact(target: CausalLM, draft: DFlashDraft) -> None:
    """Schedule [3], block 8: every step accepts 3 (fewer only when the budget leaves fewer
    to draft), so only positions 1..3 are ever accepted."""
    budgets = {"a": (PROMPTS[0], 14), "b": (PROMPTS[1], 11), "c": (PROMPTS[2], 19)}
    engine = make_engine(target, draft, max_num_seqs=3)
    for rid, (prompt, n) in budgets.items():
        truth = reference(target, prompt, greedy(n))
        engine.add_request(rid, prompt, greedy(n), oracle=OracleProposer(truth, [3], VOCAB))
    steps_run = 0
    while engine.has_unfinished():
        engine.step()
        steps_run += 1
    stats = engine.stats()
    assert stats["steps"] == steps_run  # every step: the prefills' and the speculative ones
    assert set(stats) == {
        "requests_finished",
        "running",
        "waiting",
        "spec",
        "verify_widths",
        "fallbacks",
        "steps",
        "draft_ahead",
        "phases",
    }
    spec = stats["spec"]
    assert set(spec) == {
        "steps",
        "proposed",
        "accepted",
        "mean_acceptance_length",
        "acceptance_rate",
        "acceptance_length_histogram",
        "accepted_per_position",
    }
    for phase in ("prefill", "draft", "verify", "commit", "sample", "schedule"):
        assert stats["phases"][f"host_s_{phase}"] > 0, phase
    assert stats["fallbacks"] == {}

    seqs = [engine.collect(rid) for rid in budgets]
    steps = [s for seq in seqs for s in seq.steps]
    for seq in seqs:
        assert seq.output_ids == reference(target, seq.prompt_ids, seq.params)
        produced = 1  # the token from prefill
        for s in seq.steps:
            remaining = seq.params.max_tokens - produced
            assert s.proposed == min(BLOCK_SIZE - 1, remaining)
            assert s.accepted == min(3, s.proposed)
            assert s.acceptance_length == min(s.accepted + 1, remaining)
            produced += s.acceptance_length
        assert produced == len(seq.output_ids)
    cut = [s for s in steps if s.accepted < 3]
    assert 0 < len(cut) < len(steps)  # the budgets do cut some last steps

    expected_positions = {k: sum(1 for s in steps if s.accepted >= k) for k in (1, 2, 3)}
    assert spec["accepted_per_position"] == expected_positions
    assert expected_positions[1] == len(steps)  # every step drafts, and accepts, at least one
    assert spec["steps"] == len(steps)
    assert spec["proposed"] == sum(s.proposed for s in steps)
    assert spec["accepted"] == sum(s.accepted for s in steps)
    assert spec["acceptance_length_histogram"] == dict(
        sorted(Counter(s.acceptance_length for s in steps).items())
    )
    committed = sum(len(seq.output_ids) - 1 for seq in seqs)  # the prefill token is no step's
    assert spec["mean_acceptance_length"] == pytest.approx(committed / len(steps))
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["proposed"])
    for seq in seqs:
        assert seq.spec.steps == len(seq.steps)
        assert seq.spec.mean_acceptance_length == pytest.approx((len(seq.output_ids) - 1) / len(seq.steps))


def test_reset_stats_starts_every_statistic_afresh_and_waits_for_an_idle_engine(
    target: CausalLM,
    draft: DFlashDraft,
) -> None:
    """After a reset the same workload gives the statistics of a fresh engine (phase times
    aside); a reset while a request runs is refused and changes nothing."""

    def workload(engine: Engine) -> dict:
        truth = reference(target, PROMPTS[0], greedy(9))
        engine.add_request("a", PROMPTS[0], greedy(9), oracle=OracleProposer(truth, [2], VOCAB))
        engine.add_request("b", PROMPTS[1], greedy(6, logprobs=1))  # a fallback
        drain(engine)
        engine.collect("a"), engine.collect("b")
        stats = engine.stats()
        return {**stats, "phases": {k: v > 0 for k, v in stats["phases"].items()}}

    engine = make_engine(target, draft, max_num_seqs=2)
    fresh = workload(engine)
    assert fresh["spec"]["steps"] > 0 and fresh["fallbacks"] == {"logprobs": 1}
    engine.add_request("c", PROMPTS[2], greedy(4))
    with pytest.raises(RequestError, match="idle engine"):
        engine.reset_stats()
    drain(engine)
    engine.collect("c")
    assert engine.stats()["requests_finished"] == 3
    engine.reset_stats()
    assert engine.stats()["requests_finished"] == 0
    assert engine.stats()["spec"]["steps"] == 0 and engine.stats()["phases"] == {}
    assert engine.stats()["steps"] == 0
    assert workload(engine) == fresh


# ----------------------------------------------------------------------------- sampling
def sampled(seed: int, max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed, ignore_eos=True)


def run_alone(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request("r", prompt, params)
    drain(engine)
    return engine.collect("r").output_ids


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_seeded_sampling_requests_are_reproducible(
    target: CausalLM, draft: DFlashDraft, speculative: bool
) -> None:
    d = draft if speculative else None
    first = run_alone(make_engine(target, d), PROMPTS[0], sampled(1234))
    again = run_alone(make_engine(target, d), PROMPTS[0], sampled(1234))
    other = run_alone(make_engine(target, d), PROMPTS[0], sampled(4321))
    assert first == again
    assert first != other
    # a seeded request's tokens do not depend on what it is batched with
    engine = make_engine(target, d, max_num_seqs=3)
    engine.add_request("r", PROMPTS[0], sampled(1234))
    engine.add_request("s", PROMPTS[1], sampled(99))
    engine.add_request("g", PROMPTS[2], greedy(10))
    drain(engine)
    assert engine.collect("r").output_ids == first
    assert engine.collect("g").output_ids == reference(target, PROMPTS[2], greedy(10))


def test_an_unseeded_sampling_request_leaves_the_global_torch_rng_alone(
    target: CausalLM,
) -> None:
    """No hidden global state: drawing a fresh seed must not reseed torch's default
    generator (torch.seed() does), or code around the engine loses its reproducibility."""
    engine = make_engine(target, None)
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.8))
    assert torch.equal(torch.rand(4), expected)


def test_a_top_p_that_keeps_only_the_likeliest_token_samples_the_greedy_output(target: CausalLM) -> None:
    """Plain decode's sampling applies top_p: at top_p 1e-6 only the most likely token is
    left, so even a hot temperature gives greedy decode's tokens, the first one (from the
    prefill) included."""
    engine = make_engine(target, None, max_num_seqs=2)
    for i, prompt in enumerate(PROMPTS[:2]):
        params = SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, seed=i, ignore_eos=True)
        engine.add_request(str(i), prompt, params)
    drain(engine)
    for i, prompt in enumerate(PROMPTS[:2]):
        assert engine.collect(str(i)).output_ids == reference(target, prompt, greedy(12))


# ----------------------------------------------------------------------------- logprobs
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_logprobs_hold_the_chosen_token_and_the_top_k(
    target: CausalLM, draft: DFlashDraft, speculative: bool
) -> None:
    engine = make_engine(target, draft if speculative else None, max_num_seqs=2)
    engine.add_request("lp", PROMPTS[0], greedy(10, logprobs=3))
    engine.add_request("plain", PROMPTS[1], greedy(10))
    streamed = by_request(drain(engine))
    entries = []
    for out in streamed["lp"]:
        assert out.new_logprobs is not None
        assert len(out.new_logprobs) == len(out.new_token_ids)
        for token, entry in zip(out.new_token_ids, out.new_logprobs):
            assert token in entry
            assert len(entry) == 3  # greedy: the chosen token is the top one
            assert all(v <= 0 for v in entry.values())
            assert entry[token] == max(entry.values())
            assert sum(math.exp(v) for v in entry.values()) <= 1 + 1e-12
        entries += out.new_logprobs
    assert all(out.new_logprobs is None for out in streamed["plain"])
    seq = engine.collect("lp")
    assert seq.logprobs == entries
    assert seq.output_ids == reference(target, PROMPTS[0], greedy(10))
    if speculative:
        assert seq.fallback_reason == "logprobs"
        assert engine.stats()["fallbacks"] == {"logprobs": 1}
        assert engine.collect("plain").fallback_reason is None


def test_sampled_logprobs_include_the_sampled_token(target: CausalLM) -> None:
    engine = make_engine(target, None)
    engine.add_request(
        "r", PROMPTS[0], SamplingParams(max_tokens=12, temperature=1.5, seed=3, logprobs=2, ignore_eos=True)
    )
    outs = drain(engine)
    entries = [e for out in outs for e in out.new_logprobs]
    tokens = [t for out in outs for t in out.new_token_ids]
    assert len(entries) == len(tokens) == 12
    for token, entry in zip(tokens, entries):
        assert token in entry and 2 <= len(entry) <= 3
        assert all(v <= 0 for v in entry.values())


# ----------------------------------------------------------------------------- fallbacks
def test_repetition_penalty_changes_greedy_output_and_falls_back_from_speculation(
    target: CausalLM, draft: DFlashDraft
) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB - 16) for _ in range(rng.randint(3, 16))] for _ in range(6)]
    outputs = {}
    for penalty in (1.0, 1.3):
        engine = make_engine(target, None, max_num_seqs=len(prompts))
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, greedy(16, repetition_penalty=penalty))
        drain(engine)
        outputs[penalty] = [engine.collect(str(i)).output_ids for i in range(len(prompts))]
    assert outputs[1.0][0] == reference(target, prompts[0], greedy(16))
    changed = [i for i in range(len(prompts)) if outputs[1.0][i] != outputs[1.3][i]]
    assert changed, "repetition_penalty 1.3 changed no greedy output"
    i = changed[0]

    engine = make_engine(target, draft, max_num_seqs=2)
    engine.add_request("penalised", prompts[i], greedy(16, repetition_penalty=1.3))
    engine.add_request("normal", prompts[i], greedy(16))
    drain(engine)
    penalised, normal = engine.collect("penalised"), engine.collect("normal")
    assert penalised.fallback_reason == "sampling_option"
    assert not penalised.speculative and penalised.steps == []
    assert penalised.output_ids == outputs[1.3][i]
    assert normal.fallback_reason is None and normal.steps
    assert normal.output_ids == outputs[1.0][i]
    assert engine.stats()["fallbacks"] == {"sampling_option": 1}


@torch.inference_mode()
def penalised_greedy(target: CausalLM, prompt: list[int], penalty: float, n: int) -> list[int]:
    """Greedy decode under the repetition penalty, on the reference loop's prefill and decode
    steps: before each choice every token seen so far, prompt or output, has a positive logit
    divided by the penalty and a negative one multiplied by it."""
    state = new_state(target, len(prompt) + n)
    logits, _ = prefill(target, state, 0, prompt)
    seen, out = list(prompt), []
    for _ in range(n):
        row = logits.clone()
        for t in set(seen):
            row[t] = row[t] / penalty if row[t] > 0 else row[t] * penalty
        token = int(row.argmax())
        out.append(token)
        seen.append(token)
        logits = decode_step(target, state, 0, token)
    return out


def test_repetition_penalty_follows_its_rule_over_prompt_and_output_tokens(target: CausalLM) -> None:
    """The engine's penalised greedy output is the rule's, token by token. The first prompt
    ends with its own greedy continuation, which plain decode goes on repeating: prompt tokens
    count as seen, so the penalty changes even the first output token."""
    first = PROMPTS[0] + reference(target, PROMPTS[0], greedy(8))
    prompts = [first, PROMPTS[1]]
    engine = make_engine(target, None, max_num_seqs=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(16, repetition_penalty=1.3))
    drain(engine)
    outputs = [engine.collect(str(i)).output_ids for i in range(2)]
    assert outputs == [penalised_greedy(target, prompt, 1.3, 16) for prompt in prompts]
    assert outputs[0][0] != reference(target, first, greedy(1))[0]


def test_the_cpu_engine_runs_eagerly_with_no_spare_slot(qwen3_checkpoint) -> None:
    target = load_target(qwen3_checkpoint, dtype=torch.float32)
    engine = Engine(target, None, EngineConfig(max_num_seqs=3))
    assert not engine.runner.captured and engine.state.num_slots == 3


@pytest.mark.parametrize("strategy", ["replay", "per_token", "recompute"])
def test_blocks_padded_to_full_length_stay_lossless(tiny_pair: TinyPair, strategy: str) -> None:
    """With CUDA graphs every block is padded to B (a last, shorter block included); the
    padding must change nothing. Forced here on the CPU, in float64."""
    target_dir, draft_dir = tiny_pair("qwen3_5", block_size=8)
    target = load_target(target_dir, dtype=torch.float64)
    draft = load_draft(draft_dir, target)
    prompts = [[5, 9, 3, 77, 12], [40, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
    params = SamplingParams(max_tokens=11, ignore_eos=True)  # the last block is short
    refs = [generate_plain(target, p, params).output_ids for p in prompts]
    engine = Engine(target, draft, EngineConfig(max_num_seqs=2, commit_strategy=strategy))
    engine.speculative_step.pad_blocks = True
    widths = []
    correct = engine.speculative_step.propose
    engine.speculative_step.propose = lambda rows: (widths.append(rows.positions.shape[1]), correct(rows))[1]
    for i, p in enumerate(prompts):
        engine.add_request(
            str(i), p, params, oracle=OracleProposer(refs[i], [7, 2, 5], target.config.vocab_size)
        )
    while engine.has_unfinished():
        engine.step()
    assert [engine.collect(str(i)).output_ids for i in range(2)] == refs
    assert set(widths) == {8}


@pytest.mark.parametrize("every", [2, 3, 8])
def test_per_token_checkpoints_every_few_tokens_commit_the_state_of_every_token(
    tiny_pair: TinyPair, every: int
) -> None:
    """The per_token commit resumes from the checkpoint at or before each row's boundary
    (EngineConfig.checkpoint_every, 8 on the GPU): with checkpoints every 2, 3 or 8 tokens of
    a block of 8, rows accepting different counts each step, the output is plain greedy's and
    every slot's Gated DeltaNet state ends where the references' default (no state kept, the
    rows each token writes: NO_CHECKPOINTS) leaves it."""
    target_dir, draft_dir = tiny_pair("qwen3_5", block_size=8)
    target = load_target(target_dir, dtype=torch.float64)
    draft = load_draft(draft_dir, target)
    prompts = [[5, 9, 3, 77, 12], [40, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 7, 1]]
    params = SamplingParams(max_tokens=23, ignore_eos=True)
    refs = [generate_plain(target, p, params).output_ids for p in prompts]
    recurrent = {}
    for kept_every in (None, every):
        config = EngineConfig(max_num_seqs=3, commit_strategy="per_token", checkpoint_every=kept_every)
        engine = Engine(target, draft, config)
        # the CPU's references keep no state by default, but the rows each token writes
        assert engine.state.every == (kept_every or NO_CHECKPOINTS)
        for i, p in enumerate(prompts):
            accepts = [[7, 2, 5, 0, 3, 6, 1], [4, 6, 1, 3, 7, 0, 2], [1, 3, 7, 5, 2, 4, 0]][i]
            engine.add_request(
                str(i), p, params, oracle=OracleProposer(refs[i], accepts, target.config.vocab_size)
            )
        while engine.has_unfinished():
            engine.step()
        assert [engine.collect(str(i)).output_ids for i in range(3)] == refs
        layers = target.config.linear_layers
        recurrent[kept_every] = [engine.state.recurrent[layer].clone() for layer in layers]
    for got, want in zip(recurrent[every], recurrent[None]):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("strategy", ["replay", "per_token", "recompute"])
def test_every_commit_leaves_the_gated_deltanet_state_of_a_fresh_prefill_of_the_committed_tokens(
    tiny_pair: TinyPair, strategy: str
) -> None:
    """After each speculative commit, every row's conv and recurrent state is the one a fresh
    prefill of its committed tokens reaches (the rejected block tokens undone), whatever the
    strategy, with rows accepting different counts each step. On this tiny target a wrong
    state can leave the greedy output unchanged for a while, so the state itself is compared;
    float64, where the verify's other matmul shapes move only the last bits."""
    target_dir, draft_dir = tiny_pair("qwen3_5", block_size=8)
    target = load_target(target_dir, dtype=torch.float64)
    draft = load_draft(draft_dir, target)
    prompts = [[5, 9, 3, 77, 12], [40, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    refs = [generate_plain(target, p, params).output_ids for p in prompts]
    layers = target.config.linear_layers
    seen = []

    def observe(seq: Sequence, state, length: int) -> None:
        recurrent = [state.recurrent[layer][seq.slot].clone() for layer in layers]
        conv = [state.conv[layer][seq.slot].clone() for layer in layers]
        seen.append((int(seq.request_id), length, recurrent, conv))

    engine = Engine(target, draft, EngineConfig(max_num_seqs=2, commit_strategy=strategy))
    engine.commit_observer = observe
    for i, p in enumerate(prompts):
        accepts = [[2, 6, 0, 4], [5, 1, 3, 0]][i]
        engine.add_request(str(i), p, params, oracle=OracleProposer(refs[i], accepts, VOCAB))
    drain(engine)
    assert [engine.collect(str(i)).output_ids for i in range(2)] == refs
    assert len(seen) >= 6
    for i, length, recurrent, conv in seen:
        fresh = new_state(target, length)
        prefill(target, fresh, 0, (prompts[i] + refs[i])[:length])
        for layer, got_recurrent, got_conv in zip(layers, recurrent, conv):
            torch.testing.assert_close(got_recurrent, fresh.recurrent[layer][0], rtol=0, atol=1e-9)
            torch.testing.assert_close(got_conv, fresh.conv[layer][0], rtol=0, atol=1e-9)


def test_a_draft_row_that_is_not_finite_costs_acceptance_not_the_request(tiny_pair: TinyPair) -> None:
    target_dir, draft_dir = tiny_pair("qwen3_5", block_size=4)
    target = load_target(target_dir, dtype=torch.float64)
    draft = load_draft(draft_dir, target)  # poisoned below in memory only
    correct = draft.logits

    def poisoned(hidden, lm_head_weight, ops=None):
        logits = correct(hidden, lm_head_weight) if ops is None else correct(hidden, lm_head_weight, ops)
        return torch.cat([torch.full_like(logits[:1], float("nan")), logits[1:]])

    draft.logits = poisoned
    prompts = [[5, 9, 3, 77], [40, 8, 1, 2, 3]]
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    engine = Engine(target, draft, EngineConfig(max_num_seqs=2, commit_strategy="per_token"))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished():
        engine.step()
    for i, p in enumerate(prompts):
        seq = engine.collect(str(i))
        assert seq.finish_reason == "length"
        assert seq.output_ids == generate_plain(target, p, params).output_ids


def test_a_sampled_draft_row_that_is_not_finite_costs_acceptance_not_the_request(tiny_pair: TinyPair) -> None:
    """A sampled row draws NOT_A_DISTRIBUTION from a draft distribution that is not finite: its
    proposals are still valid ids for the verify, and the request runs to its end."""
    target_dir, draft_dir = tiny_pair("qwen3_5", block_size=4)
    target = load_target(target_dir, dtype=torch.float64)
    draft = load_draft(draft_dir, target)  # poisoned below in memory only
    draft.logits = lambda hidden, weight, ops=None: torch.full(
        (*hidden.shape[:-1], weight.shape[0]), float("nan"), dtype=hidden.dtype
    )
    outputs = []
    for _ in range(2):
        engine = Engine(target, draft, EngineConfig(max_num_seqs=2, commit_strategy="per_token"))
        engine.add_request("s", [5, 9, 3, 77], sampled(seed=7, max_tokens=9))
        while engine.has_unfinished():
            engine.step()
        seq = engine.collect("s")
        assert seq.finish_reason == "length" and len(seq.output_ids) == 9, seq.error
        assert all(0 <= t < target.config.vocab_size for t in seq.output_ids)
        outputs.append(seq.output_ids)
    assert outputs[0] == outputs[1]


def test_measured_eager_step_costs_cover_every_row_bucket_and_width_and_change_no_output(
    target: CausalLM, draft: DFlashDraft
) -> None:
    """`measure_step_costs` on the CPU: the verify width auto gets a measured table (rows 1,
    2, 4 up to max_num_seqs, every candidate width, a plain step included), the forwards it
    timed leave no trace in the slots, and the output is plain greedy's."""
    engine = make_engine(target, draft, max_num_seqs=3, measure_step_costs=True)
    costs = engine.verify_width.costs
    assert costs.measured and costs.unpadded  # eager steps run their own rows
    assert set(costs.seconds) == {(r, w) for r in (1, 2, 3) for w in (0, 1, 3, 7)}
    assert all(s > 0 for s in costs.seconds.values())
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), prompt, greedy(12))
    drain(engine)
    for i, prompt in enumerate(PROMPTS[:3]):
        assert engine.collect(str(i)).output_ids == reference(target, prompt, greedy(12))
    assert not make_engine(target, draft, max_num_seqs=3).verify_width.costs.measured  # off: flat


# plain steps (verify width 0) pay from 2 rows up and never for one row alone
PLAIN_PAYS_FROM_TWO = StepCosts(
    {
        (rows, w): s
        for rows in (1, 2)
        for w, s in ((0, 0.2 if rows == 2 else 10.0), (1, 1.0), (3, 1.6), (7, 3.5))
    },
    measured=True,
)


def record_proposals(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, int], list[int]]:
    """(request id, output position) -> the draft tokens each drafted step proposed there."""
    proposed: dict[tuple[str, int], list[int]] = {}
    step = engine.speculative_step
    propose = step.propose

    def recorded(rows):
        block, proposals, probs = propose(rows)
        for i, seq in enumerate(rows.seqs):
            proposed[seq.request_id, len(seq.output_ids)] = proposals[i, : rows.n[i]].tolist()
        return block, proposals, probs

    monkeypatch.setattr(step, "propose", recorded)
    return proposed


def test_the_context_a_plain_step_defers_reaches_its_own_request_alone(
    target: CausalLM, draft: DFlashDraft, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain step's draft context waits for the request's next draft (DeferredContext).
    Request a runs plain steps beside b and is aborted with its context still owed; c takes
    its slot with a longer prompt, runs plain steps beside b, then drafts alone once b ends.
    Every step c drafts proposes what c proposes on an engine of its own: nothing a left
    for its slot reaches c, and c's own plain steps' context is all there."""
    config = EngineConfig(max_num_seqs=2, block_size=BLOCK_SIZE)
    engine = Engine(target, draft, config, step_costs=PLAIN_PAYS_FROM_TWO)
    batched = record_proposals(engine, monkeypatch)
    engine.add_request("a", PROMPTS[1], greedy(40))
    engine.add_request("b", PROMPTS[0], greedy(30))
    for _ in range(8):
        engine.step()
    assert engine.stats()["verify_widths"].get(0, 0) >= 4
    a = engine.get("a")
    slot = a.slot
    assert id(a) in engine.speculative_step.deferred  # a owes its draft context
    engine.abort("a")
    assert id(a) not in engine.speculative_step.deferred  # dropped with it, not kept until a draft
    engine.add_request("c", LONG_PROMPT, greedy(24))
    engine.step()
    assert engine.get("c").slot == slot
    drain(engine)
    assert engine.collect("c").output_ids == reference(target, LONG_PROMPT, greedy(24))
    monkeypatch.undo()
    alone_engine = Engine(target, draft, config, step_costs=PLAIN_PAYS_FROM_TWO)
    alone = record_proposals(alone_engine, monkeypatch)
    alone_engine.add_request("c", LONG_PROMPT, greedy(24))
    drain(alone_engine)
    shared = [p for (rid, p) in batched if rid == "c" and ("c", p) in alone]
    assert len(shared) >= 2, (sorted(batched), sorted(alone))  # not vacuous
    for position in shared:
        assert batched["c", position] == alone["c", position], f"c's draft at output position {position}"


def test_a_row_with_one_token_left_is_credited_no_draft_token(target: CausalLM, draft: DFlashDraft) -> None:
    """A step commits at most what a request has left: its accepted draft tokens and the
    target's own token after them, so a row with r tokens left can gain at most r - 1 from
    its draft. With one token left a drafted step gains nothing over a plain step, and where
    a plain step costs less the width choice takes it (crediting r draft tokens, it drafted)."""
    from reference_engine.runtime.verify_width import StepCosts

    costs = StepCosts({(1, w): s for w, s in ((0, 1.0), (1, 1.6), (3, 2.0), (7, 3.0))}, measured=True)
    full = reference(target, PROMPTS[0], greedy(10))
    engine = Engine(target, draft, EngineConfig(max_num_seqs=1, block_size=BLOCK_SIZE), step_costs=costs)
    engine.add_request("r", PROMPTS[0], greedy(10), oracle=OracleProposer(full, [BLOCK_SIZE - 1], VOCAB))
    drain(engine)
    assert engine.collect("r").output_ids == full
    # the prefill's token, a full block of 8 (1 + 7 accepted), then one token left: a plain step
    assert engine.stats()["verify_widths"] == {7: 1, 0: 1}


def test_measured_eager_step_costs_time_the_whole_step(
    target: CausalLM, draft: DFlashDraft, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The eager table times whole steps, the commit and the step's host work included, not
    the forwards alone: a commit that takes 50 ms more shows in every drafted width's cost and
    in no plain step's (a plain step commits nothing: its block is kept whole)."""
    import time

    from reference_engine.runtime.speculative_step import SpeculativeStep

    commit_state = SpeculativeStep.commit_state

    def slow(self, *args, **kwargs):
        time.sleep(0.05)
        return commit_state(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeStep, "commit_state", slow)
    costs = make_engine(target, draft, max_num_seqs=2, measure_step_costs=True).verify_width.costs
    for rows in (1, 2):
        for width in (1, 3, 7):
            assert costs.of(rows, width) >= costs.of(rows, 0) + 0.04, costs.as_dict()


def test_measured_eager_step_costs_time_a_different_token_at_every_position(
    target: CausalLM, draft: DFlashDraft, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timed verifies read `timing_ids`, not one repeated token: a mixture of experts
    routes a block of one token to that token's k experts, and its verify would be timed as
    if it read a decode step's experts."""
    from reference_engine.runtime.model_runner import ModelRunner
    from reference_engine.runtime.verify_width import timing_ids

    seen = []
    verify = ModelRunner.verify

    def recording(self, ids, *args, **kwargs):
        seen.append(ids.clone())
        return verify(self, ids, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "verify", recording)
    make_engine(target, draft, max_num_seqs=2, measure_step_costs=True)
    assert seen
    vocab = target.config.vocab_size
    for ids in seen:
        rows, width = ids.shape
        assert torch.equal(ids, timing_ids(rows, BLOCK_SIZE, vocab)[:, :width])
        assert len(set(ids.flatten().tolist())) == ids.numel()


@pytest.mark.parametrize("pooled", [False, True], ids=["slots", "pooled"])
def test_a_dropped_engine_frees_its_state_without_the_garbage_collector(
    hybrid: tuple[CausalLM, DFlashDraft], pooled: bool
) -> None:
    """No reference cycle runs through an engine: dropping the last reference frees its state
    (on a GPU, its caches) at once, so a second engine in the same process has the memory."""
    import gc
    import weakref

    target, draft = hybrid
    options = {"kv_cache_tokens": 4096 + 2 * BLOCK_SIZE, "kv_cell_tokens": 16} if pooled else {}
    engine = make_engine(target, draft, max_num_seqs=2, max_model_len=64, **options)
    engine.add_request("a", LONG_PROMPT, greedy(6))
    drain(engine)
    engine.collect("a")
    alive = weakref.ref(engine), weakref.ref(engine.state), weakref.ref(engine.draft_state)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del engine
        assert [ref() is None for ref in alive] == [True] * 3
    finally:
        if enabled:
            gc.enable()


def _drafts_and_outputs(
    target, draft, ahead: bool, arrivals: dict[int, list[str]], fault=None, schedule: list[int] | None = None
):
    """Run requests through an eager engine (drafting ahead or not), joining at the steps of
    `arrivals`; returns each request's output and drafted blocks, and the engine. With
    `schedule`, each request's proposals come from an oracle that follows its plain greedy
    output and accepts the scheduled counts (a random tiny draft accepts next to nothing)."""
    engine = make_engine(target, draft, max_num_seqs=4)
    engine.speculative_step.draft_ahead = ahead
    if fault is not None:
        engine.speculative_step.launch_ahead = fault(engine.speculative_step.launch_ahead)
    prompts = {"a": PROMPTS[0], "b": PROMPTS[1], "c": LONG_PROMPT, "d": PROMPTS[2]}
    budgets = {"a": 12, "b": 30, "c": 25, "d": 9}  # a, admitted first, ends first
    step = 0
    while step == 0 or engine.has_unfinished() or any(s >= step for s in arrivals):
        for rid in arrivals.get(step, []):
            oracle = None
            if schedule is not None:
                truth = reference(target, prompts[rid], greedy(budgets[rid]))
                oracle = OracleProposer(truth, schedule, target.config.vocab_size)
            engine.add_request(rid, prompts[rid], greedy(budgets[rid]), oracle=oracle)
        engine.step()
        step += 1
    done = {rid: engine.collect(rid) for rid in prompts}
    return {rid: (s.output_ids, [r.drafted for r in s.steps]) for rid, s in done.items()}, engine


@pytest.mark.parametrize("pair", ["qwen3", "qwen3_5"])
def test_a_draft_queued_ahead_proposes_what_a_fresh_draft_would(
    target: CausalLM, draft: DFlashDraft, hybrid: tuple[CausalLM, DFlashDraft], pair: str
) -> None:
    """The next step's draft, queued before the host reads a step's results (DraftAhead),
    proposes the very blocks a fresh draft does, step by step, and is dropped when the rows
    change (a request joins or ends): outputs and every drafted block equal the engine's
    without it. A queued draft off by one position proposes other blocks (the check fails)."""
    pair_models = (target, draft) if pair == "qwen3" else hybrid
    arrivals = {0: ["a", "b"], 3: ["c"], 9: ["d"]}
    fresh, _ = _drafts_and_outputs(*pair_models, ahead=False, arrivals=arrivals)
    queued, engine = _drafts_and_outputs(*pair_models, ahead=True, arrivals=arrivals)
    assert queued == fresh
    step = engine.speculative_step
    assert step.ahead_used > 5 and step.ahead_queued > step.ahead_used  # used while the rows held
    assert step.ahead_narrowed >= 1  # and after some had ended
    for rid, (out, _) in fresh.items():
        assert out == reference(
            pair_models[0],
            {"a": PROMPTS[0], "b": PROMPTS[1], "c": LONG_PROMPT, "d": PROMPTS[2]}[rid],
            greedy(len(out)),
        )

    def shifted(launch):
        def launch_ahead(rows, bonus, processed, *args):
            return launch(rows, bonus, processed - 1, *args)

        return launch_ahead

    faulty, _ = _drafts_and_outputs(*pair_models, ahead=True, arrivals=arrivals, fault=shifted)
    assert [d for _, d in faulty.values()] != [d for _, d in fresh.values()]
    assert [o for o, _ in faulty.values()] == [o for o, _ in fresh.values()]  # lossless all the same


@torch.inference_mode()
def first_block_proposals(target: CausalLM, draft: DFlashDraft, prompt: list[int]) -> list[int]:
    """The draft's proposals for a request's first block, from the models alone: the whole
    prompt's target features as the draft's context, then a block of the greedy first token
    and BLOCK_SIZE - 1 mask tokens right after the prompt."""
    n = len(prompt)
    state = new_state(target, n + BLOCK_SIZE)
    logits, features = prefill(target, state, 0, prompt, capture_layers=draft.config.target_layer_ids)
    draft_state = DraftState(draft.config, 1, n + BLOCK_SIZE, torch.float64)
    slots = torch.tensor([0])
    draft.append_context(features[None], torch.arange(n)[None], slots, draft_state)
    block = torch.full((1, BLOCK_SIZE), draft.config.mask_token_id)
    block[0, 0] = int(logits.argmax())
    embeds = target.embed(block) * draft.config.input_embedding_scale
    hidden = draft(embeds, torch.arange(n, n + BLOCK_SIZE)[None], slots, draft_state, n + BLOCK_SIZE)
    return draft.proposals(hidden, target.lm_head_weight, anchors=block[:, 0])[1][0].tolist()


def test_a_speculative_requests_first_draft_reads_its_whole_prompt_as_context(
    target: CausalLM, draft: DFlashDraft
) -> None:
    """Prefill writes the prompt's target features into the draft's context, chunk by chunk:
    each request's first drafted block is the one the draft proposes from the whole prompt.
    A draft without that context stays lossless (the output alone cannot show it), but
    proposes other tokens."""
    prompts = {"short": PROMPTS[0], "long": LONG_PROMPT}
    engine = make_engine(target, draft, max_num_seqs=2, prefill_chunk=8)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy(12))
    drain(engine)
    for rid, prompt in prompts.items():
        seq = engine.collect(rid)
        assert seq.output_ids == reference(target, prompt, greedy(12))
        assert list(seq.steps[0].drafted) == first_block_proposals(target, draft, prompt)


def _as_if_captured(engine: Engine) -> None:
    """Run the speculative step as with CUDA graphs, on the CPU: full padded blocks, a
    "replayed" accept that runs the captured accept's body eagerly (the step's table, and
    `processed` written into the commit's input), and a "replayed" commit that runs the
    captured commit's body eagerly right after it (it writes the draft context of every
    verified position), so that the step queues the next draft from the device's results
    before the host reads them, as on a GPU."""
    step = engine.speculative_step
    step.pad_blocks = True
    verify = step.verify

    def stash(rows, block, record=True):
        out = verify(rows, block, record)
        step._verified = (rows, block, out)
        return out

    def accept(count):
        rows, block, out = step._verified
        if block.shape[1] == 1:  # a plain step accepts eagerly
            return None
        processed = torch.zeros(count, dtype=torch.int64)
        x = StepInputs(block, rows.positions, rows.slots, rows.n_t + 1, processed=processed)
        tokens = out.tokens if out.tokens is not None else step.ops.greedy(out.logits)
        step._processed = processed
        step._table = step.accept_body(x, replace(out, tokens=tokens))
        return step._table

    def commit_replayed(processed, written=False):
        rows, block, out = step._verified
        if block.shape[1] == 1:  # a plain step commits eagerly
            return False
        if written:  # what the captured accept left in the commit's input
            processed = step._processed
        step.commit_state(rows.slot_ids, rows, block, processed)
        features = step.context_features(out.features, block.shape[1], rows.n_t)
        step.draft.append_context(features, rows.positions, rows.slots, step.draft_state, step.ops)
        return True

    def propose_ahead(remaining, width):  # the captured inputs (ahead_body), then the draft
        rows, block, out = step._verified
        x = StepInputs(block, rows.positions, rows.slots, rows.n_t + 1, processed=step._processed)
        nxt = step.ahead_body(x, step._table, remaining)
        max_len = step.state.max_len
        drafted = step.runner.propose(nxt.ids, nxt.positions, nxt.slots, nxt.valid, max_len, width=width)
        step._ahead_inputs += 1
        return nxt, drafted

    step._ahead_inputs = 0
    step.verify, step.commit_replayed, step.runner.accept = stash, commit_replayed, accept
    step.runner.propose_ahead = propose_ahead


@pytest.mark.parametrize("pair", ["qwen3", "qwen3_5"])
def test_a_draft_queued_behind_a_replayed_commit_proposes_what_a_fresh_draft_would(
    target: CausalLM, draft: DFlashDraft, hybrid: tuple[CausalLM, DFlashDraft], pair: str, monkeypatch
) -> None:
    """The GPU's path of DraftAhead, on the CPU: queued from the device's bonus tokens,
    processed counts and remaining budgets, before the host has read them."""
    pair_models = (target, draft) if pair == "qwen3" else hybrid
    arrivals = {0: ["a", "b"], 3: ["c"], 9: ["d"]}
    made = []
    original = Engine.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _as_if_captured(self)
        made.append(self)

    monkeypatch.setattr(Engine, "__init__", init)
    fresh, _ = _drafts_and_outputs(*pair_models, ahead=False, arrivals=arrivals)
    queued, engine = _drafts_and_outputs(*pair_models, ahead=True, arrivals=arrivals)
    assert queued == fresh
    step = engine.speculative_step
    assert step.ahead_used > 5 and step.ahead_narrowed >= 1  # some taken after rows ended
    assert engine.stats()["draft_ahead"]["used"] == step.ahead_used
    assert step._ahead_inputs == step.ahead_queued  # every one from the captured inputs

    # captured inputs one position behind, or with another row's anchors, propose other
    # blocks; the verify takes its anchors from the host, so outputs stay lossless
    ahead_body, next_blocks = SpeculativeStep.ahead_body, SpeculativeStep.next_blocks

    def behind(self, x, table, remaining):
        nxt = ahead_body(self, x, table, remaining)
        N = self.block_size - 1
        _, positions = next_blocks(self, table[:, 1], table[:, 2] - 1, x.positions[:, 0], N, nxt.valid - 1)
        return replace(nxt, positions=positions)

    def swapped(self, x, table, remaining):  # each block with another row's anchor
        nxt = ahead_body(self, x, table, remaining)
        return replace(nxt, ids=nxt.ids.roll(1, dims=0))

    for fault in (behind, swapped):
        with monkeypatch.context() as m:
            m.setattr(SpeculativeStep, "ahead_body", fault)
            faulty, _ = _drafts_and_outputs(*pair_models, ahead=True, arrivals=arrivals)
        assert [d for _, d in faulty.values()] != [d for _, d in fresh.values()], fault.__name__
        assert [o for o, _ in faulty.values()] == [o for o, _ in fresh.values()], fault.__name__

    # a queued draft taken for the first rows, not for the rows that go on, proposes others
    rows_for = DraftAhead.rows_for
    monkeypatch.setattr(
        DraftAhead,
        "rows_for",
        lambda self, rows: None if rows_for(self, rows) is None else list(range(len(rows.seqs))),
    )
    faulty, _ = _drafts_and_outputs(*pair_models, ahead=True, arrivals=arrivals)
    assert [d for _, d in faulty.values()] != [d for _, d in fresh.values()]


@pytest.mark.parametrize("pair", ["qwen3", "qwen3_5"])
def test_the_captured_accept_commits_what_the_eager_accept_commits(
    target: CausalLM, draft: DFlashDraft, hybrid: tuple[CausalLM, DFlashDraft], pair: str, monkeypatch
) -> None:
    """SpeculativeStep.accept_body, the captured accept, run eagerly on the CPU in the GPU's
    step (`_as_if_captured`): every step's table and the `processed` it writes for the commit
    give the outputs and drafted blocks of the eager accept, with rows joining and ending;
    a replaced accept method (a planted fault) is never bypassed by it."""
    from gates.faults import planted

    pair_models = (target, draft) if pair == "qwen3" else hybrid
    arrivals = {0: ["a", "b"], 3: ["c"], 9: ["d"]}
    tables = []
    original = Engine.__init__

    def init(self, *args, eager_accept=False, **kwargs):
        original(self, *args, **kwargs)
        _as_if_captured(self)
        accept = self.runner.accept

        def counted(count):
            if eager_accept:
                return None
            table = accept(count)
            tables.append(None if table is None else table[:, 0].tolist())  # accepted, a row each
            return table

        self.runner.accept = counted

    schedule = [7, 0, 3, 7, 2, 5]  # every step a different count, the full block among them
    monkeypatch.setattr(Engine, "__init__", init)
    captured, engine = _drafts_and_outputs(*pair_models, ahead=True, arrivals=arrivals, schedule=schedule)
    drafted = sum(n for width, n in engine.verify_widths.items() if width > 0)
    assert len(tables) == drafted > 5 and None not in tables  # it ran for every drafted step
    accepted = {a for table in tables for a in table}
    assert {0, 2, 3, 7} <= accepted, accepted  # not vacuous: the tables held accepted tokens
    monkeypatch.setattr(Engine, "__init__", lambda self, *a, **k: init(self, *a, eager_accept=True, **k))
    eager, _ = _drafts_and_outputs(*pair_models, ahead=True, arrivals=arrivals, schedule=schedule)
    assert captured == eager
    tables.clear()
    monkeypatch.setattr(Engine, "__init__", init)
    with planted("wrong_bonus_position"):
        faulty, _ = _drafts_and_outputs(*pair_models, ahead=True, arrivals=arrivals, schedule=schedule)
    assert tables == [] and [o for o, _ in faulty.values()] != [o for o, _ in eager.values()]


def _heads_again_on_the_cpu(engine: Engine, fault: Callable | None = None) -> None:
    """`ModelRunner.repropose` as a captured draft's head replay does it, on the CPU: the
    head over the hidden states the last draft forward left (its first `rows` rows);
    `fault` may change those hidden states first."""
    from reference_engine.runtime.forwards import Proposals

    runner, kept = engine.runner, {}

    def propose(block, positions, slots, valid, kv_len, phase=None, width=None):
        embeds = runner.target.embed(block) * runner.draft.config.input_embedding_scale
        hidden = runner.draft(
            embeds, positions, slots, runner.draft_state, kv_len, valid_len=valid, ops=runner.ops
        )
        kept.update(hidden=hidden, anchors=block[:, 0])
        head = runner.target.lm_head_weight
        return Proposals(*runner.draft.proposals(hidden, head, runner.ops, block[:, 0], width=width))

    def repropose(rows, width):
        hidden = kept["hidden"][:rows] if fault is None else fault(kept["hidden"][:rows])
        head = runner.target.lm_head_weight
        return Proposals(
            *runner.draft.proposals(hidden, head, runner.ops, kept["anchors"][:rows], width=width)
        )

    runner.propose, runner.repropose = propose, repropose


@pytest.mark.parametrize("pair", ["qwen3", "qwen3_5"])
def test_a_queued_draft_taken_by_a_wider_step_runs_its_head_again_and_proposes_what_a_fresh_draft_would(
    target: CausalLM, draft: DFlashDraft, hybrid: tuple[CausalLM, DFlashDraft], pair: str, monkeypatch
) -> None:
    """A draft queued ahead runs its head for the queuing step's width (the proposals of a
    verify of W are those of draft slots 1..W); a next step that verifies more runs the head
    again over the same layers' output (a captured head's replay), one that verifies fewer
    takes a prefix. With widths that change every step, outputs and every drafted block equal
    an engine's that drafts afresh at each step's own width; a head run again over another
    row's hidden states proposes other blocks."""
    from reference_engine.runtime.verify_width import VerifyWidth

    pair_models = (target, draft) if pair == "qwen3" else hybrid
    arrivals = {0: ["a", "b"], 3: ["c"], 9: ["d"]}
    cycle = (3, 7, 1, 5, 7, 2, 2, 6)
    chosen = []

    def choose(self, limits, counters, totals):
        chosen.append(cycle[len(chosen) % len(cycle)])
        return chosen[-1]

    monkeypatch.setattr(VerifyWidth, "choose", choose)
    made = []
    original = Engine.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _as_if_captured(self)
        fault = made.pop() if made else None
        if fault != "eager":  # eager: nothing kept to run a head again, so it drafts afresh
            _heads_again_on_the_cpu(self, fault=fault)

    monkeypatch.setattr(Engine, "__init__", init)
    fresh, _ = _drafts_and_outputs(*pair_models, ahead=False, arrivals=arrivals)
    chosen.clear()
    queued, engine = _drafts_and_outputs(*pair_models, ahead=True, arrivals=arrivals)
    assert queued == fresh
    step = engine.speculative_step
    assert step.ahead_widened >= 3 and step.ahead_used > step.ahead_widened  # wider, and prefixes
    assert engine.stats()["draft_ahead"]["widened"] == step.ahead_widened
    assert any(0 < len(d) < BLOCK_SIZE - 1 for _, drafted in fresh.values() for d in drafted)

    chosen.clear()
    made.append("eager")
    afresh, engine = _drafts_and_outputs(*pair_models, ahead=True, arrivals=arrivals)
    assert afresh == fresh and engine.speculative_step.ahead_widened == 0

    chosen.clear()
    made.append(lambda hidden: hidden.roll(1, dims=0))  # the head again over the next row's states
    faulty, _ = _drafts_and_outputs(*pair_models, ahead=True, arrivals=arrivals)
    assert [d for _, d in faulty.values()] != [d for _, d in fresh.values()]
    assert [o for o, _ in faulty.values()] == [o for o, _ in fresh.values()]  # lossless all the same


def test_the_verify_width_reads_each_rows_recent_counts(target: CausalLM, draft: DFlashDraft) -> None:
    """The width is chosen from each row's RecentAcceptance (its recent steps weighing more),
    recorded at every drafted step; the request's SpecCounters keep the plain counts."""
    from reference_engine.runtime.stats import RecentAcceptance

    engine = make_engine(target, draft, max_num_seqs=2)
    seen: list[tuple[int, int]] = []  # (steps of the counters the width got, the request's steps)
    choose = engine.verify_width.choose

    def recording(limits, counters, totals):
        for seq, counted in zip(engine.scheduler.running(), counters):
            assert isinstance(counted, RecentAcceptance) and counted is seq.recent
            seen.append((counted.steps, seq.spec.steps))
        return choose(limits, counters, totals)

    engine.verify_width.choose = recording
    engine.add_request("a", PROMPTS[0], greedy(30))
    drain(engine)
    assert len(seen) >= 3 and all(recent == plain for recent, plain in seen)
    assert seen[-1][0] >= 2


def test_a_requests_recent_counts_hold_the_draft_tokens_its_steps_accepted(
    target: CausalLM, draft: DFlashDraft
) -> None:
    """Each drafted step adds its accepted draft tokens to the request's RecentAcceptance,
    not the tokens it committed (one more, the bonus): under an oracle accepting 3 of every
    block (fewer where the budget leaves fewer to draft) the decayed counts are those of its
    steps' (proposed, accepted), positions 1..3 accepted and 4 verified (the first
    rejection) but never accepted."""
    full = reference(target, PROMPTS[0], greedy(30))
    engine = make_engine(target, draft, max_num_seqs=1)
    engine.add_request("r", PROMPTS[0], greedy(30), oracle=OracleProposer(full, [3], VOCAB))
    drain(engine)
    seq = engine.collect("r")
    assert len(seq.steps) >= 3 and all(s.accepted == min(3, s.proposed) for s in seq.steps)
    expected = RecentAcceptance()
    for s in seq.steps:
        expected.record(s.proposed, s.accepted)
    accepted_at, verified_at = seq.recent.counts()
    assert set(accepted_at) == {1, 2, 3} and set(verified_at) == {1, 2, 3, 4}
    assert (accepted_at, verified_at) == expected.counts()
