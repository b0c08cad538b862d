"""The gates' infrastructure judged on its own: the plain decode with logits and the engine
driver of the exact-numerics gates (gates/exact.py), the checks and drivers of
gates/checks.py, the hooks and the planted faults (gates/hooks.py, gates/faults.py), the
tensor-parallel row-invariance check and its planted reduction order (gates/parallel.py),
the sampling gate's bookkeeping (gates/sampling_checks.py), the options and prompts a user's
pair runs with (gates/options.py, gates/prompts.py) and the pair fixture (gates/conftest.py).

A gate is only as strong as these: a comparison that stops early, a driver that drops an
argument, a fault that changes nothing or an option that is read from the wrong place passes
a broken engine. Each test feeds one piece a case with a known right answer."""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from gates import checks, exact, sampling_checks
from gates.faults import FAULTS, planted
from gates.hooks import hooked
from gates.parallel import RowInvariance, plant_size_dependent_order
from gates.sampling_reference import Cell, Draws, Rate
from reference_engine.checkpoint import load_draft, load_target
from reference_engine.kernels import TORCH
from reference_engine.runtime.decode import generate_plain, new_state, prefill
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.kv_pool import CellAllocator
from reference_engine.runtime.model_runner import ModelRunner
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.sequence import StepRecord
from reference_engine.runtime.speculative_step import SpeculativeStep

from .test_gate_options import Options

PROMPT = [17, 3, 99, 250, 41, 8, 77, 120, 3, 64, 200, 13, 5, 88, 140, 6, 31]


@pytest.fixture(scope="module")
def dense(tiny_pair):
    """The tiny dense pair (block size 4) in float64."""
    target_dir, draft_dir = tiny_pair("qwen3", block_size=4)
    target = load_target(target_dir, dtype=torch.float64)
    return target, load_draft(draft_dir, target)


def _prefill_logits(target, ids: list[int]) -> torch.Tensor:
    state = new_state(target, len(ids) + 1)
    logits, _ = prefill(target, state, 0, ids)
    return logits


# ------------------------------------------------------------------ gates/exact.py
def test_plain_with_logits_row_k_is_the_logits_that_chose_token_k(dense) -> None:
    """Row k holds the logits after the prompt and tokens 0..k-1 (its argmax is token k), the
    tokens are plain greedy's, and a prefill in chunks gives the same rows."""
    target, _ = dense
    tokens, logits = exact.plain_with_logits(target, PROMPT, 6, TORCH)
    assert tokens == generate_plain(target, PROMPT, SamplingParams(max_tokens=6, ignore_eos=True)).output_ids
    assert logits.shape == (6, target.config.vocab_size)
    assert [int(row.argmax()) for row in logits] == tokens
    for k in (0, 3, 5):
        expected = _prefill_logits(target, PROMPT + tokens[:k])
        assert torch.allclose(logits[k], expected, atol=1e-9, rtol=0), k
    chunked, chunked_logits = exact.plain_with_logits(target, PROMPT, 6, TORCH, prefill_chunk=5)
    assert chunked == tokens
    assert torch.allclose(chunked_logits, logits, atol=1e-9, rtol=0)


def test_divergences_report_a_request_once_at_its_first_difference() -> None:
    """A request that differs at every position is one divergence, at position 0."""
    logits = torch.tensor([[3.0, 1.0], [3.0, 1.0], [3.0, 1.0]], dtype=torch.float64)
    found = exact.divergences({"a": [0, 0, 0]}, {"a": logits}, {"a": [1, 1, 1]})
    assert [(d.request, d.position, d.expected, d.got) for d in found] == [("a", 0, 0, 1)]


def test_divergence_margin_keeps_a_small_gap_between_large_logits() -> None:
    """The top-2 margin of a near-tie between large logits is read without rounding it away."""
    logits = torch.tensor([[3.0, 3.0 - 1e-3, 0.0]], dtype=torch.float64)
    (found,) = exact.divergences({"a": [0]}, {"a": logits}, {"a": [1]})
    assert found.margin == pytest.approx(1e-3, rel=1e-4)


def test_describe_counts_every_request_and_marks_only_near_ties() -> None:
    found = [
        exact.Divergence("a", 3, 5, 6, 0.01),
        exact.Divergence("b", 0, 1, 2, 2.5),
    ]
    text = exact.describe(found, 7)
    lines = text.splitlines()
    assert lines[0] == "2 of 7 requests differ from plain greedy:"
    assert "a: first at output 3: plain 5, got 6" in lines[1] and lines[1].endswith("(a near-tie)")
    assert "b: first at output 0: plain 1, got 2" in lines[2] and "near-tie" not in lines[2]


