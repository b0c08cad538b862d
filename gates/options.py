"""Command-line options and environment variables that point the gates at a user's own
checkpoints (registered from the repository's root conftest.py).

    pytest gates --target-model PATH --draft-model PATH [--gate-device cuda]
                 [--gate-dtype bfloat16] [--gate-numerics exact|fast]
                 [--gate-prompts FILE.jsonl] [--gate-max-tokens N]

or DFLASH_GATE_TARGET, DFLASH_GATE_DRAFT, DFLASH_GATE_DEVICE, DFLASH_GATE_DTYPE,
DFLASH_GATE_NUMERICS, DFLASH_GATE_PROMPTS, DFLASH_GATE_MAX_TOKENS. Without a target the gates
build tiny dense and hybrid pairs and run them in float64 on the CPU. A user's pair runs a
real workload: 32 prompts of the built-in mixed set (or the file's) and 128 generated tokens
each (or N), in the exact numerics on CUDA unless told otherwise.

The HTTP equivalence gate compares two running servers:

    pytest gates/test_http_equivalence.py --baseline-url URL --candidate-url URL
        [--compare-model NAME] [--compare-policy strict|tie-tolerant] [--compare-prompts F]
        [--compare-server-kind auto|ours|vllm|sglang|lmdeploy|openai] [--compare-tokenizer DIR]

(or DFLASH_BASELINE_URL, DFLASH_CANDIDATE_URL, ...). Without URLs it starts our own plain
and DFlash servers on a tiny pair.
"""

from __future__ import annotations

import os

import pytest

from reference_engine.engine_args import ENGINE_OPTIONS


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dflash gates")
    group.addoption(
        "--target-model",
        default=os.environ.get("DFLASH_GATE_TARGET"),
        help="target checkpoint directory (env DFLASH_GATE_TARGET)",
    )
    group.addoption(
        "--draft-model",
        default=os.environ.get("DFLASH_GATE_DRAFT"),
        help="DFlash draft directory for --target-model (env DFLASH_GATE_DRAFT)",
    )
    group.addoption(
        "--gate-device",
        default=os.environ.get("DFLASH_GATE_DEVICE", "cpu"),
        help=f"{ENGINE_OPTIONS['device'].help}, for the gate models (env DFLASH_GATE_DEVICE)",
    )
    group.addoption(
        "--baseline-url",
        default=os.environ.get("DFLASH_BASELINE_URL"),
        help="HTTP gate: baseline server (DFlash off) (env DFLASH_BASELINE_URL)",
    )
    group.addoption(
        "--candidate-url",
        default=os.environ.get("DFLASH_CANDIDATE_URL"),
        help="HTTP gate: candidate server (DFlash on) (env DFLASH_CANDIDATE_URL)",
    )
    group.addoption(
        "--compare-model",
        default=os.environ.get("DFLASH_COMPARE_MODEL"),
        help="HTTP gate: model name to send (env DFLASH_COMPARE_MODEL)",
    )
    group.addoption(
        "--compare-policy",
        default=os.environ.get("DFLASH_COMPARE_POLICY", "tie-tolerant"),
        help="HTTP gate: strict | tie-tolerant (env DFLASH_COMPARE_POLICY)",
    )
    group.addoption(
        "--compare-prompts",
        default=os.environ.get("DFLASH_COMPARE_PROMPTS"),
        help="HTTP gate: JSONL prompts (default: built-in sets)",
    )
    group.addoption(
        "--compare-api-key",
        default=os.environ.get("DFLASH_COMPARE_API_KEY"),
        help="HTTP gate: bearer key sent to both servers (env DFLASH_COMPARE_API_KEY)",
    )
    group.addoption(
        "--compare-server-kind",
        default=os.environ.get("DFLASH_COMPARE_SERVER_KIND", "auto"),
        help="HTTP gate: ours|vllm|sglang|lmdeploy|openai, or auto: probe",
    )
    group.addoption(
        "--compare-tokenizer",
        default=os.environ.get("DFLASH_COMPARE_TOKENIZER"),
        help="HTTP gate: the model's tokenizer directory, for servers without ids",
    )
    group.addoption(
        "--gate-dtype",
        default=os.environ.get("DFLASH_GATE_DTYPE"),
        choices=[None, *ENGINE_OPTIONS["dtype"].kwargs["choices"]],
        help=f"{ENGINE_OPTIONS['dtype'].help}: default float64 for tiny pairs, "
        "bfloat16 for a user's checkpoints (env DFLASH_GATE_DTYPE)",
    )
    group.addoption(
        "--gate-numerics",
        default=os.environ.get("DFLASH_GATE_NUMERICS"),
        choices=[None, *ENGINE_OPTIONS["numerics"].kwargs["choices"]],
        help=f"the engine under test's {ENGINE_OPTIONS['numerics'].help}; in fast "
        "numerics divergences are reported with their tie margins, and fail "
        "(env DFLASH_GATE_NUMERICS)",
    )
    group.addoption(
        "--gate-prompts",
        default=os.environ.get("DFLASH_GATE_PROMPTS"),
        help="JSONL prompts for a user's pair: `prompt` (text), `messages` (chat, "
        "their turns' contents joined by newlines) or `prompt_ids` per row; default: 32 of the "
        "built-in mixed set (env DFLASH_GATE_PROMPTS)",
    )
    group.addoption(
        "--gate-tensor-parallel-size",
        type=int,
        default=int(os.environ.get("DFLASH_GATE_TENSOR_PARALLEL_SIZE", "2")),
        help="ranks of the tensor-parallel gates' process group (gloo, one process each; "
        "default 2) (env DFLASH_GATE_TENSOR_PARALLEL_SIZE)",
    )
    group.addoption(
        "--gate-max-tokens",
        type=int,
        default=int(os.environ.get("DFLASH_GATE_MAX_TOKENS", "0")) or None,
        help="tokens generated per prompt for a user's pair (default 128) (env DFLASH_GATE_MAX_TOKENS)",
    )
