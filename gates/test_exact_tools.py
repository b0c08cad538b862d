"""The GPU tier's tools (gates/exact.py) on the CPU: the recorder of verify logits and the
test-only kernel swap wrap the engine's real speculative step (its every parameter, a plain
step's `record` included) and compare positions. The GPU gates built on them skip without
CUDA, so a change of the step's signature would otherwise first show on a GPU. (The CPU's
verify logits are not bitwise plain decode's: only the GPU's exact numerics promise that.)"""

from __future__ import annotations

from reference_engine.kernels import TORCH
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams

from .checks import Pair
from .exact import VerifyLogitCheck, plain_with_logits, run_engine, verify_with

TOKENS = 12


def one_prompt(pair: Pair) -> tuple[dict, dict, dict, EngineConfig]:
    prompts = {"p0": list(pair.prompts[1])}
    out, logits = plain_with_logits(pair.target, prompts["p0"], TOKENS, TORCH)
    config = EngineConfig(
        max_num_seqs=1, block_size=8, commit_strategy="per_token", max_model_len=len(prompts["p0"]) + TOKENS
    )
    return prompts, {"p0": out}, {"p0": logits}, config


def test_the_verify_logit_recorder_compares_positions_of_the_real_step(pair: Pair) -> None:
    prompts, references, logits, config = one_prompt(pair)
    engine = Engine(pair.target, pair.draft, config)
    checker = VerifyLogitCheck(engine, prompts, references, logits)
    engine.add_request("p0", prompts["p0"], SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.collect("p0").output_ids == references["p0"]
    assert checker.compared >= TOKENS - 1  # every step's anchor slot at least
    # a difference is reported in the logits' own precision (a float64 one is not "0")
    assert all(not m.endswith("max |diff| 0") for m in checker.mismatches), checker.mismatches[:3]


def test_the_kernel_swap_runs_the_real_step(pair: Pair) -> None:
    prompts, references, _, config = one_prompt(pair)
    with verify_with(linear=TORCH.linear):
        outputs = run_engine(pair.target, pair.draft, prompts, TOKENS, config)
    assert outputs == references
