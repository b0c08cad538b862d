"""The Makefile's `make bench` draft switch: BENCH_DRAFT=dflash2 stops with one line while no
DFlash2 demo draft ships, and BENCH_DRAFT=DIR gives side B that draft folder (read from
`make -n`, so no server starts)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", "bench", f"PYTHON={sys.executable}", "BENCH_DEVICE=cpu", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_bench_draft_dflash2_is_the_shipped_dflash2_demo_draft() -> None:
    assert (ROOT / "reference_engine/assets/demo/draft-dflash2/config.json").is_file()
    plan = make("-n", "BENCH_DRAFT=dflash2").stdout
    assert "--dflash-draft-model-path reference_engine/assets/demo/draft-dflash2 " in plan
    assert "--b-label dflash2" in plan


def test_bench_draft_dir_is_side_bs_draft_and_a_missing_one_is_refused(tmp_path: Path) -> None:
    plan = make("-n", f"BENCH_DRAFT={tmp_path}").stdout
    assert f"--dflash-draft-model-path {tmp_path} " in plan
    default = make("-n").stdout
    assert "--dflash-draft-model-path reference_engine/assets/demo/draft " in default
    run = make(f"BENCH_DRAFT={tmp_path}")
    assert run.returncode == 2
    assert run.stderr.startswith(f"make bench: BENCH_DRAFT={tmp_path}: no config.json in {tmp_path}")


def test_side_b_times_its_verify_widths_on_the_cpu_only() -> None:
    """On the CPU side B measures its step costs at start-up (plain steps among the verify
    widths); BENCH_STEP_COSTS= runs the flat table; on CUDA the graphs time the widths."""

    def sides(*args: str) -> tuple[str, str]:
        plan = make("-n", *args).stdout
        a, b = plan.split("--a-cmd", 1)[1].split("--b-cmd", 1)
        return a, b.split("--a-label", 1)[0]

    a, b = sides()
    assert "--measure-step-costs" in b and "--measure-step-costs" not in a
    assert "--measure-step-costs" not in sides("BENCH_STEP_COSTS=")[1]
    assert "--measure-step-costs" not in sides("BENCH_DEVICE=cuda")[1]
