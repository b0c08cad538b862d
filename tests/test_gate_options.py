"""The gates run on checkpoints a user already has: --target-model / --draft-model /
--gate-device / --gate-dtype (or the DFLASH_GATE_* environment variables) point the same
gate suite at them. Here the "user's" checkpoints are tiny ones on disk, in float32."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from reference_engine.checkpoint import make_tiny_draft

REPO = Path(__file__).resolve().parents[1]


def run_gates(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, **(env or {})},
    )


def test_gates_run_on_user_checkpoints_given_by_options(tiny_checkpoint, tmp_path) -> None:
    target = tiny_checkpoint("qwen3_5")
    draft = make_tiny_draft(tmp_path / "draft", target, block_size=4)
    done = run_gates([
        "-q", "gates/test_lossless_greedy.py", "gates/test_state_equality.py",
        "-k", "grid and replay or state_after_each_commit and replay",
        "--target-model", str(target), "--draft-model", str(draft),
        "--gate-device", "cpu", "--gate-dtype", "float32",
    ])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
    # blocks larger than the user's draft supports are skipped, not failed
    assert "skipped" in done.stdout


def test_gates_read_the_environment_variables(tiny_checkpoint, tmp_path) -> None:
    target = tiny_checkpoint("qwen3")
    draft = make_tiny_draft(tmp_path / "draft", target, block_size=4)
    done = run_gates(
        ["gates/test_lossless_greedy.py", "-k", "first_token", "-v"],
        env={"DFLASH_GATE_TARGET": str(target), "DFLASH_GATE_DRAFT": str(draft),
             "DFLASH_GATE_DTYPE": "float32"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "[user]" in done.stdout
