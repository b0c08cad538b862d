"""The engine's rules at their edges (runtime/engine.py, scheduler.py, outputs.py, token_choice.py,
penalties.py, stats.py, verify_width.py, sequence.py), on the tiny float64 Qwen3 target with a
tiny block-8 DFlash draft:

- the waiting queue: with `max_waiting` N, exactly N requests beyond the free slots are taken
  and the next one is refused (EngineFullError), leaving no trace of itself.
- `reset_stats`: refused while a request waits or runs, and then nothing changes; after it
  every total, histogram, per-position counter, fallback count, step count, verify-width count
  and the verify width's run of plain steps start afresh, and each reset starts a new epoch.
- numerical failure: a row whose logits hold a NaN at one position ends its request with
  finish_reason "error" after the tokens plain decode gives before that position (also inside
  a verify block); a NaN past a request's last token ends nothing; a row of infinite logits
  fails its request too; the neighbours in the batch commit exactly what they commit alone.
- logprobs with penalties and a logit bias: the log-softmax of the penalised, biased logits,
  the same on a plain engine and on a DFlash engine (which serves the request by plain decode);
  a sampled token's own logprob is listed, and none is NaN.
- statistics: a request's `spec` counters are its step records' at any point of its life, each
  record's acceptance length the tokens its step committed; the engine's totals add up its
  requests' records by the documented definitions, and `verify_widths` counts every step at
  each width; the low-acceptance fallback takes a mean strictly below its threshold.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.errors import RequestError
from reference_engine.models import CausalLM
from reference_engine.models.dflash import DFlashDraft
from reference_engine.runtime.decode import generate_plain, new_state
from reference_engine.runtime.engine import Engine, EngineConfig, EngineFullError
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.sequence import Sequence
from reference_engine.runtime.stats import SpecCounters
from reference_engine.runtime.verify_width import StepCosts

from .test_engine import drain, greedy, reference

TinyCheckpoint = Callable[..., Path]
TinyPair = Callable[..., tuple[Path, Path]]
F64 = torch.float64
BLOCK = 8
VOCAB = 512
PROMPTS = [
    [17, 301, 5, 88, 260, 42, 7, 199, 33, 410, 2, 95, 61],
    [400, 3, 77, 120, 9],
    [250, 251, 13, 480, 66, 1, 305, 222],
    [8, 9, 10],
]


@pytest.fixture(scope="module")
def target(tiny_checkpoint: TinyCheckpoint) -> CausalLM:
    return load_target(tiny_checkpoint("qwen3"), dtype=F64)


@pytest.fixture(scope="module")
def draft(tiny_pair: TinyPair, target: CausalLM) -> DFlashDraft:
    _, draft_dir = tiny_pair("qwen3", block_size=BLOCK)
    return load_draft(draft_dir, target)


def counters_of(*seqs: Sequence) -> SpecCounters:
    """The counters the step records of `seqs` add up to, counted afresh."""
    out = SpecCounters()
    for seq in seqs:
        for step in seq.steps:
            out.record(step.proposed, step.accepted, step.acceptance_length)
    return out


# ----------------------------------------------------------------------------- the waiting queue
@pytest.mark.parametrize("max_waiting", [0, 1, 3])
def test_the_engine_takes_exactly_max_waiting_requests_beyond_its_free_slots(
    target: CausalLM, max_waiting: int
) -> None:
    """Two slots and `max_waiting` N: before any step 2 + N requests are taken (the free slots
    go to the first two at the next step) and the next is refused as a full engine; after the
    step (both slots busy) the N still waiting fill the queue and a newcomer is refused again.
    A refused request leaves no trace: its id is unknown, and taken once there is room."""
    engine = Engine(target, None, EngineConfig(max_num_seqs=2, max_waiting=max_waiting))
    taken = [f"r{i}" for i in range(2 + max_waiting)]
    for rid in taken:
        engine.add_request(rid, PROMPTS[1], greedy(6))
    assert engine.stats()["waiting"] == 2 + max_waiting
    with pytest.raises(EngineFullError, match=rf"waiting queue full \({max_waiting} requests\)"):
        engine.add_request("late", PROMPTS[1], greedy(6))
    with pytest.raises(RequestError, match="unknown request id 'late'"):
        engine.get("late")
    engine.step()
    assert (engine.stats()["running"], engine.stats()["waiting"]) == (2, max_waiting)
    with pytest.raises(EngineFullError, match="waiting queue full"):
        engine.add_request("late", PROMPTS[1], greedy(6))
    drain(engine)
    engine.add_request("late", PROMPTS[0], greedy(6))
    drain(engine)
    assert engine.stats()["requests_finished"] == len(taken) + 1  # collected or not
    want = reference(target, PROMPTS[1], greedy(6))
    assert all(engine.collect(rid).output_ids == want for rid in taken)
    assert engine.collect("late").output_ids == reference(target, PROMPTS[0], greedy(6))
    assert engine.stats()["requests_finished"] == len(taken) + 1 and engine.stats()["waiting"] == 0


# ----------------------------------------------------------------------------- reset_stats
def spec_workload(engine: Engine, target: CausalLM, tag: str) -> None:
    """A speculative request whose steps accept 7, 2, 0, 4 draft tokens in turn (its last
    block cut at max_tokens), beside one that falls back for its logprobs."""
    truth = reference(target, PROMPTS[0], greedy(30 + BLOCK))
    oracle = OracleProposer(truth, [7, 2, 0, 4], VOCAB)
    engine.add_request(f"a{tag}", PROMPTS[0], greedy(30), oracle=oracle)
    engine.add_request(f"b{tag}", PROMPTS[1], greedy(5, logprobs=1))
    drain(engine)
    assert engine.collect(f"a{tag}").output_ids == truth[:30]
    engine.collect(f"b{tag}")


def test_a_refused_reset_changes_nothing_whether_the_request_waits_or_runs(
    target: CausalLM, draft: DFlashDraft
) -> None:
    """reset_stats on an engine with a request still waiting for its slot, and again with it
    running, is refused (RequestError) and leaves every statistic, the epoch included, as it
    was; once the engine is idle the reset starts every total from zero."""
    engine = Engine(target, draft, EngineConfig(max_num_seqs=2, block_size=BLOCK))
    spec_workload(engine, target, "1")
    assert engine.stats()["spec"]["steps"] > 0 and engine.stats()["fallbacks"] == {"logprobs": 1}
    engine.add_request("c", PROMPTS[2], greedy(20))
    for _ in range(2):  # waiting, then running
        before = engine.stats()
        with pytest.raises(RequestError, match="idle engine"):
            engine.reset_stats()
        assert engine.stats_epoch == 0
        now = engine.stats()
        for key in ("spec", "fallbacks", "requests_finished", "verify_widths", "steps", "draft_ahead"):
            assert now[key] == before[key], key
        assert now["phases"].keys() == before["phases"].keys()
        engine.step()
    assert engine.stats()["spec"]["steps"] > before["spec"]["steps"]  # c ran speculative steps
    drain(engine)
    engine.collect("c")
    engine.reset_stats()
    after = engine.stats()
    assert engine.stats_epoch == 1
    assert after["spec"] == SpecCounters().as_dict()
    assert (after["requests_finished"], after["fallbacks"], after["verify_widths"]) == (0, {}, {})
    assert (after["steps"], after["phases"]) == (0, {})
    assert after["draft_ahead"] == {"queued": 0, "used": 0, "widened": 0}
    engine.reset_stats()
    assert engine.stats_epoch == 2


def test_after_a_reset_the_same_workload_counts_what_a_fresh_engine_counts(
    target: CausalLM, draft: DFlashDraft
) -> None:
    """The statistics after reset_stats and one workload are a fresh engine's after the same
    workload: the acceptance histogram and per-position counts, the fallbacks, the steps and
    the steps per verify width (phase times aside)."""

    def run(engine: Engine, tag: str) -> dict:
        spec_workload(engine, target, tag)
        stats = engine.stats()
        stats.pop("phases")
        return stats

    fresh = run(Engine(target, draft, EngineConfig(max_num_seqs=2, block_size=BLOCK)), "1")
    assert fresh["spec"]["acceptance_length_histogram"][BLOCK] >= 1
    assert fresh["spec"]["accepted_per_position"][1] >= 2
    used = Engine(target, draft, EngineConfig(max_num_seqs=2, block_size=BLOCK))
    for tag in "123":
        run(used, tag)
    used.reset_stats()
    assert run(used, "4") == fresh


# for one row plain steps pay at every acceptance, each drafted width by a little: a run of
# plain steps is broken by a probe at W = 7 once it is PROBE_AFTER steps long
PLAIN_PAYS = StepCosts({(1, 0): 1.0, (1, 1): 2.05, (1, 3): 4.05, (1, 7): 8.05}, measured=True)


# plain steps win by far at every row count: no probe comes within a short request
PLAIN_ALWAYS = StepCosts(
    {(rows, w): s * rows for rows in (1, 2, 3) for w, s in ((0, 1.0), (1, 100.0), (3, 200.0), (7, 400.0))},
    measured=True,
)


def test_reset_stats_starts_the_verify_widths_run_of_plain_steps_afresh(
    target: CausalLM, draft: DFlashDraft
) -> None:
    """Under costs where plain steps pay, a request whose drafts are all accepted runs plain
    steps broken by probes. A short request leaves a run of two plain steps behind; after
    reset_stats the next request runs the widths a fresh engine runs for it, step by step (its
    first probe after four plain steps, not two), as if no run had gone before."""
    config = EngineConfig(max_num_seqs=1, block_size=BLOCK)
    truth = reference(target, PROMPTS[0], greedy(22 + BLOCK))

    def run(engine: Engine, rid: str, max_tokens: int) -> list[dict[int, int]]:
        """The widths of each step (what it added to the verify-width counts)."""
        engine.add_request(rid, PROMPTS[0], greedy(max_tokens), oracle=OracleProposer(truth, [7], VOCAB))
        widths = []
        while engine.has_unfinished():
            before = engine.stats()["verify_widths"]
            engine.step()
            after = engine.stats()["verify_widths"]
            widths.append({w: n - before.get(w, 0) for w, n in after.items() if n != before.get(w, 0)})
        assert engine.collect(rid).output_ids == truth[:max_tokens]
        return widths

    fresh = run(Engine(target, draft, config, step_costs=PLAIN_PAYS), "r", 22)
    assert fresh[:5] == [{0: 1}] * 4 + [{BLOCK - 1: 1}]  # the probe after PROBE_AFTER plain steps
    engine = Engine(target, draft, config, step_costs=PLAIN_PAYS)
    assert run(engine, "a", 3) == [{0: 1}] * 2
    engine.reset_stats()
    assert run(engine, "b", 22) == fresh


# ----------------------------------------------------------------------------- numerical failure
def one_nan(row: torch.Tensor) -> None:
    row[7] = float("nan")


def plus_inf(row: torch.Tensor) -> None:
    row[7] = float("inf")


def all_minus_inf(row: torch.Tensor) -> None:
    row.fill_(float("-inf"))


@contextmanager
def nan_at(
    monkeypatch: pytest.MonkeyPatch,
    engine: Engine,
    rid: str,
    position: int,
    spoil: Callable[[torch.Tensor], None] = one_nan,
) -> Iterator[None]:
    """Every target forward spoils request `rid`'s logits at `position` (the logits that choose
    its token at position + 1; by default a NaN in one vocabulary entry), in whatever batch and
    whichever forward (prefill, decode, verify) computes them."""
    forward = CausalLM.forward

    def corrupted(self, input_ids, positions, slots, state, *args, **kwargs):
        out = forward(self, input_ids, positions, slots, state, *args, **kwargs)
        try:
            slot = engine.get(rid).slot
        except RequestError:
            return out
        valid = kwargs.get("valid_len")
        for row, s in enumerate(slots.tolist()):
            if s != slot:
                continue
            if out.logits.shape[1] == positions.shape[1]:
                at = positions[row].tolist()
            else:  # the last real token's logits alone
                last = int(valid[row]) - 1 if valid is not None else -1
                at = [int(positions[row, last])]
            for t, p in enumerate(at):
                if p == position:
                    spoil(out.logits[row, t])
        return out

    monkeypatch.setattr(CausalLM, "forward", corrupted)
    try:
        yield
    finally:
        monkeypatch.setattr(CausalLM, "forward", forward)


@pytest.mark.parametrize(
    "mode", ["plain", "dflash", "dflash-turns", "dflash-drafted-turns", "dflash-plain-steps"]
)
@pytest.mark.parametrize("good", [0, 4, 9])
@pytest.mark.parametrize(
    "spoil", [one_nan, plus_inf, all_minus_inf], ids=["nan", "inf-entry", "all-minus-inf"]
)
def test_a_nan_in_a_rows_logits_commits_the_tokens_before_it_and_fails_that_request_alone(
    target: CausalLM,
    draft: DFlashDraft,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    good: int,
    spoil: Callable,
) -> None:
    """Request `bad`'s logits that choose its output token `good` are not a distribution (a NaN
    in one entry of the row, a +inf in one, or -inf throughout). Its output is the `good`
    tokens plain decode gives before it (on a DFlash engine that accepts every draft token
    they sit inside a verify block: the first at 0, the fifth mid-block, the tenth in a second
    block; also in turns of three steps; in turns of three steps drafted by the real draft,
    where a later step of the turn starts from the failed row's bonus, not a token; and in
    plain steps of verify width 0), then finish_reason "error" with a numerical-failure reason, once, in the
    step outputs; the requests beside it in every batch produce what they produce alone."""
    speculative = mode != "plain"
    turn = 3 if mode.endswith("turns") else 1
    config = EngineConfig(max_num_seqs=3, block_size=BLOCK if speculative else None, steps_per_turn=turn)
    costs = PLAIN_ALWAYS if mode == "dflash-plain-steps" else None
    engine = Engine(target, draft if speculative else None, config, step_costs=costs)
    bad_prompt = PROMPTS[2]
    truth = reference(target, bad_prompt, greedy(16 + BLOCK))
    drafted = mode in ("dflash", "dflash-turns", "dflash-plain-steps")
    oracle = OracleProposer(truth, [BLOCK - 1], VOCAB) if drafted else None
    engine.add_request("bad", bad_prompt, greedy(16), oracle=oracle)
    for i in (0, 1):
        engine.add_request(f"n{i}", PROMPTS[i], greedy(16))
    with nan_at(monkeypatch, engine, "bad", len(bad_prompt) - 1 + good, spoil):
        outputs = drain(engine)
    bad = engine.collect("bad")
    assert bad.output_ids == truth[:good]
    assert bad.finish_reason == "error" and "numerical failure" in bad.error and "not finite" in bad.error
    failed = [o for o in outputs if o.request_id == "bad" and o.finish_reason == "error"]
    assert len(failed) == 1 and failed[0].new_token_ids == [] and failed[0].error == bad.error
    emitted = [t for o in outputs if o.request_id == "bad" for t in o.new_token_ids]
    assert emitted == truth[:good]
    for i in (0, 1):
        last = [o for o in outputs if o.request_id == f"n{i}"][-1]
        assert (last.finished, last.finish_reason, last.error) == (True, "length", None)
        seq = engine.collect(f"n{i}")
        assert (seq.output_ids, seq.finish_reason, seq.error) == (
            reference(target, PROMPTS[i], greedy(16)),
            "length",
            None,
        )
    assert engine.scheduler.free_slots == [0, 1, 2]
    if mode == "dflash-plain-steps":
        assert set(engine.stats()["verify_widths"]) == {0} and engine.stats()["spec"]["steps"] == 0


def test_a_nan_past_a_requests_last_token_in_its_verify_block_ends_nothing(
    target: CausalLM, draft: DFlashDraft, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verify block that runs past max_tokens computes logits plain decode never does: a NaN
    there (after the request's last token) ends the request by its length, not in error, with
    the same output, step records and totals as without the NaN."""
    prompt, max_tokens = PROMPTS[2], 5  # the prefill's token, then one block reaching past 5

    def run(poisoned: bool) -> tuple[Sequence, dict]:
        engine = Engine(target, draft, EngineConfig(max_num_seqs=1, block_size=BLOCK))
        truth = reference(target, prompt, greedy(max_tokens + BLOCK))
        engine.add_request("r", prompt, greedy(max_tokens), oracle=OracleProposer(truth, [BLOCK - 1], VOCAB))
        if poisoned:
            # the logits after its last token: the bonus slot of its one verify block
            with nan_at(monkeypatch, engine, "r", len(prompt) - 1 + max_tokens):
                drain(engine)
        else:
            drain(engine)
        return engine.collect("r"), engine.stats()["spec"]

    clean, clean_totals = run(False)
    seq, totals = run(True)
    assert seq.finish_reason == "length" and seq.error is None
    assert seq.output_ids == clean.output_ids == reference(target, prompt, greedy(max_tokens))
    assert seq.steps == clean.steps and len(seq.steps) == 1
    assert seq.steps[0].acceptance_length == max_tokens - 1
    assert totals == clean_totals and seq.spec.as_dict() == totals


