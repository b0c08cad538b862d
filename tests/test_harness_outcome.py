"""The harness fails loudly and resumes honestly (harness/__main__.py, outcome.py, resume.py,
arguments.py): a dead server or failed requests give exit status 1 with one line on stderr,
bad arguments are refused at once, --resume measures failed and incomplete runs again
without duplicating a row (torn lines tolerated), and Ctrl-C keeps what was measured."""

from __future__ import annotations

import argparse
import csv
import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from harness import arguments
from harness.__main__ import main
from harness.outcome import verdict_line
from harness.resume import (
    ResumeConflict,
    check_saved_identity,
    differences,
    failure_rate,
    prepare,
    read_request_rows,
    trim_torn_tail,
)

from .server_process import REPO, free_port, sigint_as_default
from .sse_stub import Script, serve

CHUNKS = [(0.0, [1]), (0.0, [2, 3])]
RUN = ["--concurrency", "1,2", "--num-prompts", "4", "--output-len", "3", "--warmup", "0", "--input-len", "4"]


def harness(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness", *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def keys(out: Path) -> list[tuple]:
    rows, _ = read_request_rows(out / "requests.jsonl")
    return [(r["label"], r["concurrency"], r["repeat"], r["index"]) for r in rows]


def summary(out: Path) -> list[dict]:
    with (out / "summary.csv").open() as f:
        return list(csv.DictReader(f))


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# ------------------------------------------------------------------ exit status
def test_a_closed_port_fails_with_one_line_and_leaves_no_stub_folder(tmp_path, capsys) -> None:
    out = tmp_path / "dead"
    status = main(["bench", "--base-url", f"http://127.0.0.1:{free_port()}", *RUN, "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 1
    assert last_line(err).startswith("error: benchmark failed: no request completed")
    assert "ConnectError" in last_line(err) and "Traceback" not in err
    assert not out.exists()


def test_failed_requests_above_the_threshold_fail_the_benchmark_and_keep_the_files(tmp_path, capsys) -> None:
    server, url = serve(Script(CHUNKS, fail_every=4))
    try:
        out = tmp_path / "quarter"
        assert main(["bench", "--base-url", url, *RUN, "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert "runs failed more than --max-failure-rate 0" in last_line(err)
        assert "HTTP 500" in last_line(err)
        assert (out / "summary.csv").exists() and (out / "report.md").exists()
        # a quarter of the requests fail: tolerated under --max-failure-rate 0.3
        out = tmp_path / "tolerated"
        assert main(["bench", "--base-url", url, *RUN, "--max-failure-rate", "0.3", "--out", str(out)]) == 0
    finally:
        server.shutdown()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--concurrency", "0"], "concurrency must be >= 1, got 0"),
        (["--concurrency", "1,x"], "expected comma-separated whole numbers"),
        (["--output-len", "0"], "expected a whole number >= 1, got 0"),
        (["--num-prompts", "-2"], "expected a whole number >= 1, got -2"),
        (["--max-failure-rate", "2"], "expected a fraction in [0, 1], got 2.0"),
        (["--base-url", "http://127.0.0.1:99999"], "port must be in 1-65535, got 99999"),
        (["--base-url", "http://127.0.0.1:abc"], "not a valid URL"),
        (["--base-url", "127.0.0.1:8000"], "expected http://HOST[:PORT]"),
    ],
    ids=[
        "concurrency-0",
        "concurrency-text",
        "output-len-0",
        "num-prompts-negative",
        "failure-rate",
        "port-99999",
        "port-text",
        "no-scheme",
    ],
)
def test_bad_arguments_are_refused_at_once_without_a_traceback(argv, message, tmp_path) -> None:
    base = ["--base-url", "http://127.0.0.1:9"] if "--base-url" not in argv else []
    start = time.monotonic()
    done = harness("bench", *base, *argv, "--out", str(tmp_path / "x"), timeout=30)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - start < 20
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------ resume
def test_resume_measures_failed_and_interrupted_runs_again_without_duplicates(tmp_path) -> None:
    out = tmp_path / "run"
    script = Script(CHUNKS, fail_every=3)
    server, url = serve(script)
    argv = ["bench", "--base-url", url, *RUN, "--repeats", "2", "--out", str(out)]
    try:
        assert main(argv) == 1
        # an interrupt: the last summary row is gone and requests.jsonl ends in a torn line cut
        # inside a multi-byte character
        lines = (out / "summary.csv").read_text().splitlines(keepends=True)
        (out / "summary.csv").write_text("".join(lines[:-1]))
        with (out / "requests.jsonl").open("ab") as f:
            f.write('{"label": "A", "concurrency": 1, "repeat": 0, "error": "caf\u00e9'.encode()[:-1])
        script.fail_every = None  # the same server, healthy again
        assert main([*argv, "--resume"]) == 0
        rows = summary(out)
        assert sorted((r["concurrency"], r["repeat"]) for r in rows) == [
            ("1", "0"),
            ("1", "1"),
            ("2", "0"),
            ("2", "1"),
        ]
        assert all(r["failed"] == "0" and r["completed"] == "4" for r in rows)
        found = keys(out)
        assert len(found) == len(set(found)) == 2 * 2 * 4
        assert read_request_rows(out / "requests.jsonl")[1] == 0  # no torn line left
    finally:
        server.shutdown()
    # nothing left to do: a second resume sends nothing (the server is down on purpose)
    before = (out / "requests.jsonl").read_bytes()
    assert main([*argv, "--resume"]) == 0
    assert (out / "requests.jsonl").read_bytes() == before


def test_resume_refuses_rows_measured_with_another_server_or_workload(tmp_path, capsys) -> None:
    """A resumed run whose server or workload differs from the folder's would mix rows of two
    benchmarks under one summary: refused with one line, nothing sent, no file changed."""
    out = tmp_path / "run"
    server, url = serve(Script(CHUNKS))
    try:
        assert main(["bench", "--base-url", url, *RUN, "--out", str(out)]) == 0

        def files() -> dict:
            return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}

        before = files()
        for change, named in (
            (["--base-url", f"http://127.0.0.1:{free_port()}", *RUN], "base_url was"),
            (["--base-url", url, *RUN, "--output-len", "7"], "output_len was"),
            (["--base-url", url, *RUN, "--seed", "3"], "seed was"),
            (["--base-url", url, *RUN, "--server-kind", "openai"], "server_kind was"),
        ):
            capsys.readouterr()
            assert main(["bench", *change, "--resume", "--out", str(out)]) == 2
            last = capsys.readouterr().err.strip().splitlines()[-1]
            assert last.startswith("error: resume_conflict: ") and named in last, last
            assert files() == before
        # more repeats or concurrency levels are the same benchmark, continued
        assert len(summary(out)) == 2  # concurrency 1 and 2, one repeat
        assert main(["bench", "--base-url", url, *RUN, "--repeats", "2", "--resume", "--out", str(out)]) == 0
        assert len(summary(out)) == 4
    finally:
        server.shutdown()


def test_a_run_without_resume_into_a_folder_with_rows_is_refused(tmp_path, capsys) -> None:
    """Without --resume a second benchmark would append its rows to the first's and overwrite
    what they were measured with: refused, nothing sent, no file changed."""
    out = tmp_path / "run"
    server, url = serve(Script(CHUNKS))
    try:
        assert main(["bench", "--base-url", url, *RUN, "--out", str(out)]) == 0
        before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}
        capsys.readouterr()
        assert main(["bench", "--base-url", url, *RUN, "--seed", "4", "--out", str(out)]) == 2
        assert "already holds measured rows" in capsys.readouterr().err
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"} == before
    finally:
        server.shutdown()


def test_resume_refuses_rows_that_say_nothing_of_what_they_were_measured_with(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    server, url = serve(Script(CHUNKS))
    try:
        assert main(["bench", "--base-url", url, *RUN, "--out", str(out)]) == 0
        (out / "bench_run.json").unlink()
        assert main(["bench", "--base-url", url, *RUN, "--resume", "--out", str(out)]) == 2
        assert "no bench_run.json says what they were measured with" in capsys.readouterr().err
    finally:
        server.shutdown()


def test_read_request_rows_drops_a_torn_last_line_and_keeps_the_rest(tmp_path) -> None:
    path = tmp_path / "requests.jsonl"
    good = [{"label": "A", "index": i, "text": "\u00e9\u4e2d"} for i in range(3)]
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in good).encode()
    path.write_bytes(data + '{"label": "A", "index": 3, "text": "\u4e2d'.encode("utf-8")[:-2])
    rows, dropped = read_request_rows(path)
    assert rows == good and dropped == 1


# ------------------------------------------------------------------ interrupt
def test_ctrl_c_ends_with_one_line_and_keeps_every_measured_row(tmp_path) -> None:
    server, url = serve(Script([(0.0, [1]), (0.3, [2])]))
    out = tmp_path / "interrupted"
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "harness",
                "bench",
                "--base-url",
                url,
                "--concurrency",
                "1",
                "--num-prompts",
                "50",
                "--warmup",
                "0",
                "--output-len",
                "2",
                "--out",
                str(out),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=sigint_as_default,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(keys(out) if out.exists() else []) < 2:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        server.shutdown()
    assert proc.returncode == 130
    assert "Traceback" not in err
    assert last_line(err).startswith("interrupted: ")
    found = keys(out)
    assert len(found) >= 2 and f"{len(found)} measured requests kept" in last_line(err)
    assert Counter(found).most_common(1)[0][1] == 1


# ------------------------------------------------------------------ A/B labels and prompts
def test_ab_names_the_sides_and_sends_the_whole_dataset_at_every_concurrency(tmp_path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(5)))
    a, a_url = serve(Script(CHUNKS))
    b, b_url = serve(Script(CHUNKS))
    out = tmp_path / "ab"
    try:
        assert (
            main(
                [
                    "ab",
                    "--a-url",
                    a_url,
                    "--b-url",
                    b_url,
                    "--a-label",
                    "plain",
                    "--b-label",
                    "dflash",
                    "--dataset",
                    str(dataset),
                    "--concurrency",
                    "1,2,8",
                    "--warmup",
                    "1",
                    "--output-len",
                    "3",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
    finally:
        a.shutdown()
        b.shutdown()
    assert json.loads((out / "meta.json").read_text())["labels"] == {"A": "plain", "B": "dflash"}
    # the whole set at every level, repeated up to the highest concurrency (8 -> 2 x 5)
    assert {(r["concurrency"], int(r["completed"])) for r in summary(out)} == {
        ("1", 10),
        ("2", 10),
        ("8", 10),
    }
    report = (out / "report.md").read_text()
    assert "A is **plain**, B is **dflash**." in report
    assert "Outputs identical: 30/30 requests" in report


# ------------------------------------------------------------------ resume, unit by unit
def test_a_resume_conflict_names_four_differences_and_counts_the_rest(tmp_path) -> None:
    """The conflict line names at most four differences and says how many more there were;
    with exactly four it names them all and claims no more."""
    path = tmp_path / "bench_run.json"
    path.write_text(json.dumps({k: 1 for k in "abcdef"}))
    with pytest.raises(ResumeConflict) as six:
        check_saved_identity(path, {k: 2 for k in "abcdef"}, "held", "differ", "made", "again")
    assert "a was 1, now 2; b was 1, now 2; c was 1, now 2; d was 1, now 2 (and 2 more)" in str(six.value)
    path.write_text(json.dumps({k: 1 for k in "abcd"}))
    with pytest.raises(ResumeConflict) as four:
        check_saved_identity(path, {k: 2 for k in "abcd"}, "held", "differ", "made", "again")
    assert str(four.value) == "differ: a was 1, now 2; b was 1, now 2; c was 1, now 2; d was 1, now 2; again"


def test_differences_name_the_command_first_then_the_rest_by_name() -> None:
    """The subcommand is the plainest difference, so it leads; nested keys read as `a.b`."""
    saved = {"seed": 1, "command": "bench", "a": {"x": 1}}
    now = {"seed": 2, "command": "ab", "a": {"x": 3}}
    assert differences(saved, now) == [
        "command was 'bench', now 'ab'",
        "a.x was 1, now 3",
        "seed was 1, now 2",
    ]


def _summary_row(label: str, concurrency: int, completed: int, failed: int) -> dict:
    return {"label": label, "concurrency": concurrency, "repeat": 0, "completed": completed, "failed": failed}


def test_prepare_keeps_whole_runs_within_the_threshold_and_measures_the_rest_again(tmp_path) -> None:
    """A run is done when its failure rate is at most the threshold (equal counts) and its
    requests add up to the planned number exactly (more is not whole either); the last copy
    of a request row wins; `redo` names only the planned runs that left rows behind."""
    rows = [
        _summary_row("A", 1, 3, 1),  # 1/4 failed, at the threshold: done
        _summary_row("A", 2, 5, 0),  # five requests where four were planned: measured again
        _summary_row("A", 4, 2, 2),  # half failed: measured again
    ]
    with (tmp_path / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    requests = [
        {"label": "A", "concurrency": 1, "repeat": 0, "index": 0, "text": "first"},
        {"label": "A", "concurrency": 1, "repeat": 0, "index": 0, "text": "second"},
        {"label": "A", "concurrency": 2, "repeat": 0, "index": 0, "text": "gone"},
    ]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    planned = {("A", 1, 0): 4, ("A", 2, 0): 4, ("A", 4, 0): 4, ("A", 8, 0): 4}
    resumed = prepare(tmp_path, planned, max_failure_rate=0.25)
    assert resumed.done == {("A", 1, 0)}
    assert resumed.redo == {("A", 2, 0), ("A", 4, 0)}  # A c=8 left nothing behind
    assert resumed.dropped_lines == 0
    kept, dropped = read_request_rows(tmp_path / "requests.jsonl")
    assert [r["text"] for r in kept] == ["second"] and dropped == 0
    assert [(r["concurrency"], r["completed"]) for r in summary(tmp_path)] == [("1", "3")]


def test_a_whole_requests_file_drops_no_line_and_a_torn_tail_is_cut_at_the_last_newline(tmp_path) -> None:
    """The newline that ends the last row is no torn line; trim_torn_tail keeps every whole
    row, its newline included, so the next append starts a fresh line."""
    path = tmp_path / "requests.jsonl"
    path.write_text('{"index": 0}\n{"index": 1}\n')
    assert read_request_rows(path) == ([{"index": 0}, {"index": 1}], 0)
    assert trim_torn_tail(path) is False
    path.write_bytes(b'{"index": 0}\n{"ind')
    assert trim_torn_tail(path) is True
    assert path.read_bytes() == b'{"index": 0}\n'


def test_a_run_that_sent_no_request_counts_as_failed() -> None:
    """A summary row with no completed and no failed request is a failed run (rate 1.0),
    so the benchmark fails even when another run completed every request."""
    rows = [_summary_row("A", 1, 4, 0), _summary_row("A", 2, 0, 0)]
    assert failure_rate(rows[1]) == 1.0
    line = verdict_line(rows, max_failure_rate=0.5)
    assert line is not None and line.startswith("benchmark failed: 1 of 2 runs failed"), line


def test_argument_types_take_their_bounds_and_refuse_one_past_them() -> None:
    """The bounds themselves are valid: a failure rate of 0 or 1, a port of 1 or 65535, one
    request; one past them (a rate above 1, port 0 or 65536, zero) is refused."""
    assert (arguments.rate("0"), arguments.rate("1")) == (0.0, 1.0)
    assert arguments.base_url("http://127.0.0.1:1") == "http://127.0.0.1:1"
    assert arguments.base_url("http://127.0.0.1:65535") == "http://127.0.0.1:65535"
    assert arguments.positive_int("1") == 1 and arguments.concurrency_list("1,4") == [1, 4]
    assert arguments.positive_float("0.5") == 0.5
    for convert, text, message in (
        (arguments.rate, "1.01", "expected a fraction in [0, 1], got 1.01"),
        (arguments.base_url, "http://127.0.0.1:0", "port must be in 1-65535, got 0"),
        (arguments.base_url, "http://127.0.0.1:65536", "port must be in 1-65535, got 65536"),
        (arguments.positive_int, "0", "expected a whole number >= 1, got 0"),
        (arguments.positive_float, "0", "expected a number > 0, got 0.0"),
        (arguments.concurrency_list, "2,0", "concurrency must be >= 1, got 0"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
            convert(text)


def test_the_verdict_names_four_failed_runs_and_counts_the_rest() -> None:
    """The verdict line counts the failed runs out of all, names the first four with their
    failed/sent counts, and says how many more there were."""
    rows = [_summary_row("A", c, 3, 1) for c in (1, 2, 4, 8, 16, 32)] + [_summary_row("A", 64, 4, 0)]
    rows[0]["errors"] = "HTTP 500: boom"
    line = verdict_line(rows, max_failure_rate=0.1)
    assert line == (
        "benchmark failed: 6 of 7 runs failed more than --max-failure-rate 0.1 of their requests "
        "(A c=1 r=0 1/4, A c=2 r=0 1/4, A c=4 r=0 1/4, A c=8 r=0 1/4 and 2 more); first error: HTTP 500: boom"
    )
    assert verdict_line(rows[-1:], max_failure_rate=0.1) is None


def test_a_benchmark_in_which_no_request_completed_fails_whatever_the_threshold() -> None:
    """Even under --max-failure-rate 1 (every failure tolerated), a benchmark with no
    completed request at all has measured nothing: it fails."""
    rows = [_summary_row("A", 1, 0, 4)]
    assert verdict_line(rows, max_failure_rate=1.0) == "benchmark failed: no request completed"
    assert verdict_line([], max_failure_rate=1.0) is None
