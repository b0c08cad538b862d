"""The gates' helpers judged directly on small lists and tensors (no engine run): a helper
that passes a broken engine would make its gate vacuous, so each check here feeds a helper a
case it must reject (or a value it must compute exactly) and asserts the verdict."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from gates import checks, exact, sampling_checks
from gates.hooks import hooked
from gates.sampling_reference import (
    Cell,
    Draws,
    Rate,
    assert_distributed_as,
    assert_in_support,
    assert_rate,
    boundary_rate,
    rank_test,
    reference_probabilities,
    reference_residual,
    z_bound,
)
from reference_engine.runtime.engine import EngineConfig
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.speculative_step import SpeculativeStep

from .test_gate_options import Options


# ------------------------------------------------------------------ gates/checks.py
def test_divergence_names_the_first_differing_output_position(monkeypatch) -> None:
    """The lossless gate's diagnosis points at the first position where the outputs differ,
    and reads the tie margin after the common prefix."""
    seen = []
    monkeypatch.setattr(checks, "top2_margin", lambda target, ids, numerics=None: seen.append(ids) or 0.5)
    message = checks.divergence(None, [9, 8], [1, 2, 3, 4], [1, 2, 7, 4])
    assert "first divergence at output position 2: plain 3, speculative 7" in message
    assert seen == [[9, 8, 1, 2]]
    assert "lengths differ" in checks.divergence(None, [9], [1, 2], [1])


def _fake_lossless(monkeypatch, spec_ids, spec_reason, acceptance=()):
    got = SimpleNamespace(output_ids=spec_ids, finish_reason=spec_reason, acceptance_lengths=list(acceptance))
    monkeypatch.setattr(checks, "generate_speculative", lambda *args, **kwargs: got)
    pair = checks.Pair("fake", SimpleNamespace(config=SimpleNamespace(vocab_size=16)), None, ())
    reference = SimpleNamespace(output_ids=[1, 2, 3], finish_reason="length")
    return pair, reference


def test_assert_lossless_rejects_a_longer_speculative_output(monkeypatch) -> None:
    """Extra tokens after plain decode's output are a difference, not a match of the prefix."""
    pair, reference = _fake_lossless(monkeypatch, [1, 2, 3, 4], "length")
    with pytest.raises(AssertionError, match="lengths differ"):
        checks.assert_lossless(
            pair, [5], SamplingParams(max_tokens=3), EngineConfig(block_size=4), reference=reference
        )


def test_assert_lossless_rejects_the_same_tokens_with_another_finish_reason(monkeypatch) -> None:
    """Equal tokens with a different finish reason fail the gate."""
    pair, reference = _fake_lossless(monkeypatch, [1, 2, 3], "stop")
    with pytest.raises(AssertionError, match="finish reason plain 'length', speculative 'stop'"):
        checks.assert_lossless(
            pair, [5], SamplingParams(max_tokens=3), EngineConfig(block_size=4), reference=reference
        )
    pair, reference = _fake_lossless(monkeypatch, [1, 2, 3], "length")
    got = checks.assert_lossless(
        pair, [5], SamplingParams(max_tokens=3), EngineConfig(block_size=4), reference=reference
    )
    assert got.output_ids == [1, 2, 3]


def test_assert_forced_acceptance_rejects_a_shorter_acceptance_record(monkeypatch) -> None:
    """The recorded acceptance lengths must be the whole schedule + 1, not a prefix of it."""
    recorded = SimpleNamespace(acceptance_lengths=[1, 2])
    monkeypatch.setattr(checks, "assert_lossless", lambda *args, **kwargs: recorded)
    with pytest.raises(AssertionError, match="acceptance lengths"):
        checks.assert_forced_acceptance(None, [1], EngineConfig(block_size=4), [0, 1, 2])
    recorded.acceptance_lengths = [1, 2, 3]
    assert checks.assert_forced_acceptance(None, [1], EngineConfig(block_size=4), [0, 1, 2]) is recorded


def _snap(value: float) -> dict[str, torch.Tensor]:
    return {"layer0.k": torch.full((3, 2), value, dtype=torch.float64)}


