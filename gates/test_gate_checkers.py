"""The gates' own checking code, fed hand-built inputs whose right verdict is known.

A gate proves "speculative output == plain greedy output" only if its checker can fail. Each
test here gives one checker a case it must reject (or accept) and pins its verdict:

- the state-equality check compares every tensor of a snapshot (a later layer's, the conv and
  recurrent state too), by the largest difference, not the mean, and at every committed
  length, not the first;
- the batch check rejects a request that streamed more than plain greedy's output;
- the verify-logit comparison reaches a row's last scored position (len - 2) and holds its
  tolerance;
- the exact-numerics divergence finder reports every request that differs, not the first;
- the sampling gate's verdict fails a draft q off by more than its float64 tolerance and a
  request that did not run to exactly max_tokens, and counts only a whole accepted block
  (B - 1 proposals) as full, so the bonus check cannot be satisfied by short blocks;
- the tiny pairs' prompts are distinct random sequences, and every tiny pair (the hybrid one,
  whose recurrent state the rollback faults corrupt, included) is gated;
- a user's pair runs the documented workload by default (32 prompts, 128 tokens, two
  tensor-parallel ranks, the tie-tolerant HTTP policy), the environment overriding it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gates import checks, exact, sampling_checks
from gates.sampling_reference import Cell
from tests.test_gate_helpers import _passing_draws as passing_draws


# ------------------------------------------------------------------ state equality
def _state(layers: int, value: float = 0.0) -> dict[str, torch.Tensor]:
    """A snapshot of `layers` attention layers (k, v) and one linear layer (conv, recurrent)."""
    snap = {}
    for i in range(layers):
        snap[f"layer{i}.k"] = torch.full((4, 2), value, dtype=torch.float64)
        snap[f"layer{i}.v"] = torch.full((4, 2), value, dtype=torch.float64)
    snap[f"layer{layers}.conv"] = torch.full((3, 2), value, dtype=torch.float64)
    snap[f"layer{layers}.recurrent"] = torch.full((2, 2), value, dtype=torch.float64)
    return snap


@pytest.mark.parametrize("name", ["layer0.v", "layer2.k", "layer3.conv", "layer3.recurrent"])
def test_state_check_compares_every_tensor_of_a_snapshot(name: str) -> None:
    """A state that differs only in one tensor (the last layer's, the recurrent state) fails."""
    expected = {5: _state(3)}
    got = {5: _state(3)}
    got[5][name] = got[5][name].clone()
    got[5][name][-1, -1] = 1e-6
    with pytest.raises(AssertionError, match=f"at committed length 5, {name} differs by 1e-06"):
        checks.assert_states_close(expected, got, 1e-9, "x")


def test_state_check_takes_the_largest_difference_not_the_mean() -> None:
    """One element 1e-6 off among many equal ones exceeds a 1e-9 tolerance."""
    expected = {5: {"layer0.k": torch.zeros(64, 16, dtype=torch.float64)}}
    got = {5: {"layer0.k": torch.zeros(64, 16, dtype=torch.float64)}}
    got[5]["layer0.k"][63, 15] = 1e-6
    with pytest.raises(AssertionError, match="differs by 1e-06"):
        checks.assert_states_close(expected, got, 1e-9, "x")


def test_state_check_compares_every_committed_length() -> None:
    """The state at the last committed length differs: the check sees it and counts all."""
    expected = {n: _state(1, float(n)) for n in (3, 5, 8)}
    got = {n: _state(1, float(n)) for n in (3, 5, 8)}
    assert checks.assert_states_close(expected, got, 1e-9, "x") == 3
    got[8] = _state(1, 8.5)
    with pytest.raises(AssertionError, match="at committed length 8"):
        checks.assert_states_close(expected, got, 1e-9, "x")


# ------------------------------------------------------------------ batch equivalence
def test_batch_check_rejects_a_request_that_streamed_too_much() -> None:
    """Plain greedy's tokens and then one more differ from plain greedy."""
    with pytest.raises(
        AssertionError, match="request a differs from plain greedy alone at output position 3"
    ):
        checks.assert_batch_equivalent({"a": [1, 2, 3, 4]}, {"a": [1, 2, 3]}, "batch")


def test_batch_check_reads_every_request() -> None:
    """Only the last of three requests differs, in its last token."""
    refs = {"a": [1, 2], "b": [3, 4], "c": [5, 6]}
    with pytest.raises(AssertionError, match="request c differs .* at output position 1"):
        checks.assert_batch_equivalent({"a": [1, 2], "b": [3, 4], "c": [5, 7]}, refs, "batch")
    checks.assert_batch_equivalent({"a": [1, 2], "b": [3, 4], "c": [5, 6]}, refs, "batch")


# ------------------------------------------------------------------ exact numerics
def test_divergences_report_every_request_that_differs() -> None:
    """Two requests differ (the second only in its last token, the third in length): each
    is reported, not only the first."""
    logits = torch.tensor([[3.0, 1.0, 0.0], [3.0, 2.5, 0.0]])
    refs = {"a": [0, 0], "b": [0, 0], "c": [0, 0], "d": [0, 0]}
    outs = {"a": [0, 0], "b": [1, 0], "c": [0, 1], "d": [0]}
    found = exact.divergences(refs, {r: logits for r in refs}, outs)
    assert [(d.request, d.position, d.expected, d.got) for d in found] == [
        ("b", 0, 0, 1),
        ("c", 1, 0, 1),
        ("d", 1, -1, -1),
    ]
    assert found[1].margin == pytest.approx(0.5)


def test_verify_gaps_compare_a_row_up_to_its_last_scored_position() -> None:
    """A block laid over the request's last tokens: every slot whose logits choose one of the
    request's own tokens is compared, the last such slot (position len - 2) included."""
    ids = [1, 2, 3, 4, 5]  # prompt + output
    plain = {p: torch.full((4,), float(p), dtype=torch.float64) for p in range(len(ids))}
    logits = torch.stack([plain[2], plain[3], plain[4]])[None].clone()
    seen = [(["r"], torch.tensor([[3, 4, 5]]), torch.tensor([[2, 3, 4]]), logits)]
    assert checks.verify_gaps(seen, {"r": ids}, {"r": plain}, 1e-9) == (2, [])
    logits[0, 1, 0] += 1e-6  # position 3: the logits that choose the last token
    compared, worst = checks.verify_gaps(seen, {"r": ids}, {"r": plain}, 1e-9)
    assert compared == 2 and len(worst) == 1 and "position 3 (block slot 1)" in worst[0]


# ------------------------------------------------------------------ sampling
def _sampling_verdict(monkeypatch, q_error: float = 0.0, output=None, finish: str = "length") -> None:
    monkeypatch.setattr(sampling_checks, "cell_draws", lambda run: passing_draws())
    run = sampling_checks.CellRun(Cell(1.0, 0, 1.0), 4, 4, reference=None, q_error=q_error)
    run.draft_q.add(torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64), [0], "here")
    run.requests.append(
        sampling_checks.Request("r", [1], [0, 0, 0, 0] if output is None else output, [], finish)
    )
    sampling_checks.assert_sampling_lossless(run, 1e-3, 100)