@pytest.mark.parametrize(
    "temperature",
    [pytest.param(0.8, id="sampled"), pytest.param(0.0, id="greedy")],
)
@pytest.mark.parametrize("spoil", [plus_inf, all_minus_inf], ids=["inf-entry", "all-minus-inf"])
def test_a_row_with_infinite_logits_fails_its_request_however_it_samples(
    target: CausalLM, monkeypatch: pytest.MonkeyPatch, spoil: Callable, temperature: float
) -> None:
    """A row whose next-token distribution is not finite (an entry of +inf, or every entry
    -inf: no softmax of it is a distribution) ends its request with finish_reason "error"
    (docs/engine.md: "NaN or inf"), after the tokens before it; the request beside it is
    untouched."""
    prompt, good = PROMPTS[2], 3
    engine = Engine(target, None, EngineConfig(max_num_seqs=2))
    params = greedy(8, temperature=temperature, seed=1)
    truth = generate_plain(target, prompt, params, generator=torch.Generator().manual_seed(1)).output_ids
    engine.add_request("bad", prompt, params)
    engine.add_request("n", PROMPTS[1], greedy(8))
    with nan_at(monkeypatch, engine, "bad", len(prompt) - 1 + good, spoil):
        drain(engine)
    bad = engine.collect("bad")
    assert bad.finish_reason == "error" and "not finite" in bad.error
    assert bad.output_ids == truth[:good]
    assert engine.collect("n").output_ids == reference(target, PROMPTS[1], greedy(8))