def test_assert_states_close_rejects_no_commits_and_unknown_lengths() -> None:
    """An empty observation, or a committed length the reference never reached, fails."""
    with pytest.raises(AssertionError, match="no commit was observed"):
        checks.assert_states_close({3: _snap(1.0)}, {}, 1e-9, "x")
    with pytest.raises(AssertionError, match="never reached"):
        checks.assert_states_close({3: _snap(1.0)}, {4: _snap(1.0)}, 1e-9, "x")
    assert checks.assert_states_close({3: _snap(1.0), 4: _snap(2.0)}, {3: _snap(1.0)}, 1e-9, "x") == 1


def test_assert_states_close_compares_in_float64_and_fails_on_nan() -> None:
    """A float64 difference of 1e-8 exceeds a 1e-9 tolerance (a float32 copy would round it
    away), and a NaN state is never close."""
    with pytest.raises(AssertionError, match="differs by 1e-08"):
        checks.assert_states_close({3: _snap(1.0)}, {3: _snap(1.0 + 1e-8)}, 1e-9, "x")
    with pytest.raises(AssertionError, match="differs by nan"):
        checks.assert_states_close({3: _snap(1.0)}, {3: _snap(float("nan"))}, 1e-9, "x")


def test_snapshot_keeps_every_committed_kv_row_and_the_recurrent_state() -> None:
    """A snapshot holds exactly `length` KV rows of the slot (the last included) and both the
    conv and the recurrent state of a linear-attention layer."""
    k = torch.arange(2 * 6 * 2, dtype=torch.float64).reshape(2, 6, 2)
    state = SimpleNamespace(
        config=SimpleNamespace(num_hidden_layers=2),
        k_cache=[k, None],
        v_cache=[k + 100, None],
        conv=[None, torch.ones(2, 3)],
        recurrent=[None, torch.full((2, 4), 7.0)],
    )
    snap = checks.snapshot(state, 4, slot=1)
    assert sorted(snap) == ["layer0.k", "layer0.v", "layer1.conv", "layer1.recurrent"]
    assert torch.equal(snap["layer0.k"], k[1, :4])
    assert torch.equal(snap["layer0.v"], k[1, :4] + 100)
    assert torch.equal(snap["layer1.recurrent"], torch.full((4,), 7.0))


def test_assert_batch_equivalent_rejects_a_truncated_stream() -> None:
    """A request that streamed only a prefix of plain greedy's output differs."""
    with pytest.raises(
        AssertionError, match="request a differs from plain greedy alone at output position 2"
    ):
        checks.assert_batch_equivalent({"a": [1, 2]}, {"a": [1, 2, 3]}, "batch")
    checks.assert_batch_equivalent(
        {"a": [1, 2, 3], "b": [9]}, {"a": [1, 2, 3], "b": [0]}, "batch", skip=("b",)
    )


def test_assert_batch_equivalent_names_a_request_missing_from_the_outputs() -> None:
    """A request with a reference and no outputs at all fails the check by name (an
    AssertionError, not a KeyError from the lookup); a skipped one may be missing."""
    with pytest.raises(AssertionError, match="batch: request b streamed nothing"):
        checks.assert_batch_equivalent({"a": [1]}, {"a": [1], "b": [2]}, "batch")
    checks.assert_batch_equivalent({"a": [1]}, {"a": [1], "b": [2]}, "batch", skip=("b",))


# ------------------------------------------------------------------ gates/exact.py
def test_divergences_report_length_differences_both_ways_and_the_margin_at_the_position() -> None:
    """A shorter or longer output is a divergence, and a token divergence at k carries the
    plain run's top-2 margin of row k (the row that chose token k)."""
    logits = torch.tensor([[5.0, 1.0, 0.0], [2.0, 1.75, 0.0], [3.0, 0.0, 0.0]])
    refs = {"a": [0, 0, 0]}
    (found,) = exact.divergences(refs, {"a": logits}, {"a": [0, 1, 0]})
    assert (found.position, found.expected, found.got, found.margin) == (1, 0, 1, 0.25)
    for got, at in (([0, 0], 2), ([0, 0, 0, 0], 3)):
        (found,) = exact.divergences(refs, {"a": logits}, {"a": got})
        assert found.position == at and math.isnan(found.margin)
    assert exact.divergences(refs, {"a": logits}, {"a": [0, 0, 0]}) == []


