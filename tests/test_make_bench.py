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


def test_bench_draft_dflash2_stops_with_one_line_while_no_dflash2_demo_draft_ships() -> None:
    assert not (ROOT / "reference_engine/assets/demo/draft-dflash2").exists()
    run = make("BENCH_DRAFT=dflash2")
    assert run.returncode == 2
    first = run.stderr.splitlines()[0]
    assert first.startswith("make bench: BENCH_DRAFT=dflash2: no DFlash2 demo draft ships yet")
    assert "docs/demo-pair.md" in first and run.stdout == ""


def test_bench_draft_dir_is_side_bs_draft_and_a_missing_one_is_refused(tmp_path: Path) -> None:
    plan = make("-n", f"BENCH_DRAFT={tmp_path}").stdout
    assert f"--dflash-draft-model-path {tmp_path} " in plan
    default = make("-n").stdout
    assert "--dflash-draft-model-path reference_engine/assets/demo/draft " in default
    run = make(f"BENCH_DRAFT={tmp_path}")
    assert run.returncode == 2
    assert run.stderr.startswith(f"make bench: BENCH_DRAFT={tmp_path}: no config.json in {tmp_path}")
