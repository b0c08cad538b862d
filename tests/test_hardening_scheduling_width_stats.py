"""Contracts of the scheduler, the verify width, the engine's statistics and the choice of a
plain-decode token, on small CPU shapes:

- the scheduler (runtime/scheduler.py): prompts prefill oldest first however the slots were
  handed out; a speculative request that asks for several plain-decode options falls back
  once, under the first reason in the documented order; a duplicate id is refused as a
  duplicate also when the engine is full.
- token choice (runtime/token_choice.py, penalties.py): the repetition penalty, then the
  presence and frequency penalties and the logit bias, in that order; logprobs of the
  distribution the token came from; a logit bias applies from the first token on, also for a
  request alone in its batch.
- request checks (runtime/request.py): the documented range of a logit bias, both ends
  included, its token ids inside the vocabulary, and a token it names twice.
- the verify width (runtime/verify_width.py, speculative_step.py): every step of a turn
  records as many proposed tokens as its width let it check; `reset` forgets a run of narrow
  steps; timed step costs are the median of the timed steps after an untimed one.
- statistics (runtime/stats.py): a rescale of the recent acceptance counts changes none of
  them; `reset_stats` starts the phase counts afresh.

The tiny dense Qwen3 target in float64, with a tiny block-8 DFlash draft.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.errors import RequestError
from reference_engine.models import CausalLM
from reference_engine.models.dflash import DFlashDraft
from reference_engine.runtime import speculative_step
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.penalties import apply_penalties
from reference_engine.runtime.request import SamplingParams, validate_request
from reference_engine.runtime.scheduler import EngineFullError, Scheduler
from reference_engine.runtime.sequence import Sequence
from reference_engine.runtime.speculative_step import SpeculativeStep
from reference_engine.runtime.stats import RecentAcceptance, SpecCounters
from reference_engine.runtime.token_choice import choose_tokens
from reference_engine.runtime.verify_width import PROBE_AFTER, StepCosts, VerifyWidth
from tests.test_step_engine_contracts import drain
from tests.test_verify_width import decayed_counts

TinyCheckpoint = Callable[..., Path]
TinyPair = Callable[..., tuple[Path, Path]]
F64 = torch.float64
BLOCK = 8
VOCAB = 512
CHUNK = 16
PROMPT = [17, 301, 5, 88, 260, 42, 7, 199, 33, 410, 2, 95, 61]
OTHER_PROMPT = [400, 3, 77, 120, 9]


@pytest.fixture(scope="module")
def target(tiny_checkpoint: TinyCheckpoint) -> CausalLM:
    return load_target(tiny_checkpoint("qwen3"), dtype=F64)


@pytest.fixture(scope="module")
def draft(tiny_pair: TinyPair, target: CausalLM) -> DFlashDraft:
    _, draft_dir = tiny_pair("qwen3", block_size=BLOCK)
    return load_draft(draft_dir, target)


def request(rid: str, prompt: int = 1, speculative: bool = False, **options) -> Sequence:
    params = SamplingParams(max_tokens=8, **options)
    return Sequence(rid, [1] * prompt, params, frozenset(), 0.0, speculative)


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


# ----------------------------------------------------------------------------- the scheduler
def test_prompts_prefill_oldest_first_though_a_later_one_took_a_lower_slot() -> None:
    """prefilling: the requests run their chunks in admission order, oldest first; a request
    admitted later to a lower freed slot comes after the older ones, and under a token budget
    of one chunk the oldest alone runs."""
    for budget, want in ((None, ["b", "c", "d"]), (CHUNK, ["b"])):
        s = Scheduler(3, "wait", 8, None, 8, CHUNK, budget, BLOCK)
        for rid in ("a", "b", "c"):
            s.queue(request(rid, 100))
        assert [(x.request_id, x.slot) for x in s.admit()] == [("a", 0), ("b", 1), ("c", 2)]
        s.finish(s.get("a"))
        s.queue(request("d", 100))
        assert [(x.request_id, x.slot) for x in s.admit()] == [("d", 0)]
        assert ids(s.prefilling()) == want, budget


@pytest.mark.parametrize(
    "options, reason",
    [
        ({"logprobs": 1, "repetition_penalty": 1.2, "presence_penalty": 0.5}, "logprobs"),
        ({"repetition_penalty": 1.2, "presence_penalty": 0.5}, "sampling_option"),
        ({"repetition_penalty": 1.2, "logit_bias": ((3, 1.0),)}, "sampling_option"),
        ({"frequency_penalty": 0.5, "logit_bias": ((3, 1.0),)}, "penalties"),
    ],
)
def test_a_request_asking_for_several_plain_options_falls_back_once_under_the_first_reason(
    options: dict, reason: str
) -> None:
    """The reasons' order (docs/engine.md): logprobs, then repetition_penalty
    (`sampling_option`), then presence/frequency penalties and logit bias (`penalties`). A
    request that asks for several falls back once, counted under the first of them; a plain
    request asking for the same falls back from nothing and counts none."""
    s = Scheduler(4, "wait", 8, None, 8, CHUNK, None, BLOCK)
    spec = request("s", speculative=True, **options)
    plain = request("p", speculative=False, **options)
    s.queue(spec)
    s.queue(plain)
    assert not spec.speculative and spec.fallback_reason == reason
    assert plain.fallback_reason is None
    assert s.fallbacks == {reason: 1}


@pytest.mark.parametrize("admission, max_waiting", [("reject", 0), ("wait", 0)])
def test_a_duplicate_id_is_refused_as_a_duplicate_also_when_the_engine_is_full(
    admission: str, max_waiting: int
) -> None:
    """check_new: a request id already live is the caller's error whatever the load: refused
    as a duplicate (RequestError), not as a full engine (EngineFullError, which tells the
    caller to retry later), when no slot is free and nothing may wait."""
    s = Scheduler(1, admission, max_waiting, None, 8, CHUNK, None, BLOCK)
    s.queue(request("a"))
    s.admit()
    with pytest.raises(EngineFullError):
        s.check_new("b")
    with pytest.raises(RequestError, match="duplicate request id 'a'") as refused:
        s.check_new("a")
    assert not isinstance(refused.value, EngineFullError)


# ----------------------------------------------------------------------------- token choice
def row_of(values: dict[int, float], low: float = -20.0) -> torch.Tensor:
    """[1, VOCAB] logits: `values` at their ids, every other id at `low`."""
    logits = torch.full((1, VOCAB), low, dtype=F64)
    for token, value in values.items():
        logits[0, token] = value
    return logits


def test_the_repetition_penalty_comes_before_the_presence_penalty_and_the_bias() -> None:
    """choose_tokens on one greedy row: a seen token's positive logit is divided by the
    repetition penalty first, then the presence penalty is subtracted and the bias added
    (transformers' and vLLM's order, gates/test_penalties.py). Token 0 (4.0, generated once):
    4 / 2 - 1 = 1.0 loses to token 1's 1.2; taken the other way round, (4 - 1) / 2 = 1.5 would
    win. The reported logprobs are those of the same penalised row."""
    seq = request("r", repetition_penalty=2.0, presence_penalty=1.0, logprobs=1)
    seq.prompt_ids, seq.output_ids = [5], [0]
    tokens, logprobs = choose_tokens(row_of({0: 4.0, 1: 1.2}), [seq])
    assert tokens == [[1]]
    want = torch.log_softmax(row_of({0: 1.0, 1: 1.2, 5: -40.0})[0], dim=-1)  # 5: the prompt's
    assert logprobs[0][0] == pytest.approx({1: float(want[1])}, rel=1e-12)

    biased = request("b", repetition_penalty=2.0, presence_penalty=1.0, logit_bias=((0, 0.3),))
    biased.prompt_ids, biased.output_ids = [5], [0]
    # 4 / 2 - 1 + 0.3 = 1.3 beats 1.2; the bias is added after both penalties
    assert choose_tokens(row_of({0: 4.0, 1: 1.2}), [biased])[0] == [[0]]


def test_logprobs_are_those_of_the_penalised_distribution_the_token_came_from() -> None:
    """A greedy row with a logit bias that makes token 7 the choice: its logprobs are the log
    softmax of the biased row, so the chosen token is the most likely alternative listed, with
    a logprob near 0, and the others follow from the same row."""
    logits = row_of({3: 5.0, 4: 4.0, 7: 1.0}, low=0.0)
    seq = request("r", logit_bias=((7, 10.0),), logprobs=2)
    tokens, logprobs = choose_tokens(logits, [seq])
    assert tokens == [[7]]
    (entry,) = logprobs[0]
    biased = logits[0].clone()
    biased[7] += 10.0
    want = torch.log_softmax(biased, dim=-1)
    assert set(entry) == {7, 3}
    assert entry == pytest.approx({7: float(want[7]), 3: float(want[3])}, rel=1e-12)
    assert max(entry, key=entry.get) == 7 and entry[7] > -0.05


def test_a_sampled_rows_logprobs_come_before_temperature_and_top_k() -> None:
    """docs/engine.md: logprobs are the log-softmax of the penalised and biased logits, before
    temperature, top_k and top_p. A sampled row at temperature 0.5 and top_k 2 lists the same
    values a greedy row of the same logits and bias would, an alternative top_k cuts off
    included (finite), and they are not the tempered distribution's."""
    logits = row_of({3: 2.0, 4: 1.5, 7: 1.0}, low=0.0)
    biased = logits[0].clone()
    biased[7] += 0.75
    want = torch.log_softmax(biased, dim=-1)
    seq = request("s", temperature=0.5, top_k=2, seed=1, logit_bias=((7, 0.75),), logprobs=3)
    seq.generator = torch.Generator().manual_seed(1)
    tokens, logprobs = choose_tokens(logits, [seq])
    (entry,) = logprobs[0]
    assert tokens[0][0] in (3, 7)  # top_k 2 of the biased row: 3 (2.0) and 7 (1.75)
    assert set(entry) == {3, 7, 4}
    assert entry == pytest.approx({t: float(want[t]) for t in (3, 7, 4)}, rel=1e-12)
    tempered = torch.log_softmax(biased / 0.5, dim=-1)
    assert entry[3] != pytest.approx(float(tempered[3]), rel=1e-3)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_a_logit_bias_steers_every_token_of_a_request_alone_from_the_first_on(
    target: CausalLM, draft: DFlashDraft, speculative: bool
) -> None:
    """A greedy request alone in its engine with a bias of +100 on one token (and nothing
    else that needs the logits on the host): every output token is that token, the first
    one (from the prefill) included; a speculative engine serves it by plain decode under the
    reason `penalties`."""
    plain = generate_plain(target, PROMPT, SamplingParams(max_tokens=6, ignore_eos=True)).output_ids
    steered = next(t for t in range(VOCAB) if t not in plain)
    engine = Engine(target, draft if speculative else None, EngineConfig(max_num_seqs=2, block_size=BLOCK))
    params = SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=((steered, 100.0),))
    engine.add_request("r", PROMPT, params)
    drain(engine)
    seq = engine.collect("r")
    assert seq.output_ids == [steered] * 6
    if speculative:
        assert seq.fallback_reason == "penalties" and engine.stats()["fallbacks"] == {"penalties": 1}


