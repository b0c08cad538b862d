"""The GPU tier's tools (gates/exact.py) on the CPU: the recorder of verify logits and the
test-only kernel swap wrap the engine's real speculative step, pass on its every argument (a
plain step's `record=False` included) and compare positions. The GPU gates built on them skip
without CUDA, so a change of the step's signature would otherwise first show on a GPU. (The
CPU's verify logits are not bitwise plain decode's: only the GPU's exact numerics promise
that.)"""

from __future__ import annotations

import pytest

from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.speculative_step import SpeculativeStep
from reference_engine.runtime.verify_width import StepCosts

from .checks import Pair, require_block
from .exact import VerifyLogitCheck, model_ops, plain_with_logits, verify_with

TOKENS = 12
# a plain step (width 0) commits a token a little faster than any drafted width could, even
# with every draft token accepted: runs of plain steps, broken by probes that lose so little
# (verify_width.probe_loss) that one comes after the fewest plain steps
PLAIN_PAYS = StepCosts({(1, w): s for w, s in ((0, 0.1), (1, 0.21), (3, 0.41), (7, 0.805))}, measured=True)


@pytest.fixture
def records(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The `record` of every call that reaches the speculative step's own verify."""
    seen: list[bool] = []
    correct = SpeculativeStep.verify

    def spy(self, rows, block, record=True):
        seen.append(record)
        return correct(self, rows, block, record)

    monkeypatch.setattr(SpeculativeStep, "verify", spy)
    return seen


def one_prompt(pair: Pair) -> tuple[dict, dict, dict, EngineConfig]:
    require_block(pair, 8)
    prompts = {"p0": list(pair.prompts[1])}
    out, logits = plain_with_logits(pair.target, prompts["p0"], TOKENS, model_ops(pair.target, pair.numerics))
    config = EngineConfig(
        max_num_seqs=1,
        block_size=8,
        commit_strategy="per_token",
        max_model_len=len(prompts["p0"]) + TOKENS,
        numerics=pair.numerics,
    )
    return prompts, {"p0": out}, {"p0": logits}, config


def run(engine: Engine, prompt: list[int]) -> list[int]:
    engine.add_request("p0", prompt, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return engine.collect("p0").output_ids


def test_the_verify_logit_recorder_passes_every_argument_and_compares(
    pair: Pair, records: list[bool]
) -> None:
    prompts, references, logits, config = one_prompt(pair)
    engine = Engine(pair.target, pair.draft, config, step_costs=PLAIN_PAYS)
    checker = VerifyLogitCheck(engine, prompts, references, logits)
    assert run(engine, prompts["p0"]) == references["p0"]
    assert False in records and True in records  # plain steps and drafted probes, passed on
    assert checker.compared >= TOKENS - 1  # every step's anchor slot at least
    # a difference is reported in the logits' own precision (a float64 one is not "0")
    assert all(not m.endswith("max |diff| 0") for m in checker.mismatches), checker.mismatches[:3]


def test_the_kernel_swap_passes_every_argument(pair: Pair, records: list[bool]) -> None:
    prompts, references, _, config = one_prompt(pair)
    kernels = model_ops(pair.target, pair.numerics)
    with verify_with(linear=kernels.linear):
        engine = Engine(pair.target, pair.draft, config, step_costs=PLAIN_PAYS)
        assert run(engine, prompts["p0"]) == references["p0"]
    assert False in records and True in records
