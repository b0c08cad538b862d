"""One request's failure is its own (engine.py): a row whose distribution is not finite, or
an exception in one request's work, ends that request with finish_reason "error"; the other
requests of the same batch commit exactly what they commit without it, and the freed slot
serves the next request correctly. Sampling values the arithmetic cannot carry are refused
or, for a tiny temperature, served as greedy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.errors import RequestError
from reference_engine.models import CausalLM
from reference_engine.models.dflash import DFlashDraft
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.outputs import StepOutputs
from reference_engine.runtime.prefill import Prefill
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.sampling import NOT_A_DISTRIBUTION, sample
from reference_engine.runtime.sequence import Sequence

from .poison import POISON, poisoned

TinyPair = Callable[..., tuple[Path, Path]]
PROMPTS = [[17, 301, 5, 88, 260], [400, 3, 77], [250, 251, 13, 480, 66, 1], [8, 9]]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def pair(tiny_pair: TinyPair) -> tuple[CausalLM, DFlashDraft]:
    target_dir, draft_dir = tiny_pair("qwen3_5", block_size=4)
    target = load_target(target_dir, dtype=torch.float64)
    return target, load_draft(draft_dir, target)


def params(**options) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **options)


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for request_id, (prompt, p) in requests.items():
        engine.add_request(request_id, prompt, p)
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
    return {request_id: engine.collect(request_id) for request_id in requests}


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_a_non_finite_row_fails_its_request_alone(pair, speculative: bool, temperature: float) -> None:
    target, draft = pair
    config = EngineConfig(max_num_seqs=4, block_size=4 if speculative else None)
    poison = [POISON, 40, 41]
    requests = {f"r{i}": (p, params()) for i, p in enumerate(PROMPTS[:3])}
    requests["bad"] = (poison, params(temperature=temperature, seed=1))
    with poisoned():
        engine = Engine(target, draft if speculative else None, config)
        done = run(engine, requests)
        bad = done.pop("bad")
        assert bad.finish_reason == "error" and "not finite" in bad.error
        assert all(0 <= t < target.config.vocab_size for t in bad.output_ids)
        for request_id, seq in done.items():
            prompt = requests[request_id][0]
            assert seq.finish_reason == "length" and seq.error is None
            assert seq.output_ids == generate_plain(target, prompt, params()).output_ids
        # the freed slot serves the next request exactly
        again = run(engine, {"next": (PROMPTS[3], params())})["next"]
        assert again.output_ids == generate_plain(target, PROMPTS[3], params()).output_ids
        assert engine.scheduler.free_slots == [0, 1, 2, 3]


def test_an_exception_in_one_requests_prefill_fails_that_request_alone(pair, monkeypatch) -> None:
    target, _ = pair
    prefill = Prefill.one

    def failing(self, seq, outputs):
        if seq.request_id == "bad":
            raise RuntimeError("planted")
        return prefill(self, seq, outputs)

    monkeypatch.setattr(Prefill, "one", failing)
    engine = Engine(target, None, EngineConfig(max_num_seqs=4))
    done = run(engine, {"bad": (PROMPTS[0], params()), "good": (PROMPTS[1], params())})
    assert done["bad"].finish_reason == "error"
    assert "RuntimeError: planted" in done["bad"].error
    assert done["good"].output_ids == generate_plain(target, PROMPTS[1], params()).output_ids


def test_an_exception_in_a_batched_decode_fails_every_request_it_was_computing(pair) -> None:
    """Plain decode runs its requests in one forward: when that forward raises, each request
    it was computing fails with the reason (none is left running on tokens that never came),
    and the freed slots serve the next request exactly."""
    target, _ = pair
    engine = Engine(target, None, EngineConfig(max_num_seqs=4))
    decode, calls = engine.runner.decode, []

    def failing(*args):
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("planted")
        return decode(*args)

    engine.runner.decode = failing
    done = run(engine, {f"r{i}": (p, params()) for i, p in enumerate(PROMPTS[:3])})
    for seq in done.values():
        assert seq.finish_reason == "error" and seq.error == "engine error: RuntimeError: planted"
        assert len(seq.output_ids) == 2  # the prefill's token and the first decode step's
    engine.runner.decode = decode
    again = run(engine, {"next": (PROMPTS[3], params())})["next"]
    assert again.output_ids == generate_plain(target, PROMPTS[3], params()).output_ids


def test_sample_marks_a_row_that_is_not_a_distribution_without_failing_the_others() -> None:
    probs = torch.tensor(
        [
            [0.0, 1.0, 0.0],
            [float("nan"), 0.5, 0.5],
            [0.0, 0.0, 0.0],
            [float("inf"), 0.0, 0.0],
            [0.0, 0.0, 1.0],
        ]
    )
    drawn = sample(probs, torch.Generator().manual_seed(0)).tolist()
    assert drawn == [1, NOT_A_DISTRIBUTION, NOT_A_DISTRIBUTION, NOT_A_DISTRIBUTION, 2]


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"temperature": 1.0, "seed": 2**70}, r"seed must be an integer in \[-2\*\*63"),
        ({"temperature": 1.0, "seed": -(2**64)}, r"seed must be an integer"),
        ({"temperature": float("inf")}, r"temperature must be finite"),
        ({"repetition_penalty": 1e-300}, r"repetition_penalty must be in \[0.01, 100.0\]"),
        ({"repetition_penalty": 1e9}, r"repetition_penalty must be in \[0.01, 100.0\]"),
    ],
    ids=["seed-too-large", "seed-too-small", "infinite-temperature", "tiny-penalty", "huge-penalty"],
)
def test_sampling_values_the_arithmetic_cannot_carry_are_refused(options: dict, pattern: str) -> None:
    with pytest.raises(RequestError, match=pattern):
        SamplingParams(**options)


def test_a_tiny_positive_temperature_is_served_as_greedy(pair) -> None:
    target, _ = pair
    assert SamplingParams(temperature=1e-30).greedy and not SamplingParams(temperature=1e-4).greedy
    engine = Engine(target, None, EngineConfig(max_num_seqs=2))
    done = run(engine, {"tiny": (PROMPTS[0], params(temperature=1e-30)), "zero": (PROMPTS[1], params())})
    assert done["tiny"].output_ids == generate_plain(target, PROMPTS[0], params()).output_ids
    assert done["zero"].output_ids == generate_plain(target, PROMPTS[1], params()).output_ids


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_a_non_finite_row_asking_for_logprobs_fails_alone(pair, temperature: float) -> None:
    target, _ = pair
    requests = {f"r{i}": (p, params(logprobs=2)) for i, p in enumerate(PROMPTS[:2])}
    requests["bad"] = ([POISON, 40, 41], params(temperature=temperature, seed=1, logprobs=2))
    with poisoned():
        done = run(Engine(target, None, EngineConfig(max_num_seqs=4)), requests)
    assert done.pop("bad").finish_reason == "error"
    for request_id, seq in done.items():
        expected = generate_plain(target, requests[request_id][0], params()).output_ids
        assert seq.output_ids == expected and len(seq.logprobs) == MAX_TOKENS


def sequence(max_tokens: int, stops: frozenset[int] = frozenset()) -> Sequence:
    return Sequence("r", [1, 2], SamplingParams(max_tokens=max_tokens, ignore_eos=True), stops, 0.0, False)


def test_step_outputs_take_every_id_below_the_vocabulary_and_fail_the_vocab_id() -> None:
    """An id in [0, vocab) is a token and is committed; the id `vocab` (greedy's mark of a
    NaN row) fails the request with a numerical-failure reason, after the tokens before it
    (plain decode emits those before the step that fails)."""
    outputs = StepOutputs(vocab_size=8)
    fine, bad = sequence(4), sequence(4)
    assert outputs.emit(fine, [0, 7]) is True
    assert fine.output_ids == [0, 7] and fine.finish_reason is None
    assert outputs.emit(bad, [3, 8, 2]) is False
    assert bad.output_ids == [3] and bad.finish_reason == "error" and "not finite" in bad.error
    assert [(o.new_token_ids, o.finish_reason) for o in outputs.items] == [
        ([0, 7], None),
        ([3], None),
        ([], "error"),
    ]
    first = sequence(4)
    assert outputs.emit(first, [8]) is False and first.output_ids == [] and first.finish_reason == "error"


def test_a_request_that_ends_before_a_not_finite_row_ends_as_plain_decode_ends_it() -> None:
    """A commit whose stop token or last allowed token comes before a NaN row's mark ends the
    request there ("stop", "length"), as plain decode, which never computes the row after
    the end, ends it; nothing fails."""
    outputs = StepOutputs(vocab_size=8)
    stopped, full = sequence(4, stops=frozenset({3})), sequence(2)
    assert outputs.emit(stopped, [5, 3, 8]) is True
    assert stopped.output_ids == [5, 3] and stopped.finish_reason == "stop" and stopped.error is None
    assert outputs.emit(full, [5, 6, 8]) is True
    assert full.output_ids == [5, 6] and full.finish_reason == "length"
    assert [o.finish_reason for o in outputs.items] == ["stop", "length"]


def test_logprobs_are_cut_with_the_tokens_a_request_keeps() -> None:
    """Tokens past max_tokens are not committed, nor are their logprobs: the step output and
    the request carry one logprob entry per kept token."""
    outputs = StepOutputs(vocab_size=8)
    seq = sequence(2)
    entries = [{5: -0.1}, {6: -0.2}, {7: -0.3}]
    assert outputs.emit(seq, [5, 6, 7], entries) is True
    (out,) = outputs.items
    assert out.new_token_ids == [5, 6] and out.finished and out.finish_reason == "length"
    assert out.new_logprobs == entries[:2] and seq.logprobs == entries[:2]


def test_a_request_is_failed_once_whatever_fails_it_again() -> None:
    """A request already finished (failed, or done) is not failed again: one error output,
    the first reason kept."""
    outputs = StepOutputs(vocab_size=8)
    seq = sequence(4)
    with outputs.failing([seq]):
        raise RuntimeError("first")
    outputs.fail(seq, "second")
    assert [o.error for o in outputs.items] == ["engine error: RuntimeError: first"]
    assert seq.error == "engine error: RuntimeError: first"
    done = sequence(1)
    outputs.emit(done, [3])
    outputs.fail(done, "late")
    assert done.finish_reason == "length" and len(outputs.items) == 2