def _verify_check(
    verify_logits: torch.Tensor, plain: torch.Tensor, block: list[list[int]], n: int, left: int = 5
):
    """A VerifyLogitCheck on a stand-in engine: one request with prompt [7, 7] and plain
    output [10, 11, 12, 13, 14]; its verify at anchor output index 1 (start 3, on the
    device), with `left` tokens of max_tokens left, returns `verify_logits` [1, B, vocab]."""

    class Step:
        def verify(self, rows, block, record=True):
            return SimpleNamespace(logits=verify_logits)

    engine = SimpleNamespace(speculative_step=Step())
    ref = [10, 11, 12, 13, 14]
    check = exact.VerifyLogitCheck(engine, {"r": [7, 7]}, {"r": ref}, {"r": plain})
    rows = SimpleNamespace(
        seqs=[SimpleNamespace(request_id="r")],
        positions=torch.tensor([[3 + j for j in range(len(block[0]))]]),
        n_t=torch.tensor([n]),
        remaining_t=torch.tensor([left]),
    )
    engine.speculative_step.verify(rows, torch.tensor(block))
    return check


def test_verify_logit_check_compares_slot_j_with_plain_row_anchor_plus_j_plus_one() -> None:
    """Slot j of a verify anchored at output index a scores output a + j + 1; only slots whose
    block tokens follow the plain output are compared, and those bitwise."""
    plain = torch.arange(5 * 4, dtype=torch.float64).reshape(5, 4)
    verify = plain[2:5].clone()[None]  # slots 0..2 score outputs 2..4
    check = _verify_check(verify, plain, [[11, 12, 13]], n=2)
    assert check.compared == 3 and check.mismatches == []
    check.assert_bitwise()
    # the block leaves the plain output after slot 0: slots 1 and 2 are not the request's own
    check = _verify_check(verify * 0, plain, [[11, 99, 13]], n=2)
    assert check.compared == 1 and len(check.mismatches) == 1


def test_verify_logit_check_skips_a_row_past_its_max_tokens() -> None:
    """A row with no tokens left (run on to the end of a turn of several steps, its block
    never read) is not compared, even where its block follows the plain output."""
    plain = torch.arange(5 * 4, dtype=torch.float64).reshape(5, 4)
    check = _verify_check(plain[2:5].clone()[None] * 0, plain, [[11, 12, 13]], n=2, left=0)
    assert check.compared == 0 and check.mismatches == []
    assert _verify_check(plain[2:5].clone()[None] * 0, plain, [[11, 12, 13]], n=2, left=1).mismatches


def test_verify_logit_check_is_bitwise_not_a_tolerance_or_a_float32_copy() -> None:
    """A verify row 1e-12 away from plain decode's (float64) is a mismatch."""
    plain = torch.arange(5 * 4, dtype=torch.float64).reshape(5, 4) + 1.0
    verify = plain[2:3].clone()[None]
    verify[0, 0, 1] += 1e-12
    check = _verify_check(verify, plain, [[11]], n=0)
    assert check.compared == 1 and len(check.mismatches) == 1
    with pytest.raises(AssertionError, match="1 of 1 verified positions differ"):
        check.assert_bitwise()


def test_verify_logit_check_fails_when_nothing_was_compared() -> None:
    """A run in which no verify position matched the plain output proves nothing."""
    plain = torch.zeros(5, 4, dtype=torch.float64)
    check = _verify_check(plain[2:3][None], plain, [[99]], n=0)
    assert check.compared == 0
    with pytest.raises(AssertionError, match="no verify position was compared"):
        check.assert_bitwise()


def test_verify_with_restores_the_verify_even_when_the_block_raises() -> None:
    correct = SpeculativeStep.verify
    with pytest.raises(RuntimeError, match="boom"), exact.verify_with():
        assert SpeculativeStep.verify is not correct
        raise RuntimeError("boom")
    assert SpeculativeStep.verify is correct


# ------------------------------------------------------------------ gates/hooks.py
def test_hooked_removes_every_hook_when_the_block_ends_or_raises() -> None:
    owner = SimpleNamespace(a=lambda: 1, b=lambda: 2)
    original_a, original_b = owner.a, owner.b
    wrap = lambda f: lambda: 10 * f()  # noqa: E731
    with hooked((owner, "a", wrap), (owner, "b", wrap)):
        assert (owner.a(), owner.b()) == (10, 20)
    assert owner.a is original_a and owner.b is original_b
    with pytest.raises(KeyError), hooked((owner, "a", wrap)):
        raise KeyError
    assert owner.a is original_a


