"""`python -m reports profile DIR` (reports/profile.py) and scripts/profile.sh: profile.md
with plain and DFlash side by side per concurrency, the stacked phase plot, a rebuild that
gives the same bytes; the script's clear exit 2 without nsys, and its CPU timer path."""

from __future__ import annotations

import csv
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from reports.__main__ import main
from reports.phases import PhaseTimes
from reports.profile import build_profile, draw_breakdown, kernel_summary

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "nsys"
SCRIPT = ROOT / "scripts" / "profile.sh"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NSYS_FOLDERS = (
    "/opt/nvidia/nsight-systems/*/bin/nsys",
    "/opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys",
    "/usr/local/cuda*/bin/nsys",
    "/usr/local/cuda*/nsight-systems*/bin/nsys",
)
TINY_WORKLOAD = [
    "--random-shape",
    "qwen3-small",
    "--dtype",
    "float32",
    "--device",
    "cpu",
    "--input-len",
    "8",
    "--output-len",
    "8",
    "--repeats",
    "1",
    "--oracle-acceptance",
    "4",
]


@pytest.fixture
def captures(tmp_path: Path) -> Path:
    directory = tmp_path / "profile-run"
    shutil.copytree(FIXTURES, directory)
    return directory


def test_the_cli_builds_profile_md_and_the_plot_from_nsys_csvs(
    captures: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["profile", str(captures)]) == 0
    assert capsys.readouterr().out.strip() == str(captures / "profile.md")
    text = (captures / "profile.md").read_text()
    assert "Source: Nsight Systems." in text and "## Concurrency 1" in text
    # baseline and DFlash side by side, per output token (the benchmark CSVs are there)
    assert "| Phase | plain ms/token | plain % of step | plain GPU ms/token | dflash ms/token |" in text
    for label in ("plain-c1", "dflash-c1"):
        assert f"### {label}" in text
    assert "| **step (total)** |" in text and "| other |" in text
    assert "sample (inside prefill, decode; not summed)" in text
    assert "All kernels: " in text and "% of the step time. Top 10 by total time:" in text
    assert "](plots/phase_breakdown.png)" in text and "ms per output token" in text
    assert (captures / "plots" / "phase_breakdown.png").read_bytes()[:8] == PNG_MAGIC