def _exact_setup(dense, tokens: int = 8):
    target, draft = dense
    prompts = {"p0": PROMPT, "p1": PROMPT[:5]}
    refs, logits = {}, {}
    for rid, prompt in prompts.items():
        refs[rid], logits[rid] = exact.plain_with_logits(target, prompt, tokens, TORCH)
    config = EngineConfig(max_num_seqs=2, block_size=4, max_model_len=64)
    return target, draft, prompts, refs, logits, config


def test_exact_run_engine_fails_when_the_verify_logits_differ(dense) -> None:
    """With a check, verify logits that are not plain decode's fail the run; without one the
    outputs are returned (and are plain greedy's)."""
    target, draft, prompts, refs, logits, config = _exact_setup(dense)
    assert exact.run_engine(target, draft, prompts, 8, config) == refs
    shifted = {rid: rows + 1.0 for rid, rows in logits.items()}
    with pytest.raises(AssertionError, match="differ from plain decode's logits"):
        exact.run_engine(target, draft, prompts, 8, config, check=(prompts, refs, shifted))


def test_exact_run_engine_adds_each_request_at_its_arrival_with_its_oracle(dense, monkeypatch) -> None:
    """Request r joins before step arrivals[r] (at once without one), ignores EOS and gets
    its own oracle."""
    target, draft, prompts, refs, _, config = _exact_setup(dense, tokens=6)
    seen = {}
    add = Engine.add_request

    def spy(self, request_id, prompt_ids, params, *args, **kwargs):
        seen[request_id] = (self.steps, params.ignore_eos, params.max_tokens, kwargs.get("oracle"))
        return add(self, request_id, prompt_ids, params, *args, **kwargs)

    monkeypatch.setattr(Engine, "add_request", spy)
    oracle = OracleProposer(refs["p1"], [1, 3], target.config.vocab_size)
    got = exact.run_engine(target, draft, prompts, 6, config, arrivals={"p1": 3}, oracles={"p1": oracle})
    assert got == refs
    assert seen["p0"] == (0, True, 6, None)
    assert seen["p1"] == (3, True, 6, oracle)


def test_verify_with_swaps_the_kernels_of_the_verify_alone(dense) -> None:
    """Inside `verify_with(linear=...)` the verify forwards call the given linear; every
    other forward, and the engine after each verify, keeps the engine's own kernels."""
    target, draft = dense
    calls = {"inside": 0, "outside": 0}
    state = {"in_verify": False}

    def linear(*args, **kwargs):
        calls["inside" if state["in_verify"] else "outside"] += 1
        return TORCH.linear(*args, **kwargs)

    def mark(correct):
        def verify(self, rows, block, record=True):
            state["in_verify"] = True
            try:
                return correct(self, rows, block, record)
            finally:
                state["in_verify"] = False

        return verify

    with exact.verify_with(linear=linear), hooked((SpeculativeStep, "verify", mark)):
        engine = Engine(target, draft, EngineConfig(max_num_seqs=1, block_size=4, max_model_len=64))
        engine.add_request("r", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    assert (
        engine.collect("r").output_ids
        == generate_plain(target, PROMPT, SamplingParams(max_tokens=8, ignore_eos=True)).output_ids
    )
    assert calls["inside"] > 0 and calls["outside"] == 0
    assert engine.speculative_step.runner.ops is TORCH


# ------------------------------------------------------------------ gates/hooks.py
def test_hooks_on_one_attribute_stack_and_the_original_comes_back() -> None:
    owner = SimpleNamespace(f=lambda: 1)
    original = owner.f
    plus = lambda f: lambda: f() + 1  # noqa: E731
    times = lambda f: lambda: f() * 10  # noqa: E731
    with hooked((owner, "f", plus), (owner, "f", times)):
        assert owner.f() == 20  # the second wraps the first
    assert owner.f is original


# ------------------------------------------------------------------ gates/checks.py
def _fake_pair(block_size: int = 8, dtype=torch.float64, numerics=None):
    weight = torch.zeros(1, dtype=dtype)
    target = SimpleNamespace(
        model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=weight)),
        config=SimpleNamespace(vocab_size=32),
    )
    draft = SimpleNamespace(config=SimpleNamespace(block_size=block_size))
    return checks.Pair("fake", target, draft, (), numerics=numerics)


def test_require_block_runs_the_drafts_own_block_size_and_skips_larger() -> None:
    try:
        checks.require_block(_fake_pair(8), 8)
        checks.require_block(_fake_pair(8), 4)
    except pytest.skip.Exception as exc:
        pytest.fail(f"a block size the draft was built for is skipped: {exc}")
    with pytest.raises(pytest.skip.Exception, match="block sizes up to 8"):
        checks.require_block(_fake_pair(8), 9)


