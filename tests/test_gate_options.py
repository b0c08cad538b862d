"""The gates run on checkpoints a user already has: --target-model / --draft-model /
--gate-device / --gate-dtype (or the DFLASH_GATE_* environment variables) point the same
gate suite at them. Here the "user's" checkpoints are tiny ones on disk, in float32."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .together import Results, together

REPO = Path(__file__).resolve().parents[1]


def run_gates(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


USER_PROMPTS = (
    '{"prompt": "def f(x):"}\n{"prompt": "2 + 2 ="}\n{"messages": [{"role": "user", "content": "hello"}]}\n'
)


@pytest.fixture(scope="module")
def runs(request, tiny_pair, tmp_path_factory) -> Results:
    """The two gate runs below, side by side in the background (tests/together.py)."""

    def by_options() -> subprocess.CompletedProcess:
        target, draft = tiny_pair("qwen3_5", block_size=4)
        prompts = tmp_path_factory.mktemp("options") / "prompts.jsonl"
        prompts.write_text(USER_PROMPTS)
        return run_gates(
            [
                "-q",
                "gates/test_lossless_greedy.py",
                "gates/test_state_equality.py",
                "-k",
                "grid and replay or state_after_each_commit and replay",
                "--target-model",
                str(target),
                "--draft-model",
                str(draft),
                "--gate-device",
                "cpu",
                "--gate-dtype",
                "float32",
                "--gate-prompts",
                str(prompts),
                "--gate-max-tokens",
                "12",
            ]
        )

    def by_environment() -> subprocess.CompletedProcess:
        target, draft = tiny_pair("qwen3", block_size=4)
        return run_gates(
            ["gates/test_lossless_greedy.py", "-k", "first_token", "-v"],
            env={
                "DFLASH_GATE_TARGET": str(target),
                "DFLASH_GATE_DRAFT": str(draft),
                "DFLASH_GATE_DTYPE": "float32",
                "DFLASH_GATE_MAX_TOKENS": "8",
            },
        )

    # the pairs are written here, once, before the jobs read them
    tiny_pair("qwen3_5", block_size=4)
    tiny_pair("qwen3", block_size=4)
    return together(
        request,
        {
            "test_gates_run_on_user_checkpoints_given_by_options": by_options,
            "test_gates_read_the_environment_variables": by_environment,
        },
    )


def test_gates_run_on_user_checkpoints_given_by_options(runs, request) -> None:
    # the lossless grid and the state check at replay, on the qwen3_5 pair, by options
    done = runs[request.node.name]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
    # blocks larger than the user's draft supports are skipped, not failed
    assert "skipped" in done.stdout


def test_gates_read_the_environment_variables(runs, request) -> None:
    # the first-token test on the qwen3 pair, by DFLASH_GATE_* variables
    done = runs[request.node.name]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "[user]" in done.stdout


class Options:
    def __init__(self, **values) -> None:
        self.values = values

    def getoption(self, name: str):
        return self.values.get(name)


def test_a_user_pair_runs_32_prompts_of_the_mixed_set_by_default(tiny_checkpoint) -> None:
    from gates.prompts import gate_prompt_ids
    from harness.workloads import builtin
    from reference_engine.tokenizer import load_tokenizer

    target = tiny_checkpoint("qwen3")
    ids = gate_prompt_ids(Options(**{"--target-model": str(target)}), target, 32)
    assert len(ids) == 32 and all(ids)
    first = builtin("mixed")[0]
    text = first.text if first.text is not None else "\n".join(m["content"] for m in first.messages)
    assert ids[0] == load_tokenizer(target).encode(text).ids


def test_gate_prompts_take_ids_text_or_messages_and_the_demo_is_the_default(
    tiny_checkpoint, tmp_path
) -> None:
    from gates.prompts import gate_prompt_ids
    from reference_engine.demo import demo_prompts

    target = tiny_checkpoint("qwen3")
    rows = tmp_path / "ids.jsonl"
    rows.write_text('{"prompt_ids": [5, 6, 7]}\n\n{"prompt_ids": [9]}\n')
    assert gate_prompt_ids(Options(**{"--gate-prompts": str(rows)}), target, 32) == [[5, 6, 7], [9]]
    mixed = tmp_path / "mixed.jsonl"  # a prompt given as token ids, beside a text prompt
    mixed.write_text('{"prompt": [4, 8]}\n{"prompt": "the model"}\n')
    got = gate_prompt_ids(Options(**{"--gate-prompts": str(mixed)}), target, 32)
    assert got[0] == [4, 8] and got[1] and all(isinstance(t, int) for t in got[1])
    demo = gate_prompt_ids(Options(), target, 32)
    assert demo == [row["prompt_ids"] for row in demo_prompts()][:32] and len(demo) == 32