def test_sampling_verdict_fails_a_draft_q_past_its_float64_tolerance(monkeypatch) -> None:
    """Both sides of the draft-q check are float64: 1e-9 off is a wrong q."""
    _sampling_verdict(monkeypatch, q_error=1e-13)
    with pytest.raises(AssertionError, match="the draft's q differs .* by 1e-09"):
        _sampling_verdict(monkeypatch, q_error=1e-9)


@pytest.mark.parametrize(
    ("output", "finish"), [([0, 0, 0], "stop"), ([0, 0, 0], "length"), ([0] * 4, "stop")]
)
def test_sampling_verdict_fails_a_request_that_did_not_run_to_max_tokens(monkeypatch, output, finish) -> None:
    """Every sampled request ignores EOS: it ends 'length' after exactly max_tokens."""
    with pytest.raises(AssertionError, match="request r ended"):
        _sampling_verdict(monkeypatch, output=output, finish=finish)


class _Uniform:
    def after(self, prefixes):
        return torch.full((len(prefixes), 3), 1 / 3, dtype=torch.float64)


def test_only_a_whole_accepted_block_counts_as_full() -> None:
    """Block size 4: a step that accepted all of 1 or 2 proposals gives a bonus but not a full
    block; one that accepted all 3 gives both."""
    from reference_engine.runtime.sequence import StepRecord

    run = sampling_checks.CellRun(Cell(1.0, 0, 1.0), 4, 10, reference=_Uniform())
    q = torch.full((3, 3), 1 / 3, dtype=torch.float64)
    output = [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    steps = [(1, 1), (3, 2), (6, 3)]  # (output position, proposals all accepted)
    for at, n in steps:
        run.proposed[("r", at)] = (output[at : at + n], q[:n])
    records = [StepRecord(proposed=n, accepted=n, acceptance_length=n + 1) for _, n in steps]
    run.requests.append(sampling_checks.Request("r", [1], output, records, "length"))
    draws = sampling_checks.cell_draws(run)
    assert len(draws.bonuses) == 3 and draws.full_blocks == 1


# ------------------------------------------------------------------ the tiny pairs and their prompts
def test_the_tiny_prompts_are_distinct_random_sequences() -> None:
    """Prompts of 1, 17 and 300 tokens drawn from one stream: none is the start of another,
    and each long one holds many tokens, below the vocabulary's last 16."""
    from gates.conftest import tiny_prompts

    prompts = tiny_prompts(512)
    assert [len(p) for p in prompts] == [1, 17, 300]
    assert prompts[1] != prompts[2][:17] and prompts[0] != prompts[1][:1]
    assert len(set(prompts[2])) > 100 and max(prompts[2]) < 512 - 16
    assert tiny_prompts(512) == prompts  # fixed seed: the gates are deterministic


def test_every_tiny_pair_is_gated_without_a_user_pair() -> None:
    """Without --target-model each pair gate runs on the dense, the hybrid and the DFlash2
    pair; with one, on the user's only."""
    from gates import conftest

    for target, names in ((None, ["dense", "hybrid", "dense-dflash2"]), ("/m", ["user"])):
        calls = []
        metafunc = SimpleNamespace(
            fixturenames=["pair_name"],
            config=SimpleNamespace(getoption=lambda name, t=target: t),
            parametrize=lambda *args, seen=calls, **kwargs: seen.append((args, kwargs)),
        )
        conftest.pytest_generate_tests(metafunc)
        assert calls == [(("pair_name", names), {"scope": "session"})]
    assert conftest.TINY_PAIRS["hybrid"][0] == "qwen3_5"


# ------------------------------------------------------------------ options
def _option_defaults() -> dict:
    """Each gate option's default, as registered."""
    from gates import options

    defaults = {}
    group = SimpleNamespace(
        addoption=lambda name, **kwargs: defaults.__setitem__(name, kwargs.get("default"))
    )
    options.pytest_addoption(SimpleNamespace(getgroup=lambda name: group))
    return defaults


def test_a_user_pair_runs_the_documented_workload_by_default(monkeypatch) -> None:
    """docs/gates.md: 32 prompts and 128 tokens each for a user's pair, two tensor-parallel
    ranks, the tie-tolerant HTTP policy; no option quietly runs fewer cases. The environment
    sets each where the option is not given."""
    import os

    from gates import conftest

    for name in list(os.environ):
        if name.startswith(("DFLASH_GATE_", "DFLASH_COMPARE_")):
            monkeypatch.delenv(name)
    defaults = _option_defaults()
    assert defaults["--gate-max-tokens"] is None and conftest.USER_MAX_TOKENS == 128
    assert conftest.USER_PROMPTS == 32
    assert defaults["--gate-tensor-parallel-size"] == 2
    assert defaults["--compare-policy"] == "tie-tolerant" and defaults["--gate-prompts"] is None
    monkeypatch.setenv("DFLASH_GATE_MAX_TOKENS", "7")
    monkeypatch.setenv("DFLASH_GATE_TENSOR_PARALLEL_SIZE", "4")
    defaults = _option_defaults()
    assert (defaults["--gate-max-tokens"], defaults["--gate-tensor-parallel-size"]) == (7, 4)