def test_state_tolerance_per_dtype() -> None:
    assert checks.state_tolerance(_fake_pair(dtype=torch.float64)) == 1e-9
    assert checks.state_tolerance(_fake_pair(dtype=torch.float32)) == 1e-3
    with pytest.raises(pytest.skip.Exception):
        checks.state_tolerance(_fake_pair(dtype=torch.bfloat16))


def _spy_runs(monkeypatch, result=None, error: Exception | None = None):
    """Plain and speculative runs replaced by spies; returns what each was called with."""
    calls: dict = {}
    reference = SimpleNamespace(output_ids=[1, 2, 3], finish_reason="length")

    def plain(target, prompt, params, **kwargs):
        calls["plain"] = kwargs
        return reference

    def speculative(target, draft, prompt, params, options, **kwargs):
        calls["speculative"] = (options, kwargs)
        if error is not None:
            raise error
        return result or SimpleNamespace(output_ids=[1, 2, 3], finish_reason="length", acceptance_lengths=[])

    monkeypatch.setattr(checks, "generate_plain", plain)
    monkeypatch.setattr(checks, "generate_speculative", speculative)
    return calls


def test_assert_lossless_runs_both_sides_in_the_pairs_numerics(monkeypatch) -> None:
    calls = _spy_runs(monkeypatch)
    pair = _fake_pair(numerics="exact")
    checks.assert_lossless(pair, [5], SamplingParams(max_tokens=3), EngineConfig(block_size=4))
    assert calls["plain"].get("numerics") == "exact"
    options, _ = calls["speculative"]
    assert options.numerics == "exact" and options.block_size == 4


def test_assert_lossless_oracle_follows_the_given_continuation(monkeypatch) -> None:
    calls = _spy_runs(monkeypatch)
    checks.assert_lossless(
        _fake_pair(),
        [5],
        SamplingParams(max_tokens=3),
        EngineConfig(block_size=4),
        schedule=[1, 2],
        continuation=[7, 8, 9],
    )
    oracle = calls["speculative"][1]["oracle"]
    assert oracle.continuation == [7, 8, 9] and oracle.schedule == [1, 2]
    checks.assert_lossless(
        _fake_pair(), [5], SamplingParams(max_tokens=3), EngineConfig(block_size=4), schedule=[0]
    )
    assert calls["speculative"][1]["oracle"].continuation == [1, 2, 3]


@pytest.mark.parametrize("error", [RuntimeError("shape"), IndexError("index 9 is out of bounds")])
def test_assert_lossless_turns_a_crashed_speculative_run_into_a_verdict(monkeypatch, error) -> None:
    _spy_runs(monkeypatch, error=error)
    with pytest.raises(AssertionError, match=f"the speculative run failed \\({type(error).__name__}"):
        checks.assert_lossless(_fake_pair(), [5], SamplingParams(max_tokens=3), EngineConfig(block_size=4))


def test_assert_forced_acceptance_asks_for_exactly_the_scheduled_tokens(monkeypatch) -> None:
    """max_tokens = the first token + every step's a + 1: no step is cut, none runs past."""
    asked = []

    def lossless(pair, prompt, params, options, schedule):
        asked.append((params.max_tokens, params.ignore_eos, list(schedule)))
        return SimpleNamespace(acceptance_lengths=[k + 1 for k in schedule])

    monkeypatch.setattr(checks, "assert_lossless", lossless)
    checks.assert_forced_acceptance(None, [1], EngineConfig(block_size=4), [0, 1, 2])
    assert asked == [(1 + 1 + 2 + 3, True, [0, 1, 2])]


def test_plain_states_hold_every_committed_length_of_the_output(dense) -> None:
    """One snapshot per committed length, from the prompt's to the last but one output
    token's (the last is never fed back), each the state a fresh prefill of it leaves."""
    target, _ = dense
    output = generate_plain(target, PROMPT, SamplingParams(max_tokens=5, ignore_eos=True)).output_ids
    states = checks.plain_states(target, PROMPT, output)
    n = len(PROMPT)
    assert sorted(states) == list(range(n, n + len(output)))
    for length in (n, n + len(output) - 1):
        fresh = new_state(target, length + 1)
        prefill(target, fresh, 0, (PROMPT + output)[:length])
        expected = checks.snapshot(fresh, length)
        assert sorted(states[length]) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.allclose(states[length][name], tensor, atol=1e-9, rtol=0), (length, name)