# ------------------------------------------------------------------ gates/sampling_reference.py
def test_reference_top_k_keeps_exactly_k_and_top_p_keeps_the_crossing_token() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0], dtype=torch.float64)
    probs = reference_probabilities(logits, Cell(1.0, 2, 1.0))
    assert (probs > 0).tolist() == [True, True, False, False, False]
    assert float(probs.sum()) == pytest.approx(1.0)
    full = torch.softmax(logits, -1)
    # top_p just above the first token's mass: the second token crosses it and is kept
    probs = reference_probabilities(logits, Cell(1.0, 0, float(full[0]) + 1e-6))
    assert (probs > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(probs[:2], full[:2] / full[:2].sum())


def test_reference_top_p_stops_where_the_mass_reaches_top_p_exactly() -> None:
    """The smallest set whose mass reaches top_p: a token after a set whose mass equals
    top_p exactly is left out."""
    logits = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64).log()
    top_p = float(torch.softmax(logits, -1).sort(descending=True).values.cumsum(-1)[1])
    kept = reference_probabilities(logits, Cell(1.0, 0, top_p)) > 0
    assert kept.tolist() == [True, True, False, False]


def test_reference_residual_is_normalised_and_falls_back_to_p() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.6, 0.2]], dtype=torch.float64)
    assert torch.allclose(reference_residual(p, q), torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64))
    assert torch.equal(reference_residual(p, p), p)


def test_rate_z_and_the_two_sided_bound() -> None:
    """z = (observed - expected) / sqrt(sum p(1-p)); the bound is the two-sided normal one."""
    rate = Rate()
    rate.add(torch.full((100,), 0.5), torch.arange(100) < 60)
    assert (rate.expected, rate.variance, rate.observed) == (50.0, 25.0, 60)
    assert rate.z == pytest.approx(2.0)
    assert z_bound(0.05) == pytest.approx(1.959964, abs=1e-6)


def test_assert_rate_fails_a_count_far_on_either_side_and_skips_tiny_expectations() -> None:
    bound = z_bound(1e-3)
    for observed in (100 - 8 * 5, 100 + 8 * 5):  # z = -8, +8 (variance 25)
        rate = Rate(expected=100.0, variance=25.0, observed=observed)
        with pytest.raises(AssertionError, match="times where 100.0 are expected"):
            assert_rate(rate, "x", 1e-3)
    assert_rate(Rate(expected=100.0, variance=25.0, observed=100 + int(bound * 5) - 1), "x", 1e-3)
    assert_rate(Rate(expected=4.0, variance=1.0, observed=400), "x", 1e-3)  # under MIN_EXPECTED
    with pytest.raises(AssertionError):
        assert_rate(Rate(expected=10.0, variance=float("nan"), observed=10), "x", 1e-3)


def _draws(probs, tokens) -> Draws:
    draws = Draws()
    draws.add(torch.as_tensor(probs, dtype=torch.float64), tokens, "here")
    return draws


def test_assert_in_support_rejects_zero_and_nan_mass() -> None:
    assert_in_support(_draws([[0.5, 0.5, 0.0]], [1]), "x")
    with pytest.raises(AssertionError, match="outside the reference support"):
        assert_in_support(_draws([[0.5, 0.5, 0.0]], [2]), "x")
    with pytest.raises(AssertionError, match="outside the reference support"):
        assert_in_support(_draws([[0.5, float("nan"), 0.0]], [1]), "x")


def test_rank_test_degrees_of_freedom_p_value_and_the_thin_tail() -> None:
    """Four equally likely ranks at 100 draws each: 4 bins, 3 degrees of freedom and
    p = 1 for a perfect match; draws piling into a thin tail fail."""
    uniform = torch.full((400, 4), 0.25, dtype=torch.float64)
    statistic, df, p, bins = rank_test(_draws(uniform, torch.arange(400) % 4))
    assert (statistic, df, len(bins)) == (0.0, 3, 4)
    assert p == pytest.approx(1.0)
    # 96 % / 3.99 % / 0.01 %: the last rank expects 0.04 of 400 draws and joins bin 1
    skew = torch.tensor([[0.96, 0.0399, 0.0001]], dtype=torch.float64).expand(400, -1)
    tokens = torch.tensor([0] * 370 + [2] * 30)
    statistic, df, p, bins = rank_test(_draws(skew, tokens))
    assert [(r, o) for r, _, o in bins] == [("0", 370), ("1-2", 30)]
    assert df == 1 and p < 1e-3
    with pytest.raises(AssertionError, match="departs from the reference"):
        assert_distributed_as(_draws(skew, tokens), "x", 1e-3)