def test_logprobs_are_never_nan_a_greedy_row_with_an_infinite_logit_fails_instead(
    target: CausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A greedy request asking for logprobs whose row holds a +inf logit: the log-softmax of
    that row is NaN everywhere, which no reply can carry (JSON has no NaN). The request fails
    as a numerical failure, as a sampled one does; every logprob it did return is a number."""
    prompt, good = PROMPTS[2], 3
    engine = Engine(target, None, EngineConfig(max_num_seqs=1))
    engine.add_request("r", prompt, greedy(8, logprobs=2))
    with nan_at(monkeypatch, engine, "r", len(prompt) - 1 + good, plus_inf):
        drain(engine)
    seq = engine.collect("r")
    assert all(not math.isnan(v) for entry in seq.logprobs for v in entry.values()), seq.logprobs
    assert seq.finish_reason == "error" and seq.output_ids == reference(target, prompt, greedy(good))


# ----------------------------------------------------------------------------- logprobs
# small enough that the output still repeats tokens (a token's later logprobs then tell a
# presence penalty from a frequency penalty)
PENALTIES = {
    "mixed": {"presence_penalty": 0.05, "frequency_penalty": 0.03, "logit_bias": ((5, 0.5), (88, -1.5))},
    "presence": {"presence_penalty": 0.02},
    "frequency": {"frequency_penalty": 0.02},
}


@pytest.mark.parametrize("penalties", list(PENALTIES))
def test_logprobs_with_penalties_are_the_penalised_distributions_on_plain_and_dflash_engines(
    target: CausalLM, draft: DFlashDraft, penalties: str
) -> None:
    """A greedy request asking for logprobs with presence and/or frequency penalties and a
    logit bias: the DFlash engine serves it by plain decode, so both engines give the same
    tokens and the same logprobs. Each token's entry is the log-softmax of the target's logits
    after the penalties of the output tokens before it and the bias (docs/engine.md): the
    chosen token, its argmax, and the three most likely. The outputs repeat tokens, so the
    presence and the frequency penalties differ."""
    options = PENALTIES[penalties]
    params = greedy(16, logprobs=3, **options)
    runs = {}
    for name, d in (("plain", None), ("dflash", draft)):
        engine = Engine(target, d, EngineConfig(max_num_seqs=2, block_size=BLOCK if d else None))
        engine.add_request("r", PROMPTS[0], params)
        engine.add_request("n", PROMPTS[1], greedy(8))
        drain(engine)
        runs[name] = engine.collect("r")
        assert engine.collect("n").output_ids == reference(target, PROMPTS[1], greedy(8))
    plain, dflash = runs["plain"], runs["dflash"]
    assert dflash.fallback_reason == "logprobs" and plain.fallback_reason is None
    assert dflash.output_ids == plain.output_ids and len(plain.logprobs) == 16
    assert max(Counter(plain.output_ids).values()) >= 2
    assert [list(e) for e in dflash.logprobs] == [list(e) for e in plain.logprobs]
    for got, want in zip(dflash.logprobs, plain.logprobs):  # batched with others, or alone
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
    logits = continuation_logits(target, PROMPTS[0], plain.output_ids)
    presence, frequency = options.get("presence_penalty", 0.0), options.get("frequency_penalty", 0.0)
    for i, (token, entry) in enumerate(zip(plain.output_ids, plain.logprobs)):
        # OpenAI's rule, spelled out: each earlier output token costs its frequency penalty per
        # occurrence and the presence penalty once; the bias is added
        row = logits[i].clone()
        for t, count in Counter(plain.output_ids[:i]).items():
            row[t] -= frequency * count + presence
        for t, bias in options.get("logit_bias", ()):
            row[t] += bias
        want = torch.log_softmax(row.double(), dim=-1)
        assert token == int(row.argmax())
        top = set(want.topk(3).indices.tolist())
        assert set(entry) == top | {token}, i
        for t, value in entry.items():
            assert math.isclose(value, float(want[t]), rel_tol=1e-9, abs_tol=1e-9), (i, t)


def continuation_logits(target: CausalLM, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: the target's logits that chose each output token, from one
    forward over the prompt and the output."""
    tokens = prompt + output
    with torch.inference_mode():
        logits = target(
            torch.tensor([tokens]),
            torch.arange(len(tokens))[None],
            torch.tensor([0]),
            new_state(target, len(tokens)),
            kv_len=len(tokens),
        ).logits[0]
    return logits[len(prompt) - 1 : len(tokens) - 1]


@pytest.mark.parametrize("top", [0, 1])
def test_a_sampled_tokens_own_logprob_is_listed_beside_the_most_likely_ones(
    target: CausalLM, top: int
) -> None:
    """A request sampling at a high temperature with logprobs `top`: every entry lists the
    sampled token and the `top` most likely ones (logprobs=0: the sampled token alone, still
    an entry per token), each with the log-softmax of the untempered logits; some draws are
    not the argmax, so with logprobs=1 some entries list two tokens."""
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=3.0, seed=7, logprobs=top)
    engine = Engine(target, None, EngineConfig(max_num_seqs=1))
    engine.add_request("r", PROMPTS[0], params)
    drain(engine)
    seq = engine.collect("r")
    logits = continuation_logits(target, PROMPTS[0], seq.output_ids)
    assert len(seq.logprobs) == len(seq.output_ids) == 24
    for token, entry, row in zip(seq.output_ids, seq.logprobs, logits):
        want = torch.log_softmax(row.double(), dim=-1)
        assert set(entry) == {token, *want.topk(top).indices.tolist()}
        assert entry == pytest.approx({t: float(want[t]) for t in entry}, rel=1e-9)
    assert sum(len(entry) == top + 1 for entry in seq.logprobs) >= 3