def test_speculative_states_run_with_the_given_options_and_record_each_commit(monkeypatch) -> None:
    seen = {}

    def speculative(target, draft, prompt, params, options, oracle=None, on_commit=None):
        seen["options"], seen["oracle"] = options, oracle
        state = SimpleNamespace(
            config=SimpleNamespace(num_hidden_layers=1),
            k_cache=[torch.arange(8.0).reshape(1, 8, 1)],
            v_cache=[torch.zeros(1, 8, 1)],
            conv=[None],
            recurrent=[None],
        )
        on_commit(state, 3)
        on_commit(state, 5)

    monkeypatch.setattr(checks, "generate_speculative", speculative)
    options = EngineConfig(block_size=4, commit_strategy="recompute", max_model_len=64)
    reference = SimpleNamespace(output_ids=[4, 5, 6])
    got = checks.speculative_states(_fake_pair(), [1], SamplingParams(max_tokens=3), options, [2], reference)
    assert seen["options"] is options
    assert seen["oracle"].continuation == [4, 5, 6] and seen["oracle"].schedule == [2]
    assert sorted(got) == [3, 5]
    assert got[5]["layer0.k"].flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


class _FakeEngine:
    """An engine stand-in: a request streams one token a step for max_tokens steps."""

    def __init__(self, stuck: bool = False) -> None:
        self.target = SimpleNamespace(config=SimpleNamespace(vocab_size=32))
        self.steps = 0
        self.stuck = stuck
        self.added: dict[str, tuple[int, object]] = {}
        self.aborted: dict[str, int] = {}
        self.left: dict[str, int] = {}

    def add_request(self, request_id, prompt, params, oracle=None):
        self.added[request_id] = (self.steps, oracle)
        self.left[request_id] = params.max_tokens

    def abort(self, request_id):
        self.aborted[request_id] = self.steps
        self.left.pop(request_id, None)

    def has_unfinished(self):
        return self.stuck or any(self.left.values())

    def step(self):
        outs = []
        for rid, left in self.left.items():
            if left:
                outs.append(SimpleNamespace(request_id=rid, new_token_ids=[self.steps]))
                self.left[rid] = left - 1
        self.steps += 1
        return outs


def test_checks_run_engine_adds_at_arrival_aborts_at_its_step_and_keeps_every_token() -> None:
    engine = _FakeEngine()
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    requests = [
        checks.EngineRequest("a", (1,), params, 0, schedule=(1, 2)),
        checks.EngineRequest("b", (2,), params, 2),
        checks.EngineRequest("c", (3,), SamplingParams(max_tokens=5, ignore_eos=True), 0),
    ]
    streamed = checks.run_engine(engine, requests, {"a": [9, 9, 9]}, abort={"c": 2})
    assert engine.added["a"][0] == 0 and engine.added["b"] == (2, None) and engine.added["c"][0] == 0
    oracle = engine.added["a"][1]
    assert oracle.continuation == [9, 9, 9] and oracle.schedule == [1, 2]
    assert engine.aborted == {"c": 2}
    assert streamed == {"a": [0, 1, 2], "b": [2, 3, 4], "c": [0, 1]}


def test_checks_run_engine_gives_up_on_an_engine_that_makes_no_progress() -> None:
    with pytest.raises(AssertionError, match="no progress"):
        checks.run_engine(_FakeEngine(stuck=True), [], {})


def test_padding_mix_prompts_are_distinct_stretches_of_the_source() -> None:
    source = list(range(100, 200))
    prompts = checks.padding_mix_prompts(source)
    assert {rid: len(p) for rid, p in prompts.items()} == {
        rid: n for rid, (n, _, _) in checks.PADDING_MIX.items()
    }
    assert prompts["x"] != prompts["b"] and prompts["c"] != prompts["d"][: len(prompts["c"])]
    assert prompts["x"] == source[:4] and prompts["c"] == source[7:67]