# ----------------------------------------------------------------------------- request checks
def test_a_logit_bias_takes_both_ends_of_its_range_and_the_vocabularys_last_id() -> None:
    """Biases in [-100, 100], both ends included (OpenAI's range, docs/engine.md), on token ids
    in [0, vocab): the last id of the vocabulary is taken, the vocabulary's size is refused."""
    ends = SamplingParams(logit_bias=((1, 100.0), (2, -100.0)))
    validate_request([1, 2], ends, VOCAB, 64, False)
    for bias in (100.001, -100.001):
        with pytest.raises(RequestError, match=r"biases in \[-100, 100\]"):
            SamplingParams(logit_bias=((1, bias),))
    validate_request([1, 2], SamplingParams(logit_bias=((VOCAB - 1, 1.0),)), VOCAB, 64, False)
    with pytest.raises(RequestError, match=rf"logit_bias token id\(s\) \[{VOCAB}\] outside the vocabulary"):
        validate_request([1, 2], SamplingParams(logit_bias=((VOCAB, 1.0),)), VOCAB, 64, False)


def test_a_logit_bias_naming_a_token_twice_is_refused() -> None:
    """The server refuses a logit bias that names a token twice (serving/protocol.py); the
    engine's own parameters refuse it too, naming the token, where one of the two biases was
    silently dropped. Distinct tokens each get their own bias."""
    with pytest.raises(RequestError, match=r"logit_bias names token\(s\) \[1\] more than once"):
        SamplingParams(logit_bias=((1, 1.0), (2, 0.5), (1, 2.0)))
    out = apply_penalties(torch.zeros(4, dtype=F64), [], SamplingParams(logit_bias=((1, 1.0), (3, -2.0))))
    assert out.tolist() == [0.0, 1.0, 0.0, -2.0]