# ----------------------------------------------------------------------------- statistics
def test_a_requests_counters_are_its_step_records_at_every_step_and_add_up_to_the_totals(
    target: CausalLM, draft: DFlashDraft
) -> None:
    """Two speculative requests side by side, their steps accepting scheduled counts, the
    last blocks cut at max_tokens. Read after every step (a read fills the request's counters
    so far), `seq.spec` is what its step records add up to; each record's acceptance length
    is the tokens its step committed for it; the engine's totals are both requests' records
    added up, and `verify_widths` counts every speculative step at the full width."""
    engine = Engine(target, draft, EngineConfig(max_num_seqs=2, block_size=BLOCK))
    schedules = {"a": (PROMPTS[0], 21, [7, 1, 3]), "b": (PROMPTS[1], 14, [0, 5, 2, 6])}
    for rid, (prompt, n, schedule) in schedules.items():
        truth = reference(target, prompt, greedy(n + BLOCK))
        engine.add_request(rid, prompt, greedy(n), oracle=OracleProposer(truth, schedule, VOCAB))
    committed: dict[str, list[int]] = {rid: [] for rid in schedules}
    steps = 0
    while engine.has_unfinished():
        outputs = engine.step()
        steps += 1
        for out in outputs:
            committed[out.request_id].append(len(out.new_token_ids))
        for rid in schedules:
            seq = engine.get(rid)
            assert seq.spec.as_dict() == counters_of(seq).as_dict(), (rid, steps)
            assert seq.spec.steps == len(seq.steps)
    seqs = {rid: engine.collect(rid) for rid in schedules}
    for rid, (prompt, n, schedule) in schedules.items():
        seq = seqs[rid]
        assert seq.output_ids == reference(target, prompt, greedy(n))
        # its first output is the prefill's token, each later one a speculative step's
        assert [s.acceptance_length for s in seq.steps] == committed[rid][1:]
        want = [min(schedule[i % len(schedule)], BLOCK - 1) for i in range(len(seq.steps))]
        assert [s.accepted for s in seq.steps][:-1] == want[:-1], rid
        # each step proposes a full block or what the request has left, whichever is fewer
        left = [n - 1 - sum(committed[rid][1 : i + 1]) for i in range(len(seq.steps))]
        assert [s.proposed for s in seq.steps] == [min(BLOCK - 1, k) for k in left], rid
        assert all(len(s.drafted) == s.proposed for s in seq.steps), rid
    totals = engine.stats()
    assert totals["spec"] == counters_of(seqs["a"], seqs["b"]).as_dict()
    spec_steps = max(len(s.steps) for s in seqs.values())
    assert totals["verify_widths"] == {BLOCK - 1: spec_steps}
    assert totals["steps"] == steps == spec_steps  # the first step's prefill runs beside its draft
    # the documented definitions (stats.py), counted from the records by hand
    records = [s for seq in seqs.values() for s in seq.steps]
    histogram = Counter(s.acceptance_length for s in records)
    spec = totals["spec"]
    assert spec["acceptance_length_histogram"] == dict(sorted(histogram.items()))
    positions = {k: sum(s.accepted >= k for s in records) for k in range(1, BLOCK)}
    assert spec["accepted_per_position"] == {k: n for k, n in positions.items() if n}
    assert spec["steps"] == len(records) and spec["proposed"] == sum(s.proposed for s in records)
    assert spec["accepted"] == sum(s.accepted for s in records)
    assert spec["mean_acceptance_length"] == pytest.approx(
        sum(s.acceptance_length for s in records) / len(records)
    )
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["proposed"])