def test_recorded_verifies_puts_the_verify_back_even_when_the_block_raises(dense) -> None:
    target, draft = dense
    correct = ModelRunner.verify
    engine = Engine(target, draft, EngineConfig(max_num_seqs=1, block_size=4, max_model_len=64))
    with pytest.raises(KeyError), checks.recorded_verifies(engine) as seen:
        assert ModelRunner.verify is not correct
        engine.add_request("r", PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        raise KeyError("the gate failed")
    assert ModelRunner.verify is correct
    assert seen and all(rows == ["r"] for rows, *_ in seen)
    output = engine.collect("r").output_ids
    rows, block, positions, logits = seen[0]
    assert int(positions[0, 0]) == len(PROMPT) and int(block[0, 0]) == output[0]
    assert logits.shape[:2] == block.shape


def test_verify_gaps_read_a_real_row_after_a_padding_row() -> None:
    ids = [1, 2, 3, 4]
    plain = {p: torch.full((4,), float(p), dtype=torch.float64) for p in range(len(ids))}
    logits = torch.stack([plain[1], plain[2]])[None].expand(2, -1, -1).clone()
    logits[1, 0, 0] += 1e-6
    seen = [([None, "r"], torch.tensor([[9, 9], [2, 3]]), torch.tensor([[0, 1], [1, 2]]), logits)]
    compared, worst = checks.verify_gaps(seen, {"r": ids}, {"r": plain}, 1e-9)
    assert compared == 2 and len(worst) == 1 and "position 1 (block slot 0)" in worst[0]


# ------------------------------------------------------------------ gates/options.py
ENVIRONMENT = {
    "DFLASH_GATE_TARGET": ("--target-model", "/t"),
    "DFLASH_GATE_DRAFT": ("--draft-model", "/d"),
    "DFLASH_GATE_DEVICE": ("--gate-device", "cuda:1"),
    "DFLASH_BASELINE_URL": ("--baseline-url", "http://b"),
    "DFLASH_CANDIDATE_URL": ("--candidate-url", "http://c"),
    "DFLASH_COMPARE_MODEL": ("--compare-model", "m"),
    "DFLASH_COMPARE_POLICY": ("--compare-policy", "strict"),
    "DFLASH_COMPARE_PROMPTS": ("--compare-prompts", "/cp.jsonl"),
    "DFLASH_COMPARE_API_KEY": ("--compare-api-key", "k"),
    "DFLASH_COMPARE_SERVER_KIND": ("--compare-server-kind", "vllm"),
    "DFLASH_COMPARE_TOKENIZER": ("--compare-tokenizer", "/tok"),
    "DFLASH_GATE_DTYPE": ("--gate-dtype", "float32"),
    "DFLASH_GATE_NUMERICS": ("--gate-numerics", "fast"),
    "DFLASH_GATE_PROMPTS": ("--gate-prompts", "/gp.jsonl"),
}


def _registered() -> dict[str, dict]:
    from gates import options

    registered: dict[str, dict] = {}
    group = SimpleNamespace(addoption=lambda name, **kwargs: registered.__setitem__(name, kwargs))
    options.pytest_addoption(SimpleNamespace(getgroup=lambda name: group))
    return registered


def test_every_gate_option_reads_its_own_environment_variable(monkeypatch) -> None:
    for name in list(os.environ):
        if name.startswith(("DFLASH_GATE_", "DFLASH_COMPARE_", "DFLASH_BASELINE", "DFLASH_CANDIDATE")):
            monkeypatch.delenv(name)
    defaults = {name: kwargs.get("default") for name, kwargs in _registered().items()}
    assert defaults["--gate-device"] == "cpu" and defaults["--compare-server-kind"] == "auto"
    assert all(
        defaults[option] is None
        for option, _ in ENVIRONMENT.values()
        if option not in ("--gate-device", "--compare-server-kind", "--compare-policy")
    )
    for variable, (_, value) in ENVIRONMENT.items():
        monkeypatch.setenv(variable, value)
    defaults = {name: kwargs.get("default") for name, kwargs in _registered().items()}
    assert {option: defaults[option] for option, _ in ENVIRONMENT.values()} == dict(ENVIRONMENT.values())


def test_dtype_and_numerics_options_accept_the_engines_choices_only() -> None:
    from reference_engine.engine_args import ENGINE_OPTIONS

    registered = _registered()
    for option, engine in (("--gate-dtype", "dtype"), ("--gate-numerics", "numerics")):
        assert registered[option]["choices"] == [None, *ENGINE_OPTIONS[engine].kwargs["choices"]]


# ------------------------------------------------------------------ gates/prompts.py
def test_a_prompts_file_is_taken_whole_whatever_the_count(tmp_path) -> None:
    from gates.prompts import gate_prompt_ids

    rows = tmp_path / "ids.jsonl"
    rows.write_text("".join(json.dumps({"prompt_ids": list(range(i, i + 5))}) + "\n" for i in range(3)))
    got = gate_prompt_ids(Options(**{"--gate-prompts": str(rows)}), None, 2)
    assert got == [list(range(i, i + 5)) for i in range(3)]


def test_a_prompts_file_mixing_ids_and_text_keeps_every_row(tiny_checkpoint, tmp_path) -> None:
    from gates.prompts import gate_prompt_ids
    from reference_engine.tokenizer import load_tokenizer

    target = tiny_checkpoint("qwen3")
    rows = tmp_path / "mixed.jsonl"
    rows.write_text('{"prompt_ids": [5, 6]}\n{"prompt": "the model"}\n')
    got = gate_prompt_ids(Options(**{"--gate-prompts": str(rows), "--target-model": str(target)}), target, 32)
    assert got == [[5, 6], load_tokenizer(target).encode("the model").ids]


# ------------------------------------------------------------------ gates/conftest.py
def _user_pair(monkeypatch, tiny_pair, **values):
    from gates import conftest

    target_dir, draft_dir = tiny_pair("qwen3", block_size=4)
    monkeypatch.setattr(conftest, "_loaded", {})
    options = {"--target-model": str(target_dir), "--draft-model": str(draft_dir), "--gate-device": "cpu"}
    options.update(values)
    request = SimpleNamespace(config=Options(**options))
    return conftest.pair.__wrapped__("user", request, None)


def test_a_user_pair_defaults_to_bfloat16_128_tokens_and_32_prompts(monkeypatch, tiny_pair) -> None:
    pair = _user_pair(monkeypatch, tiny_pair)
    assert pair.target.model.embed_tokens.weight.dtype == torch.bfloat16
    assert pair.max_tokens == 128 and len(pair.prompts) == 32 and pair.numerics is None
    pair = _user_pair(
        monkeypatch,
        tiny_pair,
        **{"--gate-dtype": "float32", "--gate-max-tokens": 9, "--gate-numerics": "fast"},
    )
    assert pair.target.model.embed_tokens.weight.dtype == torch.float32
    assert (pair.max_tokens, pair.numerics) == (9, "fast")


@pytest.mark.parametrize("draft", [None, ""])
def test_a_user_pair_without_a_draft_fails_by_name(monkeypatch, tiny_pair, draft) -> None:
    with pytest.raises(pytest.fail.Exception, match="--target-model needs --draft-model"):
        _user_pair(monkeypatch, tiny_pair, **{"--draft-model": draft})


# ------------------------------------------------------------------ gates/parallel.py
class _FakeGroup:
    """A group of three ranks whose partial sums are fixed: the all-reduce adds them in rank
    order; `size_dependent` makes it add 1e-12 to the last row of a message of several rows."""

    def __init__(self, size_dependent: bool = False) -> None:
        self.parts = torch.tensor([1.0, 1e17, -1e17], dtype=torch.float64)
        self.size_dependent = size_dependent

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.full_like(x, float(p)) for p in self.parts])

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.all_gather(x)
        out = (parts[0] + parts[1]) + parts[2]
        if self.size_dependent and out.reshape(-1, out.shape[-1]).shape[0] > 1:
            out = out.clone()
            out.reshape(-1, out.shape[-1])[-1] += 1e-12
        return out