def test_assert_distributed_as_fails_on_a_nan_p_value(monkeypatch) -> None:
    import gates.sampling_reference as reference

    monkeypatch.setattr(reference, "rank_test", lambda draws: (float("nan"), 3, float("nan"), []))
    with pytest.raises(AssertionError, match="p = nan"):
        assert_distributed_as(_draws([[1.0]], [0]), "x", 1e-3)


def test_boundary_rate_counts_the_least_likely_kept_token() -> None:
    probs = torch.tensor([[0.6, 0.3, 0.1, 0.0]] * 3, dtype=torch.float64)
    rate = boundary_rate(_draws(probs, [2, 0, 2]))
    assert rate.observed == 2 and rate.expected == pytest.approx(0.3)


# ------------------------------------------------------------------ gates/sampling_checks.py
def _passing_draws() -> sampling_checks.CellDraws:
    one = [[1.0, 0.0, 0.0]]
    draws = sampling_checks.CellDraws(full_blocks=100)
    for part in (draws.outputs, draws.bonuses, draws.residuals):
        part.add(torch.tensor(one * 3, dtype=torch.float64), [0, 0, 0], "here")
    draws.acceptance = Rate(expected=50.0, variance=25.0, observed=50)
    return draws


def _lossless_verdict(monkeypatch, draws, q_error=0.0):
    monkeypatch.setattr(sampling_checks, "cell_draws", lambda run: draws)
    run = sampling_checks.CellRun(Cell(1.0, 0, 1.0), 4, 17, reference=None, q_error=q_error)
    run.draft_q.add(torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64), [0], "here")
    sampling_checks.assert_sampling_lossless(run, 1e-3, 100)


def test_assert_sampling_lossless_passes_a_consistent_run(monkeypatch) -> None:
    _lossless_verdict(monkeypatch, _passing_draws())


def test_assert_sampling_lossless_rejects_a_nan_q_error(monkeypatch) -> None:
    with pytest.raises(AssertionError, match="the draft's q differs"):
        _lossless_verdict(monkeypatch, _passing_draws(), q_error=float("nan"))


def test_assert_sampling_lossless_rejects_too_few_full_blocks(monkeypatch) -> None:
    draws = _passing_draws()
    draws.full_blocks = 99
    with pytest.raises(AssertionError, match="99 full blocks"):
        _lossless_verdict(monkeypatch, draws)


def test_assert_sampling_lossless_rejects_a_replacement_outside_the_residual(monkeypatch) -> None:
    draws = _passing_draws()
    draws.residuals = _draws([[1.0, 0.0, 0.0]], [2])
    with pytest.raises(AssertionError, match="replacements"):
        _lossless_verdict(monkeypatch, draws)


def test_assert_sampling_lossless_tests_the_acceptance_count(monkeypatch) -> None:
    draws = _passing_draws()
    draws.acceptance = Rate(expected=50.0, variance=25.0, observed=90)
    with pytest.raises(AssertionError, match="accepted proposals"):
        _lossless_verdict(monkeypatch, draws)


# ------------------------------------------------------------------ gates/prompts.py
def test_gate_prompts_take_count_of_the_demo_prompts_and_keep_repeated_rows(tmp_path) -> None:
    """Without a target the demo's first `count` held-out prompts; a file's rows are taken
    as they are, a repeated prompt kept (the gate's workload is the file's)."""
    from gates.prompts import gate_prompt_ids
    from reference_engine.demo import demo_prompts

    assert gate_prompt_ids(Options(), None, 3) == [row["prompt_ids"] for row in demo_prompts()][:3]
    rows = tmp_path / "ids.jsonl"
    rows.write_text('{"prompt_ids": [5, 6]}\n{"prompt_ids": [5, 6]}\n{"prompt_ids": [9]}\n')
    assert gate_prompt_ids(Options(**{"--gate-prompts": str(rows)}), None, 32) == [[5, 6], [5, 6], [9]]