# ----------------------------------------------------------------------------- the verify width
def test_every_step_of_a_turn_records_the_draft_tokens_its_width_verified(
    target: CausalLM, draft: DFlashDraft
) -> None:
    """Turns of three steps at a verify width of 3 (costs under which W = 3 always wins over
    the full block of 7 and the plain step): every step of a turn, its first and its later
    ones, records at most 3 proposed tokens, and as many drafted tokens as it proposed; the
    engine's totals add them up. Output stays plain greedy's."""
    costs = StepCosts({(1, 0): 1e6, (1, 1): 1.0, (1, 3): 1.0, (1, 7): 1e6}, measured=True)
    config = EngineConfig(max_num_seqs=2, block_size=BLOCK, steps_per_turn=3)
    engine = Engine(target, draft, config, step_costs=costs)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for rid, prompt in (("a", PROMPT), ("b", OTHER_PROMPT)):
        engine.add_request(rid, prompt, params)
    drain(engine)
    assert set(engine.verify_widths) == {3} and sum(engine.verify_widths.values()) > 6
    proposed = 0
    for rid, prompt in (("a", PROMPT), ("b", OTHER_PROMPT)):
        seq = engine.collect(rid)
        assert seq.output_ids == generate_plain(target, prompt, params).output_ids
        assert len(seq.steps) >= 4
        for step in seq.steps:
            assert 0 <= step.accepted <= step.proposed <= 3, seq.steps
            assert len(step.drafted) == step.proposed, seq.steps
        proposed += sum(step.proposed for step in seq.steps)
    assert engine.stats()["spec"]["proposed"] == proposed