def test_row_invariance_compares_the_first_and_the_last_row_bitwise() -> None:
    group = _FakeGroup(size_dependent=True)
    check = RowInvariance(group)
    group.all_reduce(torch.zeros(1, 4, dtype=torch.float64))
    assert (check.compared, check.differed) == (0, 0)  # one row: nothing to compare
    group.all_reduce(torch.zeros(2, 4, dtype=torch.float64))
    assert (check.compared, check.differed) == (2, 1)
    group.all_reduce(torch.zeros(3, 4, dtype=torch.float64))
    assert (check.compared, check.differed) == (4, 2)
    steady = _FakeGroup()
    check = RowInvariance(steady)
    steady.all_reduce(torch.zeros(3, 4, dtype=torch.float64))
    assert (check.compared, check.differed) == (2, 0)


def test_the_planted_reduction_order_changes_with_the_message_size() -> None:
    """One row: rank order, as the correct reduction; several: reversed rank order, whose
    float sum differs here; the row-invariance check sees it."""
    group = _FakeGroup()
    one = group.all_reduce(torch.zeros(1, 2, dtype=torch.float64))
    plant_size_dependent_order(group)
    assert torch.equal(group.all_reduce(torch.zeros(1, 2, dtype=torch.float64)), one)
    many = group.all_reduce(torch.zeros(3, 2, dtype=torch.float64))
    assert float(one[0, 0]) == 0.0 and many.flatten().tolist() == [1.0] * 6
    check = RowInvariance(group)
    group.all_reduce(torch.zeros(3, 2, dtype=torch.float64))
    assert check.differed == 2


# ------------------------------------------------------------------ gates/sampling_checks.py
def test_selector_walk_reads_the_edges_from_the_candidate_drawn_before() -> None:
    """Slot 0 reads the anchor's row (0); slot j reads the row of the candidate drawn at j - 1;
    tokens outside the slot's candidates get -inf."""
    candidates = torch.tensor([[3, 5], [1, 4]])
    edges = torch.tensor([[[10.0, 11.0], [12.0, 13.0]], [[20.0, 21.0], [22.0, 23.0]]])
    out = sampling_checks.selector_walk_logits(candidates, edges, torch.tensor([5, 1]), vocab=6)
    assert out[0, [3, 5]].tolist() == [10.0, 11.0]
    assert out[1, [1, 4]].tolist() == [22.0, 23.0]  # 5 was candidate 1 of slot 0
    assert torch.isinf(out[0, [0, 1, 2, 4]]).all() and torch.isinf(out[1, [0, 2, 3, 5]]).all()


