"""Contracts of the A/B runner (harness/ab.py), a measured run (harness/load.py), workloads
(harness/workloads.py), resuming a results folder (harness/resume.py), the output folder
(harness/output.py), a benchmark's outcome (harness/outcome.py) and the CSV and plot reports
(reports/). Servers are stubs on loopback; every figure is checked against a value worked
out by hand."""

from __future__ import annotations

import asyncio
import csv
import json
import re
import statistics
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from harness.ab import RATIO_METRICS, bootstrap_ratio, ratios, server_info

AB_HEADER = ["metric", "concurrency", "a_median", "b_median", "ratio", "ci_low", "ci_high", "within_noise"]


def answering(status: int, body: str) -> tuple[ThreadingHTTPServer, str]:
    """A loopback server that answers every GET with `status` and `body`."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def side_rows(values: dict[str, tuple[float, ...]], concurrency: int = 1) -> list[dict]:
    """Summary rows, one per repeat, every ratio metric at the repeat's value."""
    return [
        {"label": label, "concurrency": concurrency, **dict.fromkeys(RATIO_METRICS, value)}
        for label, repeats in values.items()
        for value in repeats
    ]


def write_summary(directory: Path, rows: list[dict]) -> Path:
    """A summary.csv of these rows (columns: the union, in order of first appearance)."""
    directory.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with (directory / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return directory


def point(label: str, concurrency: int, repeat: int = 0, **fields) -> dict:
    return {"label": label, "concurrency": concurrency, "repeat": repeat, **fields}


# ---------------------------------------------------------------------------------------------
# A/B ratios and server information


def test_the_interval_resamples_each_side_with_its_own_number_of_repeats() -> None:
    """B's twenty repeats are resampled twenty at a time even when A has a single figure: the
    interval of the ratio of medians lies well inside B's range, not at its ends."""
    middle, low, high = bootstrap_ratio([1.0], [float(v) for v in range(1, 21)])
    assert middle == 10.5
    assert 4.0 < low < middle < high < 17.0


def test_the_b_median_of_a_ratio_row_is_the_median_of_bs_repeats(tmp_path) -> None:
    """ab.csv's B median is the median of B's repeats, not their mean (one slow repeat of
    three does not move it)."""
    rows = ratios(side_rows({"A": (10.0, 10.0, 10.0), "B": (20.0, 20.0, 80.0)}), tmp_path / "ab.csv")
    row = next(r for r in rows if r["metric"] == "output_tokens_per_s")
    assert row["a_median"] == 10.0 and row["b_median"] == 20.0 and row["ratio"] == 2.0
    with (tmp_path / "ab.csv").open() as f:
        written = {r["metric"]: r for r in csv.DictReader(f)}
    assert float(written["output_tokens_per_s"]["b_median"]) == 20.0


def test_a_baseline_repeat_of_zero_does_not_break_the_ratio(tmp_path) -> None:
    """A's repeats 0, 100, 100 have median 100: the ratio row is made (B/A = 1) and its
    interval holds the point, however many resamples of A draw the zero twice."""
    rows = ratios(side_rows({"A": (0.0, 100.0, 100.0), "B": (100.0, 100.0, 100.0)}), tmp_path / "ab.csv")
    row = next(r for r in rows if r["metric"] == "output_tokens_per_s")
    assert row["ratio"] == 1.0 and row["ci_low"] <= 1.0 <= row["ci_high"]


def test_server_info_keeps_only_the_keys_the_server_gives() -> None:
    """GET /info answered with some of the known keys: those are kept, the others are absent
    (not null), and keys the harness does not know are left out."""
    server, url = answering(200, json.dumps({"torch": "2.9", "device": "cpu", "colour": "blue"}))
    try:
        assert server_info(url) == {"torch": "2.9", "device": "cpu"}
        assert server_info(url + "/") == {"torch": "2.9", "device": "cpu"}
    finally:
        server.shutdown()


def test_server_info_of_an_error_status_is_empty() -> None:
    """A /info that answers 500 (with a JSON object) says nothing about the server."""
    server, url = answering(500, json.dumps({"torch": "2.9", "device": "cuda"}))
    try:
        assert server_info(url) == {}
    finally:
        server.shutdown()


@pytest.mark.parametrize("body", ["42", "null", '"torch device"', "[1, 2]", "not json"])
def test_server_info_that_is_not_an_object_is_empty(body: str) -> None:
    """A /info body that is JSON but not an object (a number, null, a string, a list), or not
    JSON at all, gives no fields and raises nothing."""
    server, url = answering(200, body)
    try:
        assert server_info(url) == {}
    finally:
        server.shutdown()


@pytest.mark.parametrize("status", [404, 401, 503])
def test_a_server_whose_health_check_does_not_answer_200_is_not_healthy(status: int) -> None:
    """Only a 200 from /health is healthy: a server that answers 404 (no such route), 401
    or 503 (still loading) until the deadline is refused with one line saying so."""
    from harness.ab import ManagedServer

    server, url = answering(status, "{}")
    try:
        with pytest.raises(RuntimeError) as refused:
            ManagedServer(url).wait_healthy(0.5)
    finally:
        server.shutdown()
    assert str(refused.value) == f"server at {url} not healthy after 0.5 s; no output kept"
    healthy, healthy_url = answering(200, "{}")
    try:
        ManagedServer(healthy_url).wait_healthy(5.0)
    finally:
        healthy.shutdown()


def test_server_info_of_a_closed_port_is_empty() -> None:
    from harness.ab import free_port

    assert server_info(f"http://127.0.0.1:{free_port()}") == {}


# ---------------------------------------------------------------------------------------------
# a measured run and the rows it writes


def test_the_progress_line_counts_done_and_failed_requests_and_ends_its_line(capsys) -> None:
    """The progress bar says how many requests are done of how many and how many failed, and
    ends with a newline only once the last one is in."""
    from harness.client import RequestRecord
    from harness.load import Progress

    progress = Progress(3, "A c=2")
    ok = RequestRecord(index=0, send_s=0.0)
    ok.success = True
    failed = RequestRecord(index=1, send_s=0.0, error="boom")
    progress.update(ok)
    progress.update(failed)
    err = capsys.readouterr().err
    assert not err.endswith("\n")
    assert re.search(r"A c=2 \[#{20}\.{10}\] 2/3 [0-9.]+ req/s failed 1$", err.split("\r")[-1])
    progress.update(ok)
    last = capsys.readouterr().err
    assert re.search(r"\[#{30}\] 3/3 [0-9.]+ req/s failed 1\n$", last)


def test_a_summary_written_by_an_older_harness_keeps_its_header_and_its_columns_line_up(tmp_path) -> None:
    """Appending to a summary.csv whose header has fewer columns (an older harness, resumed)
    keeps that header and writes each field under it: every line has as many fields as the
    header, and columns the file does not have are left out."""
    from harness.load import append_summary

    path = tmp_path / "summary.csv"
    path.write_text("label,concurrency,repeat,completed,failed\nA,1,0,4,0\n")
    append_summary(
        path,
        {"label": "B", "concurrency": 1, "repeat": 0, "completed": 3, "failed": 1, "duration_s": 2.5},
    )
    with path.open(newline="") as f:
        lines = list(csv.reader(f))
    assert lines[0] == ["label", "concurrency", "repeat", "completed", "failed"]
    assert lines[1:] == [["A", "1", "0", "4", "0"], ["B", "1", "0", "3", "1"]]


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")
def test_list_and_dict_cells_of_a_summary_row_are_written_as_json(tmp_path) -> None:
    """Per-position rates and the acceptance histogram go into summary.csv as JSON (null for
    an unknown rate, string keys), so that the report reads them back."""
    from harness.load import append_summary
    from reports.results import acceptance_per_position, load_results

    path = tmp_path / "summary.csv"
    row = {
        "label": "B",
        "concurrency": 2,
        "repeat": 0,
        "acceptance_per_position": [0.5, None],
        "acceptance_histogram": {1: 3, 4: 5},
    }
    append_summary(path, row)
    with path.open(newline="") as f:
        written = next(csv.DictReader(f))
    assert json.loads(written["acceptance_per_position"]) == [0.5, None]
    assert json.loads(written["acceptance_histogram"]) == {"1": 3, "4": 5}
    results = load_results(tmp_path)
    assert results.problems == ()
    assert results.summary.loc[0, "acceptance_histogram"] == {1: 3.0, 4: 5.0}
    rates = acceptance_per_position(results.summary)[("B", 2)]
    assert rates[0] == 0.5 and rates[1] != rates[1]  # NaN: unknown, not zero


def test_done_runs_are_label_concurrency_and_repeat_as_integers(tmp_path) -> None:
    """done_runs keys a summary's runs by (label, concurrency, repeat), the numbers as
    integers, so a planned run (label, 4, 1) is found in it."""
    from harness.load import append_summary, done_runs

    path = tmp_path / "summary.csv"
    assert done_runs(path) == set()
    append_summary(path, {"label": "A", "concurrency": 4, "repeat": 1})
    assert ("A", 4, 1) in done_runs(path) and ("A", 4, "1") not in done_runs(path)


def test_every_latency_statistic_of_a_run_is_written_to_its_summary_row(tmp_path) -> None:
    """summary.csv gets the mean, median, p90 and p99 of every latency, overall and per group
    of a short/long workload, each equal to the figure the run returned."""
    from harness.client import Endpoint
    from harness.load import LoadSpec, measure
    from harness.workloads import mixed_long

    from .sse_stub import Script, serve

    server, url = serve(Script([(0.0, [1]), (0.002, [2, 3]), (0.002, [4])]))
    try:
        spec = LoadSpec(concurrency=2, num_prompts=6, output_len=4, warmup=0, timeout_s=10.0)
        labels = {"label": "A", "concurrency": 2, "repeat": 0}
        summary = measure(Endpoint(url), mixed_long(6, 4, 12, 0.5, 0), spec, tmp_path, labels, None)
    finally:
        server.shutdown()
    with (tmp_path / "summary.csv").open(newline="") as f:
        written = next(csv.DictReader(f))
    latencies = ("ttft_ms", "tpot_ms", "itl_token_ms", "itl_chunk_ms", "e2e_ms")
    columns = [f"{m}_{s}" for m in latencies for s in ("mean", "median", "p90", "p99")]
    columns += [
        f"{m}_{g}_{s}"
        for g in ("short", "long")
        for m in ("ttft_ms", "itl_token_ms", "itl_chunk_ms")
        for s in ("mean", "median", "p90", "p99")
    ]
    for column in columns:
        assert column in written, column
        assert float(written[column]) == pytest.approx(summary[column], nan_ok=True), column
    assert summary["completed"] == 6 and written["completed"] == "6"


def test_the_servers_counters_win_over_per_request_acceptance_but_the_histogram_is_kept(
    tmp_path, monkeypatch
) -> None:
    """Where both the /metrics counters and the requests give acceptance figures, the row
    takes the counters' (the server's own totals) and keeps the per-request histogram, which
    counters cannot give."""
    from harness import load
    from harness.client import Endpoint
    from harness.load import LoadSpec, measure
    from harness.workloads import synthetic

    from .sse_stub import Script, serve

    snapshots = iter(
        [
            {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0},
            {"drafts": 10.0, "draft_tokens": 40.0, "accepted": 20.0},
        ]
    )
    monkeypatch.setattr(load, "scrape", lambda url: next(snapshots))
    monkeypatch.setattr(
        load,
        "acceptance_from_requests",
        lambda records: {
            "acceptance_length": 9.0,
            "acceptance_rate": 0.9,
            "acceptance_histogram": {3: 2},
            "acceptance_source": "per-request",
        },
    )
    server, url = serve(Script([(0.0, [1]), (0.0, [2])]))
    try:
        spec = LoadSpec(concurrency=1, num_prompts=2, output_len=2, warmup=0, timeout_s=10.0)
        summary = measure(Endpoint(url), synthetic(2, 4, 0), spec, tmp_path, {"label": "B"}, url + "/metrics")
    finally:
        server.shutdown()
    assert summary["acceptance_length"] == 3.0 and summary["acceptance_rate"] == 0.5
    assert summary["acceptance_source"] == "prometheus"
    assert summary["acceptance_histogram"] == {3: 2}


def test_a_resumed_ab_run_computes_its_ratios_over_every_repeat_in_the_summary(tmp_path) -> None:
    """`harness ab --resume` that adds a second repeat to a folder holding the first: ab.csv's
    A and B medians are the medians over both repeats of summary.csv."""
    from harness.__main__ import main

    from .sse_stub import Script, serve

    a, a_url = serve(Script([(0.0, [1]), (0.003, [2, 3])]))
    b, b_url = serve(Script([(0.0, [1]), (0.001, [2, 3])]))
    out = tmp_path / "ab"
    argv = ["ab", "--a-url", a_url, "--b-url", b_url, "--concurrency", "1", "--num-prompts", "3"]
    argv += ["--output-len", "3", "--warmup", "0", "--input-len", "4", "--out", str(out)]
    try:
        assert main([*argv, "--repeats", "1"]) == 0
        assert main([*argv, "--repeats", "2", "--resume"]) == 0
    finally:
        a.shutdown()
        b.shutdown()
    with (out / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["label"], r["repeat"]) for r in rows) == [("A", "0"), ("A", "1"), ("B", "0"), ("B", "1")]
    with (out / "ab.csv").open() as f:
        ab = {r["metric"]: r for r in csv.DictReader(f)}
    for side in ("A", "B"):
        repeats = [float(r["e2e_ms_median"]) for r in rows if r["label"] == side]
        assert float(ab["e2e_ms_median"][f"{side.lower()}_median"]) == pytest.approx(
            statistics.median(repeats)
        )