def test_kernel_time_past_the_step_time_is_flagged_as_work_outside_the_steps(
    captures: Path,
) -> None:
    """A capture holding more kernel time than step time (graph capture or a warm-up inside
    the range) says so on that run's kernel line, and only there."""
    build_profile(captures)
    assert "More kernel time than step time" not in (captures / "profile.md").read_text()
    kernels = captures / "dflash-c1_cuda_gpu_kern_sum.csv"
    with open(kernels, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:  # a hundred times the GPU time of every kernel
        row["Total Time (ns)"] = str(int(row["Total Time (ns)"]) * 100)
    with open(kernels, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    build_profile(captures)
    text = (captures / "profile.md").read_text()
    flagged = [line for line in text.splitlines() if "More kernel time than step time" in line]
    assert len(flagged) == 1
    dflash_c1 = text[text.index("### dflash-c1") : text.index("## Concurrency 8")]
    assert flagged[0] in dflash_c1 and flagged[0].startswith("All kernels: ")


def test_rebuilding_gives_the_same_bytes(captures: Path) -> None:
    build_profile(captures)
    first = {p: p.read_bytes() for p in captures.rglob("*") if p.is_file()}
    build_profile(captures)
    assert {p: p.read_bytes() for p in captures.rglob("*") if p.is_file()} == first


def test_without_token_counts_the_tables_are_in_ms_and_the_plot_per_step(captures: Path) -> None:
    for label in ("plain-c1", "dflash-c1"):
        (captures / f"{label}.csv").unlink()
    text = build_profile(captures).read_text()
    assert "| Phase | plain ms | plain % of step |" in text
    assert "ms per engine step" in text


def test_a_directory_with_nothing_to_profile_exits_2_with_one_error_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "reports", "profile", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: nothing to profile") and len(done.stderr.splitlines()) == 1


def run_script(args: list[str], env: dict[str, str], timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["/bin/bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout
    )


def test_without_nsys_the_script_says_how_to_get_it_and_exits_2(tmp_path: Path) -> None:
    done = run_script(
        ["--out", str(tmp_path / "out"), *TINY_WORKLOAD],
        {"PATH": str(tmp_path / "empty"), "NSYS": str(tmp_path / "nowhere" / "nsys")},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: nsys (Nsight Systems) not found: NSYS=")
    assert "install Nsight Systems" in done.stderr and "make profile NSYS=none" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(any(glob.glob(p) for p in NSYS_FOLDERS), reason="nsys is installed here")
def test_with_nsys_nowhere_the_script_lists_where_it_looked(tmp_path: Path) -> None:
    done = run_script(TINY_WORKLOAD, {"PATH": str(tmp_path / "empty")})
    assert done.returncode == 2
    assert "not on PATH, NSYS unset, and none in /opt/nvidia/nsight-systems/*/bin/nsys" in done.stderr


def test_workload_arguments_the_script_owns_are_refused(tmp_path: Path) -> None:
    done = run_script([*TINY_WORKLOAD, "--concurrency", "4"], {"PATH": os.environ["PATH"], "NSYS": "none"})
    assert done.returncode == 2 and "--concurrency is set by scripts/profile.sh" in done.stderr


def test_the_timer_path_needs_no_nsys_and_writes_profile_md(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "NSYS": "none", "PYTHON": sys.executable}
    done = run_script(["--out", str(out), "--concurrency", "1", "--threads", "1", *TINY_WORKLOAD], env)
    assert done.returncode == 0, done.stderr
    assert "# OMP_NUM_THREADS=1 (torch threads per operator)" in (out / "commands.txt").read_text()
    text = (out / "profile.md").read_text()
    assert "Source: built-in phase timer." in text
    assert "| Phase | plain ms/token | plain % of step | dflash ms/token | dflash % of step |" in text
    assert "scripts/bench_engine.py --concurrency 1 --out" in text  # the commands it ran
    assert (out / "plots" / "phase_breakdown.png").read_bytes()[:8] == PNG_MAGIC
    assert (out / "bench.csv").is_file() and (out / "bench.log").is_file()


def test_the_kernel_line_counts_the_kernels_shown_and_long_names_are_cut_to_90_characters(
    captures: Path,
) -> None:
    """With --top-kernels past the number of kernels, the kernel line says how many are
    shown (all of them); a kernel name longer than 90 characters is cut to 89 and an
    ellipsis, 90 in all."""
    with open(captures / "plain-c1_cuda_gpu_kern_sum.csv", newline="") as f:
        names = [row["Name"] for row in csv.DictReader(f)]
    text = build_profile(captures, top=1000).read_text()
    plain_c1 = text[text.index("### plain-c1") : text.index("## Concurrency 8")]
    assert f"Top {len(names)} by total time:" in plain_c1
    long_name = next(n for n in names if len(n) > 90)
    assert f"| `{long_name[:89]}…` |" in plain_c1


def test_a_concurrency_where_one_run_has_no_token_count_is_shown_in_ms(captures: Path) -> None:
    """Per-token figures need every run of the concurrency to know its tokens: with one
    run's benchmark CSV gone, that concurrency's side-by-side table is in ms."""
    (captures / "plain-c1.csv").unlink()
    text = build_profile(captures).read_text()
    assert "| Phase | plain ms | plain % of step | plain GPU ms | dflash ms |" in text
    assert (
        "| Phase | plain ms/token | plain % of step | plain GPU ms/token | dflash ms/token |" in text
    )  # c=8


def test_kernel_time_equal_to_the_step_time_is_not_flagged() -> None:
    """Only kernel time past the step time is flagged; a GPU busy for exactly the step time
    (100%) is not work outside the steps."""
    kernels = pd.DataFrame({"kernel": ["gemm", "copy"], "instances": [3, 1], "total_ms": [6.0, 2.0]})

    def line(step_ms: float) -> str:
        times = PhaseTimes("plain-c1", "plain", 1, "nsys", step_ms, {"decode": step_ms}, kernels=kernels)
        return kernel_summary(times, 10)

    assert (
        line(8.0)
        == "All kernels: 8.00 ms of GPU time in 4 launches, 100.0% of the step time. Top 2 by total time:"
    )
    assert "More kernel time than step time" in line(7.5)


def test_only_a_negative_other_is_named_as_drawn_at_zero(tmp_path: Path) -> None:
    """The caption names the runs whose `other` (step minus the top-level phases) is below
    zero; a step the phases fill exactly has `other` 0 and is not named."""
    exact = PhaseTimes("plain-c1", "plain", 1, "timer", 10.0, {"decode": 6.0, "schedule": 4.0})
    over = PhaseTimes("dflash-c1", "dflash", 1, "timer", 10.0, {"verify": 8.0, "draft": 4.0})
    caption = draw_breakdown(tmp_path / "exact.png", [exact])
    assert "negative" not in caption
    caption = draw_breakdown(tmp_path / "both.png", [exact, over])
    assert caption.endswith(" A negative `other` is drawn as 0 (dflash-c1).")