def width_costs(by_width: dict[int, float], rows: tuple[int, ...] = (1, 16, 64)) -> StepCosts:
    return StepCosts({(r, w): s * r for r in rows for w, s in by_width.items()}, measured=True)


def step_counts(accepted: int, steps: int = 40) -> SpecCounters:
    out = SpecCounters()
    for _ in range(steps):
        out.record(15, accepted, accepted + 1)
    return out


def test_reset_forgets_a_run_of_narrow_steps_as_it_forgets_a_plain_run() -> None:
    """VerifyWidth.reset gives a fresh chooser's state: rows whose steps at W = 3 are broken
    by a probe at 7 every PROBE_AFTER steps wait the whole PROBE_AFTER steps again after a
    reset, however far the run before it had gone."""
    table = width_costs({0: 10.0, 1: 2.0, 3: 2.2, 7: 2.3, 15: 6.0})
    seen = step_counts(3)

    def picks(chooser: VerifyWidth, n: int) -> list[int]:
        return [chooser.choose([15] * 16, [seen] * 16, seen) for _ in range(n)]

    fresh = picks(VerifyWidth("auto", 16, table), PROBE_AFTER + 1)
    assert fresh == [3] * PROBE_AFTER + [7]
    chooser = VerifyWidth("auto", 16, table)
    assert picks(chooser, PROBE_AFTER) == [3] * PROBE_AFTER
    chooser.reset()
    assert picks(chooser, PROBE_AFTER + 1) == fresh