def test_gate_prompts_join_chat_turns_with_newlines(tiny_checkpoint, tmp_path) -> None:
    """A chat row's turns become one text, their contents joined by newlines."""
    from gates.prompts import gate_prompt_ids
    from reference_engine.tokenizer import load_tokenizer

    target = tiny_checkpoint("qwen3")
    chat = tmp_path / "chat.jsonl"
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the model"}]
    chat.write_text(json.dumps({"messages": turns}) + "\n")
    got = gate_prompt_ids(Options(**{"--gate-prompts": str(chat)}), target, 32)
    tokenizer = load_tokenizer(target)
    assert got == [tokenizer.encode("be brief\nthe model").ids]
    assert got != [tokenizer.encode("be brief the model").ids]


# ------------------------------------------------------------------ gates/faults.py
def test_a_planted_fault_is_removed_when_the_block_raises() -> None:
    """A gate that fails inside `planted` must not leave the fault in the engine for the
    tests after it."""
    from gates.faults import FAULTS, planted

    fault = FAULTS["skip_state_rollback"]
    correct = getattr(fault.owner, fault.method)
    with pytest.raises(AssertionError, match="gate failed"), planted("skip_state_rollback"):
        assert getattr(fault.owner, fault.method) is not correct
        raise AssertionError("gate failed")
    assert getattr(fault.owner, fault.method) is correct


class _FixedReference:
    """A target whose distribution is `p` after every prefix."""

    def __init__(self, p: list[float]) -> None:
        self.p = torch.tensor(p, dtype=torch.float64)

    def after(self, prefixes):
        return self.p.expand(len(prefixes), -1).clone()


def test_cell_draws_decides_the_accepted_proposals_and_the_rejected_one() -> None:
    """A step that accepted a of n proposals decided a + 1 of them (the first rejection
    included): each enters the acceptance count with probability min(1, p/q), and the
    replacement is judged against norm(max(p - q, 0)) at the rejected slot."""
    from reference_engine.runtime.sequence import StepRecord

    reference = _FixedReference([0.5, 0.3, 0.2])
    run = sampling_checks.CellRun(Cell(1.0, 0, 1.0), 4, 4, reference=reference)
    q = torch.tensor([[0.2, 0.4, 0.4], [0.2, 0.4, 0.4], [0.6, 0.2, 0.2]], dtype=torch.float64)
    run.proposed[("r", 1)] = ([2, 0, 0], q)
    step = StepRecord(proposed=3, accepted=1, acceptance_length=2)
    run.requests.append(sampling_checks.Request("r", [1], [0, 2, 0, 1], [step], "length"))
    draws = sampling_checks.cell_draws(run)
    # slot 0: token 2, p/q = 0.5 (accepted); slot 1: token 0, p/q = 2.5 -> 1 (rejected)
    assert (draws.acceptance.expected, draws.acceptance.observed) == (1.5, 1)
    assert draws.acceptance.variance == pytest.approx(0.25)
    probs, tokens = draws.residuals.stacked()
    assert tokens.tolist() == [0] and torch.allclose(
        probs, torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    )
    assert len(draws.outputs) == 4 and len(draws.bonuses) == 0 and draws.full_blocks == 0


def test_the_close_proposer_differs_from_the_target_and_leaves_its_support() -> None:
    """The close proposer's q is near p but not p, with mass outside p's support, so a bonus
    drawn from q or a residual computed wrongly shows in the sampling gate."""
    reference = _FixedReference([0.7, 0.3, 0.0, 0.0])
    proposer = sampling_checks.CloseProposer(reference, seed=0)
    drafted, qs = proposer.propose([[1], [2]], [2, 1])
    assert [len(d) for d in drafted] == [2, 1] and [tuple(q.shape) for q in qs] == [(2, 4), (1, 4)]
    for q in qs:
        assert torch.allclose(q.sum(-1), torch.ones(len(q), dtype=torch.float64))
        assert (q[:, 2:].sum(-1) >= 0.1).all()  # mass outside p's support
        assert (0.5 * (q - reference.p).abs().sum(-1) >= 0.1).all()  # total variation from p
