"""scripts/bench_gpu_suite.sh refuses, in one line, to start without a CUDA device or with a part
it does not know; a dry run checks every command it issues."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def suite(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The suite writing to `out`, with PYTHON this interpreter unless `env` says otherwise."""
    return subprocess.run(
        ["bash", "scripts/bench_gpu_suite.sh", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin", **env},
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_suite_stops_with_one_line_without_a_gpu(tmp_path: Path) -> None:
    run = suite(tmp_path / "out")
    assert run.returncode == 2
    assert run.stderr == "bench_gpu_suite.sh: needs a CUDA device (torch sees none)\n"
    assert run.stdout == ""


def test_an_unknown_part_is_refused_before_anything_runs(tmp_path: Path) -> None:
    run = suite(tmp_path / "out", PARTS="long soak")
    assert run.returncode == 2
    assert run.stderr == (
        "bench_gpu_suite.sh: unknown part 'soak' (gates, long, sweep, 4b, bench, dflash2, reach)\n"
    )
    assert not (tmp_path / "out").exists()


def recording_python(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in for python that says there is a GPU and appends each command's arguments
    to a JSONL log, and that log."""
    log = tmp_path / "argv.jsonl"
    stub = tmp_path / "python"
    stub.write_text(
        "#!/bin/bash\n"
        'if [ "$1" = -c ]; then echo 1; exit 0; fi\n'
        f'"{sys.executable}" -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$@" >> "{log}"\n'
    )
    stub.chmod(0o755)
    return stub, log


def test_every_part_calls_the_benchmarks_with_options_they_take(tmp_path: Path) -> None:
    """A dry run: a stand-in for python says there is a GPU and records each command; every
    part runs, every engine benchmark's options parse, every harness run's too, and every
    gate file named exists. A renamed option would otherwise first fail on the GPU."""
    from harness.__main__ import parser as harness_parser
    from reference_engine.bench import BenchArgs

    stub, log = recording_python(tmp_path)
    run = suite(tmp_path / "out", "100000", PYTHON=str(stub), PARTS="gates long sweep 4b bench dflash2 reach")
    assert run.returncode == 0, run.stderr
    assert "skipped" not in run.stdout and "timed out" not in run.stdout, run.stdout
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    benches = [c[1:] for c in calls if c[0] == "scripts/bench_engine.py"]
    # long, sweep, 4b, dflash2 with graphs and eager, four reach shapes
    assert len(benches) == 9, calls
    for argv in benches:
        BenchArgs.parse(argv)  # exits with the parser's message on an unknown option
    harness_runs = [c[2:] for c in calls if c[:2] == ["-m", "harness"]]
    assert len(harness_runs) == 2  # make bench with each demo draft
    for argv in harness_runs:
        harness_parser().parse_args(argv)
    gates = [c for c in calls if c[:2] == ["-m", "pytest"]]
    assert len(gates) == 1 and all((ROOT / a).is_file() for a in gates[0] if a.startswith("gates/"))


def test_reach_shapes_picks_the_shapes(tmp_path: Path) -> None:
    """REACH_SHAPES runs the reach part on the shapes it names, in its order."""
    stub, log = recording_python(tmp_path)
    run = suite(
        tmp_path / "out", "100000", PYTHON=str(stub), PARTS="reach", REACH_SHAPES="llama3.1-8b qwen3-8b"
    )
    assert run.returncode == 0, run.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    shapes = [c[c.index("--random-shape") + 1] for c in calls if "--random-shape" in c]
    assert shapes == ["llama3.1-8b", "qwen3-8b"]