def test_a_request_whose_acceptance_is_exactly_the_fallback_threshold_keeps_drafting(
    target: CausalLM, draft: DFlashDraft
) -> None:
    """The low-acceptance fallback takes a mean acceptance length below the threshold: a
    request whose every step accepts one draft token (mean length 2.0, bonus included, its
    last step not cut) keeps drafting under a threshold of 2.0, and one accepting none falls
    back after exactly `fallback_after_steps` steps, counted once."""
    config = EngineConfig(
        max_num_seqs=2, block_size=BLOCK, fallback_min_acceptance=2.0, fallback_after_steps=3
    )
    engine = Engine(target, draft, config)
    for rid, prompt, accepted in (("even", PROMPTS[0], 1), ("low", PROMPTS[1], 0)):
        truth = reference(target, prompt, greedy(17 + BLOCK))
        engine.add_request(rid, prompt, greedy(17), oracle=OracleProposer(truth, [accepted], VOCAB))
    drain(engine)
    even, low = engine.collect("even"), engine.collect("low")
    assert even.fallback_reason is None and even.speculative
    assert even.spec.mean_acceptance_length == 2.0 and even.spec.steps >= 5
    assert low.fallback_reason == "low_acceptance" and len(low.steps) == 3
    assert engine.stats()["fallbacks"] == {"low_acceptance": 1}
    assert even.output_ids == reference(target, PROMPTS[0], greedy(17))
    assert low.output_ids == reference(target, PROMPTS[1], greedy(17))