def _step_run(output, proposed_at, steps):
    run = sampling_checks.CellRun(Cell(1.0, 0, 1.0), 4, len(output), reference=_Uniform())
    q = torch.full((3, 3), 1 / 3, dtype=torch.float64)
    for at, drafted in proposed_at.items():
        run.proposed[("r", at)] = (drafted, q[: len(drafted)])
    run.requests.append(sampling_checks.Request("r", [1], output, steps, "length"))
    return run


class _Uniform:
    def after(self, prefixes):
        return torch.full((len(prefixes), 3), 1 / 3, dtype=torch.float64)


def test_cell_draws_rejects_more_drafts_than_recorded_steps() -> None:
    run = _step_run([0, 1, 2, 0, 1], {1: [1, 2], 3: [0, 1]}, [StepRecord(2, 2, 3)])
    with pytest.raises(AssertionError, match="recorded 1 speculative steps but drafted 2 times"):
        sampling_checks.cell_draws(run)


def test_cell_draws_rejects_accepted_tokens_that_are_not_the_proposals() -> None:
    """Accepting 2 means committing the 2 proposals: a second committed token that is not the
    second proposal fails."""
    run = _step_run([0, 1, 0, 2], {1: [1, 2]}, [StepRecord(2, 2, 3)])
    with pytest.raises(AssertionError, match="accepted 2 but committed"):
        sampling_checks.cell_draws(run)


def test_cell_draws_rejects_a_step_whose_proposals_were_recorded_elsewhere() -> None:
    run = _step_run([0, 1, 2, 0], {2: [2, 0]}, [StepRecord(2, 2, 3)])
    with pytest.raises(AssertionError, match="never recorded"):
        sampling_checks.cell_draws(run)


def _passing():
    from tests.test_gate_helpers import _passing_draws

    return _passing_draws()


def _verdict(monkeypatch, draws, draft_q: Draws | None = None) -> None:
    monkeypatch.setattr(sampling_checks, "cell_draws", lambda run: draws)
    run = sampling_checks.CellRun(Cell(1.0, 0, 1.0), 4, 3, reference=None)
    run.requests.append(sampling_checks.Request("r", [1], [0, 0, 0], [], "length"))
    if draft_q is None:
        run.draft_q.add(torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64), [0], "here")
    else:
        run.draft_q = draft_q
    sampling_checks.assert_sampling_lossless(run, 1e-3, 100)


def _skewed() -> Draws:
    """400 draws from (0.96, 0.0399, 0.0001), 30 of them the 0.0001 token."""
    draws = Draws()
    probs = torch.tensor([[0.96, 0.0399, 0.0001]], dtype=torch.float64).expand(400, -1)
    draws.add(probs, torch.tensor([0] * 370 + [2] * 30), "here")
    return draws


def test_sampling_verdict_rejects_an_output_token_outside_its_set(monkeypatch) -> None:
    draws = _passing()
    draws.outputs = Draws()
    draws.outputs.add(torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64), [1], "here")
    with pytest.raises(AssertionError, match="output \\(outside the top-k/top-p set\\)"):
        _verdict(monkeypatch, draws)


def test_sampling_verdict_tests_the_bonuses_and_the_draft_proposals(monkeypatch) -> None:
    draws = _passing()
    draws.bonuses = _skewed()
    with pytest.raises(AssertionError, match="bonuses after fully accepted blocks"):
        _verdict(monkeypatch, draws)
    with pytest.raises(AssertionError, match="draft proposals against their q"):
        _verdict(monkeypatch, _passing(), draft_q=_skewed())


def test_sampling_verdict_tests_the_rate_of_the_sets_last_token(monkeypatch) -> None:
    monkeypatch.setattr(
        sampling_checks, "boundary_rate", lambda draws: Rate(expected=100.0, variance=25.0, observed=200)
    )
    with pytest.raises(AssertionError, match="last of their top-k/top-p set"):
        _verdict(monkeypatch, _passing())


# ------------------------------------------------------------------ gates/faults.py
def test_planting_an_unknown_fault_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match="unknown fault 'no_such_fault', expected one of skip_state_rollback"
    ):
        with planted("no_such_fault"):
            pass


def test_every_fault_is_in_place_inside_its_block_and_gone_after() -> None:
    for name, fault in FAULTS.items():
        correct = getattr(fault.owner, fault.method)
        with planted(name):
            assert getattr(fault.owner, fault.method) is not correct, name
        assert getattr(fault.owner, fault.method) is correct, name
    with planted(None):
        pass


def _recorder():
    calls = []

    def correct(*args, **kwargs):
        calls.append(args)
        return args

    return correct, calls


