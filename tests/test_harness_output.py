"""Result files that survive (harness/output.py, resume.py, ab.py, scripts/profile.sh): every
command checks its output folder before it runs and fails with one line when it cannot be
made, written or has no room, or when another run holds it; a disk that fills during a run
ends with one line, not a traceback; --resume repairs the summary.csv a full disk left
behind; a server that dies while starting has its last output printed."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.__main__ import main
from harness.output import OutputError, claim

from .server_process import REPO, free_port
from .sse_stub import Script, serve

CHUNKS = [(0.0, [1]), (0.0, [2, 3])]
RUN = ["--concurrency", "1,2", "--num-prompts", "4", "--output-len", "3", "--warmup", "0", "--input-len", "4"]
DEAD = f"http://127.0.0.1:{free_port()}"
PROFILE = REPO / "scripts" / "profile.sh"


@pytest.fixture(scope="module")
def stub():
    server, url = serve(Script(CHUNKS))
    yield url
    server.shutdown()


def harness(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness", *argv], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


COMMANDS = {
    "bench": ["bench", "--base-url", DEAD, *RUN],
    "ab": ["ab", "--a-url", DEAD, "--b-url", DEAD, *RUN],
    "compare": ["compare", "--baseline", DEAD, "--candidate", DEAD, "--builtin", "math"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_folder_that_cannot_be_made_fails_with_one_line(tmp_path, command: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = harness(*COMMANDS[command], "--out", str(blocker / "out"))
    assert done.returncode == 2
    assert one_error_line(done.stderr).startswith("error: cannot create the output folder")


def test_an_output_folder_without_room_is_refused_before_the_run(tmp_path) -> None:
    with pytest.raises(OutputError, match="MiB free; a run needs at least"):
        claim(tmp_path / "out", min_free_bytes=2**62)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_another_run_holds_is_refused_naming_it(tmp_path, command: str) -> None:
    out = tmp_path / "out"
    hold = claim(out)
    try:
        done = harness(*COMMANDS[command], "--out", str(out))
    finally:
        hold.release()
    assert done.returncode == 2
    line = one_error_line(done.stderr)
    assert "is in use by another run" in line and f"pid {os.getpid()}" in line


def test_a_released_folder_can_be_claimed_again(tmp_path) -> None:
    claim(tmp_path).release()
    claim(tmp_path).release()


def test_a_disk_that_fills_during_the_run_ends_with_one_line(tmp_path, stub, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "requests.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    assert main(["bench", "--base-url", stub, *RUN, "--out", str(out)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "No space left on device" in line and str(out) in line


def summary_rows(out: Path) -> list[dict]:
    with (out / "summary.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(
    "left",
    [b"", b"label,concurr", None],
    ids=["empty", "torn-header", "torn-row"],
)
def test_resume_repairs_the_summary_a_full_disk_left(tmp_path, stub, capsys, left: bytes | None) -> None:
    out = tmp_path / "out"
    assert main(["bench", "--base-url", stub, *RUN, "--out", str(out)]) == 0
    summary = out / "summary.csv"
    if left is None:
        left = summary.read_bytes()[:-20]  # the last row cut short
    summary.write_bytes(left)
    assert main(["bench", "--base-url", stub, *RUN, "--resume", "--out", str(out)]) == 0
    assert "resume: summary.csv" in capsys.readouterr().err
    rows = summary_rows(out)
    assert sorted((r["concurrency"], r["completed"]) for r in rows) == [("1", "4"), ("2", "4")]
    assert (out / "report.md").is_file()


def test_an_empty_summary_gets_its_header_without_resume(tmp_path, stub) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.csv").write_bytes(b"")
    assert main(["bench", "--base-url", stub, *RUN, "--out", str(out)]) == 0
    assert len(summary_rows(out)) == 2


def test_a_server_that_dies_while_starting_has_its_last_output_printed(tmp_path) -> None:
    # the reason is put together as it runs, so it cannot come from the command line echoed
    dies = f"{sys.executable} -c \"import sys; print('loading'); sys.exit('no such ' + 'model')\""
    done = harness("ab", "--a-cmd", dies, "--b-url", DEAD, *RUN, "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "exited with 1 before it became healthy" in done.stderr
    assert "no such model" in done.stderr and "Traceback" not in done.stderr


def run_profile(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NSYS": "none", "PYTHON": sys.executable}
    return subprocess.run(
        ["/bin/bash", str(PROFILE), *args, "--random-shape", "qwen3-small"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )


def test_profile_refuses_an_output_folder_it_cannot_make_with_one_line(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = run_profile("--out", str(blocker / "out"))
    assert done.returncode == 2
    assert one_error_line(done.stderr).startswith("error: cannot create the output folder")


def test_profile_refuses_a_folder_another_run_holds(tmp_path) -> None:
    hold = claim(tmp_path)
    try:
        done = run_profile("--out", str(tmp_path))
    finally:
        hold.release()
    assert done.returncode == 2
    assert "is in use by another run" in one_error_line(done.stderr)


def test_the_room_refusal_gives_the_free_space_and_the_need_in_mib(tmp_path) -> None:
    """The refusal's figures are MiB: the folder's free space as the system reports it and
    the space asked for."""
    with pytest.raises(OutputError) as refused:
        claim(tmp_path / "out", min_free_bytes=2**50)
    free_mib = float(re.search(r"has ([0-9.]+) MiB free", str(refused.value))[1])
    assert free_mib == pytest.approx(shutil.disk_usage(tmp_path).free / 2**20, rel=0.05)
    assert f"a run needs at least {2**30} MiB" in str(refused.value)


def test_the_lock_file_names_only_the_current_holder(tmp_path) -> None:
    """Each claim rewrites DIR/.lock with its own pid line, so a refusal names the process
    that holds the folder now, not every one that held it before."""
    claim(tmp_path).release()
    hold = claim(tmp_path)
    try:
        lines = (tmp_path / ".lock").read_text().splitlines()
    finally:
        hold.release()
    assert len(lines) == 1 and lines[0].startswith(f"pid {os.getpid()} since ")
