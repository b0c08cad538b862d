"""Gate: penalised and biased greedy output equals a reference written outside the engine.

The repetition penalty (transformers' `RepetitionPenaltyLogitsProcessor` over the prompt and
the generated tokens, as Hugging Face and vLLM define it), OpenAI's presence and frequency
penalties (over the generated tokens only) and logit bias, each alone and together, on
requests batched in a plain engine and in a DFlash engine (which runs them by plain decode).
The expected output: one full forward per token, the repetition penalty, then the presence and
frequency penalties and the bias applied to its logits, the argmax (the lowest id on a tie).
Checked in float64 (the built-in tiny pairs), where the reference's full forwards and the
engine's decode steps agree far inside any logit gap. Planted faults: a repetition penalty
that sees the generated tokens alone (`repetition_penalty_ignores_prompt`) and a frequency
penalty that counts each generated token once (`frequency_counted_once`)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from reference_engine.runtime.decode import new_state, prefill
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams

from .checks import Pair
from .faults import planted

CATCHES = ("repetition_penalty_ignores_prompt", "frequency_counted_once")
MAX_TOKENS = 16
OPTIONS = {
    "repetition 1.3": {"repetition_penalty": 1.3},
    "repetition 0.7": {"repetition_penalty": 0.7},
    "frequency": {"frequency_penalty": 0.3},
    "negative frequency": {"frequency_penalty": -0.5},  # repeats pay: counts grow past one
    "presence": {"presence_penalty": 1.5},
    "all with bias": {
        "repetition_penalty": 1.2,
        "frequency_penalty": 0.7,
        "presence_penalty": 0.4,
        "logit_bias": ((3, 1.5), (5, -2.0)),
    },
}


def params(options: dict) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0, **options)


def reference_output(pair: Pair, prompt: list[int], options: dict) -> list[int]:
    """Greedy with the rules written out, one full forward per token."""
    repetition = RepetitionPenaltyLogitsProcessor(options.get("repetition_penalty", 1.0))
    out: list[int] = []
    for _ in range(MAX_TOKENS):
        ids = prompt + out
        logits, _ = prefill(pair.target, new_state(pair.target, len(ids)), 0, ids)  # [vocab]
        logits = repetition(torch.tensor([ids]), logits[None].clone())[0]
        for token, count in Counter(out).items():
            logits[token] -= (
                options.get("presence_penalty", 0.0) + options.get("frequency_penalty", 0.0) * count
            )
        for token, bias in options.get("logit_bias", ()):
            logits[token] += bias
        out.append(int(torch.argmax(logits)))
    return out


def assert_penalties_follow_the_reference(pair: Pair, speculative: bool) -> None:
    if pair.target.model.embed_tokens.weight.dtype != torch.float64:
        # full forwards round otherwise than decode steps: a near tie could go either way
        pytest.skip("the reference's full forwards are compared with decode in float64 only")
    prompts = [list(p) for p in pair.prompts if len(p) > 1]
    engine = Engine(
        pair.target,
        pair.draft if speculative else None,
        EngineConfig(max_num_seqs=8, block_size=8 if speculative else None, numerics=pair.numerics),
    )
    jobs = {
        (name, i): (prompt, options) for name, options in OPTIONS.items() for i, prompt in enumerate(prompts)
    }
    for (name, i), (prompt, options) in jobs.items():
        engine.add_request(f"{name}/{i}", prompt, params(options))
    while engine.has_unfinished():
        engine.step()
    wrong = []
    for (name, i), (prompt, options) in jobs.items():
        got = engine.collect(f"{name}/{i}").output_ids
        want = reference_output(pair, prompt, options)
        if got != want:
            at = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
            wrong.append(f"{name}, prompt {i} ({len(prompt)} tokens): first difference at output {at}")
    assert not wrong, "penalised output != the reference: " + "; ".join(wrong)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_penalised_greedy_output_equals_the_reference(pair: Pair, speculative: bool) -> None:
    assert_penalties_follow_the_reference(pair, speculative)


@pytest.mark.parametrize(
    "fault, named",
    [("repetition_penalty_ignores_prompt", "repetition 1.3"), ("frequency_counted_once", "frequency")],
)
def test_the_gate_catches_a_penalty_that_counts_the_wrong_tokens(pair: Pair, fault: str, named: str) -> None:
    with planted(fault), pytest.raises(AssertionError, match="penalised output != the reference") as caught:
        assert_penalties_follow_the_reference(pair, speculative=False)
    assert named in str(caught.value)