def test_the_tie_faults_raise_the_highest_id_of_a_tie_by_one_ulp() -> None:
    from gates.faults import _highest_id_wins

    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 2.0, 5.0, 5.0]], dtype=torch.float64)
    raised = _highest_id_wins(logits)
    assert raised.argmax(-1).tolist() == [2, 3]
    changed = (raised != logits).nonzero().tolist()
    assert changed == [[0, 2], [1, 3]]
    assert float(raised[0, 2]) == math.nextafter(3.0, math.inf)


def test_the_frequency_fault_counts_each_generated_token_once() -> None:
    correct, calls = _recorder()
    FAULTS["frequency_counted_once"].wrap(correct)("logits", [4, 2, 4, 4], "params")
    assert calls == [("logits", [2, 4], "params")]


def test_the_logit_bias_fault_drops_the_bias_of_the_first_token_only() -> None:
    correct, calls = _recorder()
    params = SamplingParams(max_tokens=3, logit_bias=((1, 5.0),))
    fault = FAULTS["logit_bias_from_second_token"].wrap(correct)
    fault("logits", [], params)
    fault("logits", [7], params)
    assert calls[0][2].logit_bias == () and calls[1][2] is params


def test_the_shared_positions_fault_gives_every_row_the_first_rows_positions() -> None:
    fault = FAULTS["shared_positions"].wrap(lambda self, seqs: [3, 9, 14])
    assert fault(None, ["a", "b", "c"]) == [3, 3, 3]


def test_the_commit_wrong_slot_fault_shifts_the_slots_by_one_row() -> None:
    correct, calls = _recorder()
    FAULTS["commit_wrong_slot"].wrap(correct)("self", [4, 5, 6], "rows", "block", "processed")
    assert calls[0][1] == [5, 6, 4]


def test_the_acceptance_faults_change_what_they_replace() -> None:
    n_t = torch.tensor([3, 3])
    bonus = FAULTS["wrong_bonus_position"].wrap(None)(None, torch.tensor([1, 3]), n_t)
    assert bonus.tolist() == [2, 3]
    never = FAULTS["never_accept_full_block"].wrap(lambda self, p, t, n: n)(None, None, None, n_t)
    assert never.tolist() == [2, 2]
    rows = SimpleNamespace(n_t=n_t)
    kept = FAULTS["skip_length_rollback"].wrap(None)(None, rows, torch.tensor([0, 1]))
    assert kept.tolist() == [4, 4]


def test_the_stop_string_fault_cuts_at_the_first_listed_stop() -> None:
    from reference_engine.serving.stop_strings import earliest

    fault = FAULTS["stop_string_first_listed_cuts"].wrap(earliest)
    assert earliest("abcdef", ("ef", "bc"), 0) == 1
    assert fault("abcdef", ("ef", "bc"), 0) == 4


def test_the_conv_fault_drops_the_last_tap() -> None:
    seen = {}

    def correct(x, base, delta):
        seen["base"], seen["delta"] = base, delta
        return x

    base, delta = torch.ones(3, 2), torch.ones(1, 2, 3)
    FAULTS["dflash2_conv_drops_last_tap"].wrap(correct)(None, base, delta)
    assert seen["base"].tolist() == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    assert seen["delta"][:, :, -1].abs().sum() == 0 and seen["delta"][:, :, :-1].eq(1).all()
    assert base.eq(1).all() and delta.eq(1).all()  # the caller's tensors are left alone


def test_the_kv_pool_faults_misplace_runs() -> None:
    pool = CellAllocator(6)
    short = FAULTS["kv_pool_gap_one_cell_short"].wrap(CellAllocator.allocate)
    pool.runs = {0: 1, 3: 3}  # a gap of 2 cells at 1
    assert short(pool, 3) == 1  # a run of 3 in a gap of 2
    pool = CellAllocator(6)
    last = FAULTS["kv_pool_last_cell_unused"].wrap(CellAllocator.allocate)
    assert last(pool, 2) == 0 and last(pool, 4) is None and pool.runs == {0: 2}
    assert last(pool, 3) == 2


# ------------------------------------------------------------------ inputs the gates are handed
def test_prompt_ids_that_are_not_token_ids_are_refused(tmp_path) -> None:
    from gates.prompts import gate_prompt_ids

    rows = tmp_path / "ids.jsonl"
    rows.write_text('{"prompt_ids": "5 6"}\n')
    with pytest.raises(ValueError, match="prompt_ids"):
        gate_prompt_ids(Options(**{"--gate-prompts": str(rows)}), None, 32)


def test_divergences_report_a_request_missing_from_the_outputs() -> None:
    logits = torch.tensor([[3.0, 1.0]], dtype=torch.float64)
    found = exact.divergences({"a": [0], "b": [0]}, {"a": logits, "b": logits}, {"a": [0]})
    assert [d.request for d in found] == ["b"]
