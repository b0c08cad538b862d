"""scripts/bench_gpu_suite.sh refuses, in one line, to start without a CUDA device or with a part
it does not know."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_suite_stops_with_one_line_without_a_gpu(tmp_path: Path) -> None:
    run = subprocess.run(
        ["bash", "scripts/bench_gpu_suite.sh", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 2
    assert run.stderr == "bench_gpu_suite.sh: needs a CUDA device (torch sees none)\n"
    assert run.stdout == ""


def test_an_unknown_part_is_refused_before_anything_runs(tmp_path: Path) -> None:
    run = subprocess.run(
        ["bash", "scripts/bench_gpu_suite.sh", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "PARTS": "long soak"},
    )
    assert run.returncode == 2
    assert run.stderr == (
        "bench_gpu_suite.sh: unknown part 'soak' (gates, long, sweep, 4b, bench, dflash2, reach)\n"
    )
    assert not (tmp_path / "out").exists()