class TimedSteps:
    """Stands in for a SpeculativeStep while `seconds` times it: each call checks where its
    placeholder rows start, moves them on as a step would and advances a clock by
    `duration(rows, width, round)`."""

    def __init__(self, duration: Callable[[int, int, int], float], slots: int) -> None:
        self.block_size = 4
        self.target = SimpleNamespace(config=SimpleNamespace(vocab_size=64))
        self.state = SimpleNamespace(lengths=[9] * slots)
        self.draft_state = SimpleNamespace(lengths=[9] * slots)
        self.deferred: dict = {}
        self.timer = SimpleNamespace(reset=lambda: None)
        self.duration, self.now, self.calls = duration, 0.0, []

    def __call__(self, seqs: list[Sequence], width: int) -> list:
        rows = len(seqs)
        assert [s.slot for s in seqs] == list(range(rows))
        assert all(self.state.lengths[i] == self.draft_state.lengths[i] == 0 for i in range(rows))
        done = self.calls.count((rows, width))
        self.calls.append((rows, width))
        self.now += self.duration(rows, width, done)
        for i in range(rows):
            self.state.lengths[i] = self.draft_state.lengths[i] = 5
        return []


def test_step_costs_are_the_median_of_the_timed_steps_after_an_untimed_one(monkeypatch) -> None:
    """SpeculativeStep.seconds: for rows 1, 2, 4, ... up to max_rows, the widths in turn round by
    round, one untimed round and then `repeats` timed ones; each cost the median of its timed
    steps. Every step starts its rows at position 0, and the slots are left empty after."""

    def duration(rows: int, width: int, done: int) -> float:
        return 1000.0 if done == 0 else [1.0, 2.0, 9.0][done - 1] * rows * (1 + width)

    fake = TimedSteps(duration, slots=3)
    monkeypatch.setattr(speculative_step, "time", SimpleNamespace(perf_counter=lambda: fake.now))
    out = SpeculativeStep.seconds(fake, (0, 3), 3, repeats=3)
    assert out == {(rows, w): 2.0 * rows * (1 + w) for rows in (1, 2, 3) for w in (0, 3)}
    assert fake.calls == [(rows, w) for rows in (1, 2, 3) for _ in range(4) for w in (0, 3)]
    assert fake.state.lengths == fake.draft_state.lengths == [0, 0, 0]


# ----------------------------------------------------------------------------- statistics
def test_recent_counts_are_unchanged_by_the_rescale_of_their_scale() -> None:
    """RecentAcceptance divides its counts and scale back to 1 past RESCALE: right after that
    (the steps before it still weighing much), its decayed counts are still sum over steps of
    DECAY^age x the step's counts."""
    rng = random.Random(3)
    recent, steps, rescaled = RecentAcceptance(), [], None
    while rescaled is None or len(steps) < rescaled + 2:  # two steps past the rescale
        proposed = rng.choice([3, 7])
        steps.append((proposed, rng.randrange(0, proposed + 1)))
        recent.record(*steps[-1])
        if rescaled is None and recent.scale == 1.0:
            rescaled = len(steps)
    assert rescaled > 100 and recent.scale < 3.0
    want_accepted, want_verified = decayed_counts(steps)
    accepted_at, verified_at = recent.counts()
    assert accepted_at == pytest.approx(want_accepted, rel=1e-9)
    assert verified_at == pytest.approx(want_verified, rel=1e-9)


def test_reset_stats_starts_the_phase_counts_afresh(target: CausalLM) -> None:
    """After reset_stats the phase timer's call counts (what the benchmark divides phase times
    by) are those of the steps run since: the same as a fresh engine's that ran only them."""

    def run(engine: Engine, rid: str) -> None:
        engine.add_request(rid, PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
        drain(engine)
        engine.collect(rid)

    used = Engine(target, None, EngineConfig(max_num_seqs=2))
    run(used, "before")
    used.reset_stats()
    assert not +used.timer.calls and used.stats()["phases"] == {}
    run(used, "after")
    fresh = Engine(target, None, EngineConfig(max_num_seqs=2))
    run(fresh, "after")
    assert +used.timer.calls == +fresh.timer.calls and used.timer.calls["decode"] == 4
    assert used.stats()["steps"] == fresh.stats()["steps"]