# ---------------------------------------------------------------------------------------------
# workloads


def test_each_arrival_comes_exactly_at_its_due_time_on_the_clock(monkeypatch) -> None:
    """On a clock that only moves when the schedule sleeps, arrival k comes at its
    `arrival_times` value exactly; one sleeper woken 50 ms late delays that arrival only, the
    next ones that are due later still come on time."""
    from harness import workloads

    now = [0.0]
    late = {3: 0.05}  # the wake-up before arrival 3 is late
    yielded: list[float] = []

    async def sleep(seconds: float) -> None:
        now[0] += seconds + late.pop(len(yielded), 0.0)

    monkeypatch.setattr(workloads, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(workloads, "asyncio", types.SimpleNamespace(sleep=sleep))
    due = workloads.arrival_times(12, 20.0, 1.0, 4)

    async def collect() -> None:
        async for _ in workloads.arrivals(12, 20.0, 1.0, 4):
            yielded.append(now[0])

    asyncio.run(collect())
    expected = list(due)
    expected[3] += 0.05
    for k in range(4, 12):  # due before the late arrival came: at once, else on time
        expected[k] = max(due[k], expected[3])
    assert yielded == pytest.approx(expected, abs=1e-12)
    assert any(due[k] > expected[3] for k in range(4, 12))


def test_long_prompts_are_drawn_apart_from_the_short_ones() -> None:
    """The long prompts of a mix do not start with a short prompt of the same run (a server's
    prefix cache would then serve that short prompt, or the long one's start, for free)."""
    from harness.workloads import mixed_long

    for as_text in (False, True):
        prompts = mixed_long(64, 4, 16, 0.25, 0, as_text=as_text)
        short = [p.token_ids or p.text for p in prompts if p.group == "short"]
        long = [p.token_ids or p.text for p in prompts if p.group == "long"]
        assert len(short) == 48 and len(long) == 16
        assert not any(lo[: len(s)] == s for s in short for lo in long)


@pytest.mark.parametrize("line", ["[1, 2, 3]", '"a prompt"', "7", "null"])
def test_a_dataset_line_that_is_not_an_object_is_refused_naming_its_line(tmp_path, line: str) -> None:
    """A JSON line that is a list, a string, a number or null is refused with a WorkloadError
    that names the file and line and what it holds, not an AttributeError."""
    from harness.workloads import WorkloadError, load_jsonl

    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n\n" + line + "\n")
    with pytest.raises(WorkloadError, match=r"set\.jsonl:3: a JSON object per line, got \w+"):
        load_jsonl(path)


# ---------------------------------------------------------------------------------------------
# resuming a results folder


def test_a_resume_conflict_with_five_differences_names_four_and_counts_one_more(tmp_path) -> None:
    from harness.resume import ResumeConflict, check_saved_identity

    path = tmp_path / "bench_run.json"
    path.write_text(json.dumps({k: 1 for k in "abcde"}))
    with pytest.raises(ResumeConflict) as five:
        check_saved_identity(path, {k: 2 for k in "abcde"}, "held", "differ", "made", "again")
    assert str(five.value) == (
        "differ: a was 1, now 2; b was 1, now 2; c was 1, now 2; d was 1, now 2 (and 1 more); again"
    )


def test_a_summary_whose_header_lacks_the_repeat_column_is_set_aside(tmp_path) -> None:
    """A summary.csv whose first line is whole but lacks the repeat column cannot be read by
    run: it is moved to summary.csv.torn and its runs are measured again; a whole header (CRLF
    line ends, as csv writes them) is kept."""
    from harness.resume import prepare, repair_summary

    path = tmp_path / "summary.csv"
    path.write_text("label,concurrency\nA,1\n")
    assert repair_summary(path) == (
        "summary.csv had no whole header: moved to summary.csv.torn, its runs measured again"
    )
    assert not path.exists() and (tmp_path / "summary.csv.torn").read_text() == "label,concurrency\nA,1\n"
    path.write_text("label,concurrency,repeat,completed,failed\r\nA,1,0,4,0\r\n")
    assert repair_summary(path) is None
    resumed = prepare(tmp_path, {("A", 1, 0): 4}, 0.0)
    assert resumed.done == {("A", 1, 0)}


def test_preparing_a_folder_removes_summary_rows_that_name_no_run(tmp_path) -> None:
    """A summary row without a readable (label, concurrency, repeat) belongs to no run and
    cannot be kept as one: preparing the folder leaves only the rows of runs."""
    from harness.resume import prepare

    path = tmp_path / "summary.csv"
    path.write_text(
        "label,concurrency,repeat,completed,failed\nA,1,0,4,0\nA,many,0,4,0\nA,2,,4,0\nB,1,0,2,2\n"
    )
    resumed = prepare(tmp_path, {("A", 1, 0): 4, ("B", 1, 0): 4}, 0.0)
    assert resumed.done == {("A", 1, 0)} and resumed.redo == {("B", 1, 0)}
    with path.open(newline="") as f:
        assert [(r["label"], r["concurrency"], r["repeat"]) for r in csv.DictReader(f)] == [("A", "1", "0")]


# ---------------------------------------------------------------------------------------------
# the output folder


def test_a_folder_with_exactly_the_room_a_run_needs_is_taken_and_one_byte_less_is_not(
    tmp_path, monkeypatch
) -> None:
    from harness import output

    free = [output.MIN_FREE_BYTES]
    usage = types.SimpleNamespace(
        disk_usage=lambda path: types.SimpleNamespace(total=2**40, used=0, free=free[0])
    )
    monkeypatch.setattr(output, "shutil", usage)
    output.check(tmp_path / "out")
    free[0] -= 1
    with pytest.raises(output.OutputError, match=r"has 16\.0 MiB free; a run needs at least 16 MiB"):
        output.check(tmp_path / "out")


# ---------------------------------------------------------------------------------------------
# reports: reading the results


def test_labels_put_a_before_b_and_the_others_after_in_order_of_appearance(tmp_path) -> None:
    """The report's sides: baseline A first, candidate B second, any other label after them
    in the order summary.csv first names it; the results table's columns follow."""
    from reports.results import load_results
    from reports.tables import results_tables

    rows = [
        point(label, 1, output_tokens_per_s=v)
        for label, v in (("plain", 5.0), ("B", 20.0), ("zeta", 7.0), ("A", 10.0))
    ]
    results = load_results(write_summary(tmp_path, rows))
    assert results.labels == ["A", "B", "plain", "zeta"]
    header = results_tables(results)[1].splitlines()[0]
    assert header == "| Metric | A (n=1) | B (n=1) | plain (n=1) | zeta (n=1) |"
    pair = load_results(write_summary(tmp_path / "pair", rows[1:2] + rows[3:]))
    assert pair.labels == ["A", "B"]
    assert "| Output throughput (tok/s) | 10.0 | 20.0 | 2.000 |" in results_tables(pair)[1]


@pytest.mark.parametrize(
    "flags,expected",
    [
        (("True", "False"), [True, False]),
        (("1", "0"), [True, False]),
        (("yes", "no"), [True, False]),
        (("", "maybe"), [None, None]),
    ],
)
def test_ab_within_noise_flags_read_as_true_false_or_unknown(tmp_path, flags, expected) -> None:
    """ab.csv's within_noise reads true/1/yes and false/0/no in any case; anything else is
    unknown and the ratio table says n/a rather than judging it."""
    from reports.results import load_results
    from reports.tables import ratio_table

    write_summary(tmp_path, [point("A", 1), point("B", 1)])
    with (tmp_path / "ab.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(AB_HEADER)
        writer.writerow(["output_tokens_per_s", 1, 10, 20, 2.0, 1.8, 2.2, flags[0]])
        writer.writerow(["ttft_ms_median", 1, 10, 20, 2.0, 1.8, 2.2, flags[1]])
    results = load_results(tmp_path)
    assert list(results.ab["within_noise"]) == expected
    table = ratio_table(results.ab)
    lines = [
        line
        for line in table.splitlines()
        if line.startswith("| Output throughput") or line.startswith("| TTFT")
    ]
    verdicts = [line.split(" | ")[-1].rstrip(" |") for line in lines]
    assert verdicts == [
        {True: "no clear change", False: "better", None: "n/a"}[expected[0]],
        {True: "no clear change", False: "worse", None: "n/a"}[expected[1]],
    ]


@pytest.mark.parametrize(
    "name,data",
    [
        ("meta.json", b'{"notes": "caf\xe9"}'),
        ("compare_summary.json", b'{"x": "\xff"}'),
        ("compare.md", b"# Equivalence\n\ncaf\xe9\n"),
    ],
)
def test_an_optional_file_that_is_not_utf8_is_an_input_problem_not_a_crash(tmp_path, name, data) -> None:
    """An optional result file whose bytes are not UTF-8 is reported as an input problem (or
    read with its bad bytes replaced); the report is still built."""
    from reports.markdown import render_report
    from reports.results import load_results

    write_summary(tmp_path, [point("A", 1, completed=4, failed=0)])
    (tmp_path / name).write_bytes(data)
    results = load_results(tmp_path)
    shown = name in " ".join(results.problems) or (name == "compare.md" and results.compare_md is not None)
    assert shown, results.problems
    assert render_report(results, []).startswith("# Benchmark report")


@pytest.mark.parametrize("name", ["summary.csv", "ab.csv"])
def test_a_csv_row_with_more_fields_than_its_header_gives_no_traceback(tmp_path, name, capsys) -> None:
    from reports.__main__ import main

    write_summary(tmp_path, [point("A", 1, completed=4), point("B", 1, completed=4)])
    if name == "ab.csv":
        (tmp_path / name).write_text(
            "metric,concurrency,ratio\noutput_tokens_per_s,1,1.5\nttft_ms_median,1,0.9,extra,fields\n"
        )
    else:
        with (tmp_path / name).open("a") as f:
            f.write("A,2,0,4,extra,fields\n")
    status = main([str(tmp_path)])
    err = capsys.readouterr().err
    if status == 2:
        assert err.count("\n") == 1 and err.startswith("error: ") and name in err
    else:
        assert status == 0 and name in (tmp_path / "report.md").read_text()


# ---------------------------------------------------------------------------------------------
# reports: tables


def test_ratio_rows_of_several_statistics_of_one_latency_run_by_metric_then_concurrency(tmp_path) -> None:
    """Two statistics of TTFT at two concurrencies: every concurrency of the p50 first, then
    those of the p99, whatever the order of ab.csv."""
    from reports.results import load_results
    from reports.tables import ratio_table

    write_summary(tmp_path, [point("A", 1), point("B", 1), point("A", 4), point("B", 4)])
    with (tmp_path / "ab.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(AB_HEADER)
        for metric, concurrency in (
            ("ttft_ms_p99", 4),
            ("ttft_ms_median", 4),
            ("ttft_ms_p99", 1),
            ("ttft_ms_median", 1),
        ):
            writer.writerow([metric, concurrency, 10, 9, 0.9, 0.8, 0.95, False])
        writer.writerow(["output_tokens_per_s", 4, 10, 11, 1.1, 1.05, 1.2, False])
    rows = [line.split(" | ")[:2] for line in ratio_table(load_results(tmp_path).ab).splitlines()[2:]]
    assert rows == [
        ["| Output throughput (tok/s)", "4"],
        ["| TTFT p50 (ms)", "1"],
        ["| TTFT p50 (ms)", "4"],
        ["| TTFT p99 (ms)", "1"],
        ["| TTFT p99 (ms)", "4"],
    ]


# ---------------------------------------------------------------------------------------------
# reports: plots and the report


def test_the_itl_distribution_says_whether_requests_jsonl_is_absent_or_has_no_chunk_timings(tmp_path) -> None:
    """Without requests.jsonl the ITL distribution is not drawn because the file is absent;
    with one whose requests carry no chunk timings, because there are none; the report says
    which."""
    from matplotlib.figure import Figure

    from reports import plots
    from reports.markdown import render_report
    from reports.results import aggregate_repeats, load_results

    write_summary(tmp_path, [point("A", 1, completed=2, failed=0)])

    def reason() -> str:
        results = load_results(tmp_path)
        outcome = plots.itl_distribution(Figure(), results, aggregate_repeats(results.summary), {"A": "C0"})
        assert isinstance(outcome, plots.Skip)
        plot = plots.Plot("ITL distribution", "itl_distribution.png", outcome.reason, drawn=False)
        assert f"Not drawn: {outcome.reason}." in render_report(results, [plot])
        return outcome.reason

    assert reason() == "requests.jsonl absent"
    rows = [{"label": "A", "concurrency": 1, "repeat": 0, "index": i, "success": True} for i in range(2)]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert reason() == "no chunk timings in requests.jsonl"


def test_latency_percentiles_draw_p50_p90_and_p99_of_ttft_and_tpot_for_each_label(tmp_path) -> None:
    """Each panel (TTFT, TPOT) has a p50, a p90 and a p99 line per label, solid, dashed and
    dotted, through the medians over repeats of that percentile."""
    from matplotlib.figure import Figure

    from reports import plots
    from reports.results import aggregate_repeats, load_results

    rows = []
    for label, scale in (("A", 1.0), ("B", 2.0)):
        for concurrency in (1, 2):
            for repeat, spread in enumerate((1.0, 3.0, 2.0)):
                stats = {"median": 10.0, "p90": 20.0, "p99": 40.0}
                rows.append(
                    point(
                        label,
                        concurrency,
                        repeat,
                        **{
                            f"{m}_{s}": v * scale * concurrency * spread
                            for m in ("ttft_ms", "tpot_ms")
                            for s, v in stats.items()
                        },
                    )
                )
    results = load_results(write_summary(tmp_path, rows))
    figure = Figure()
    caption = plots.latency_percentiles(
        figure, results, aggregate_repeats(results.summary), {"A": "C0", "B": "C1"}
    )
    assert caption == "Per-request percentiles of each repeat, median over repeats."
    assert [ax.get_title() for ax in figure.axes] == ["TTFT percentiles", "TPOT percentiles"]
    for ax in figure.axes:
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert list(lines) == ["A p50", "A p90", "A p99", "B p50", "B p90", "B p99"]
        assert [lines[f"A {p}"].get_linestyle() for p in ("p50", "p90", "p99")] == ["-", "--", ":"]
        # median over the repeats (x1, x3, x2) is x2
        assert list(lines["A p99"].get_ydata()) == [80.0, 160.0]
        assert list(lines["B p50"].get_ydata()) == [40.0, 80.0]
        assert list(lines["B p99"].get_xdata()) == [1, 2]
