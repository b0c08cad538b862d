"""Contracts of the benchmark report on result folders written as the harness writes them
(summary.csv, ab.csv, requests.jsonl, meta.json), read back with `load_results` and
rendered without plots.

The verdict (`reports/verdict.py`): unnamed sides are compared as B/A, mismatching requests
are listed in order of concurrency, repeat and request whatever the order of the file, a
level where the sides sent different numbers of requests shows both, a spread of repeats of
exactly 10% is not a disagreement, the busy machine is judged on the 1-minute load before
each run, a gap of exactly 0.5 ms is not a burst, and a side's busy server is named with the
concurrency of its own busiest run and only past 85%.

Reading the results (`reports/results.py`): concurrencies come out in increasing order, a
row without a label is skipped and said so, a summary without a `repeat` column numbers the
repeats of each point, a problem in a JSON cell names the file's line, `ab.csv` rows without
a concurrency are dropped, an `ab.csv` without ratios or without rows is a problem and no
table, per-token ITL leaves out requests whose chunk lists disagree and chunks without
tokens, a null per-position rate is a gap, histogram lengths written as floats are read,
and a side named after its own label is shown once.

The tables (`reports/tables.py`): the whole results table, the columns of a label measured
at some concurrencies only, the ratio table's order, digits and judgement of each metric,
counts that are all unknown, and the failure table's rows and its error list (the counts of
requests.jsonl, most frequent first, five at most, 200 characters, a failure without a
message, summary errors listed once).

The report (`reports/markdown.py`): the title is not repeated in the run table, lists in
meta.json read as comma-separated values, compare.md wins over compare_summary.json, a
single input problem is shown, and each label's token counts are its own.

The phase tables (`reports/phases.py`): a phase of 0 ms with calls keeps its row, `other`'s
GPU time leaves out nested phases, unknown GPU time stays unknown, a blank call count is
unknown, the timer's nested phases are shown, the throughput spread is noted, runs without a
concurrency come last, a capture's step is no phase, the CUDA-event note needs the timer to
say so, and a spread without its median is not noted.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from reports.markdown import render_report
from reports.nsys import REPORTS, load_capture
from reports.phases import OTHER, STEP, PhaseTimes, breakdown, from_bench_row, from_capture, load_profiles
from reports.results import ItlSamples, ResultSet, load_results
from reports.tables import failure_table, metric_title, ratio_table, results_tables
from reports.verdict import verdict_section

from .test_report_verdict import edit_summary, name_sides, set_token_ids, verdict
from .test_reports import write_results

NSYS = Path(__file__).parent / "fixtures" / "nsys"
AB_HEADER = ["metric", "concurrency", "a_median", "b_median", "ratio", "ci_low", "ci_high", "within_noise"]


def report(directory: Path) -> str:
    """report.md's text for the folder, without drawing the plots."""
    return render_report(load_results(directory), [])


def rewrite_requests(directory: Path, change) -> None:
    """Rewrite requests.jsonl with change(rows) -> rows."""
    path = directory / "requests.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in change(rows)))


def write_ab(directory: Path, rows: list[list]) -> None:
    with (directory / "ab.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(AB_HEADER)
        writer.writerows(rows)


def table_line(table: str, first: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(f"| {first} |"))


def hand_made(rows: list[dict], **fields) -> ResultSet:
    """A result set of summary rows given as dicts (JSON columns already parsed)."""
    parts = {"ab": None, "requests": None, "itl": {}, "meta": {}, "compare_md": None, "compare_summary": None}
    return ResultSet(Path("run"), pd.DataFrame(rows), missing=(), **{**parts, **fields})


# --- reports/verdict.py ----------------------------------------------------------------------


def test_unnamed_sides_are_compared_as_b_over_a(tmp_path: Path) -> None:
    """Without side names the verdict says its ratios are B/A."""
    part = verdict(report(write_results(tmp_path / "run")))
    assert (
        "A and B are not named (`harness ab --a-label ... --b-label ...` names them); ratios are B/A." in part
    )


def test_mismatches_are_listed_by_concurrency_repeat_and_request_whatever_the_file_order(
    tmp_path: Path,
) -> None:
    """The mismatch list runs by concurrency, then repeat, then request, though the requests
    were written in another order."""
    directory = write_results(tmp_path / "run")
    differ = {("B", 4, 1, 2), ("B", 1, 0, 1)}
    set_token_ids(
        directory,
        lambda r: [1, 9] if (r["label"], r["concurrency"], r["repeat"], r["index"]) in differ else [1, 2],
    )
    rewrite_requests(directory, lambda rows: rows[::-1])
    part = verdict(report(directory))
    assert (
        "**Outputs differ**: 2 of 11 requests: c=1 repeat 0 request 1 (first difference at output "
        "token 1); c=4 repeat 1 request 2 (first difference at output token 1) (identical: 9/11)."
    ) in part


def test_a_level_where_the_sides_sent_different_counts_shows_both(tmp_path: Path) -> None:
    """At one concurrency A sent 8 requests and B 16: the prompt-set warning gives `8/16` there."""
    directory = write_results(tmp_path / "run")

    def counts(row: dict) -> dict:
        sent = 16 if (row["label"], row["concurrency"]) == ("B", "4") else 8
        return {**row, "completed": str(sent), "failed": "0"}

    edit_summary(directory, counts)
    part = verdict(report(directory))
    assert "**Prompt sets differ between concurrencies** (c=1: 8, c=4: 8/16 requests)" in part


def _spread_a_c1(low: str, high: str):
    def change(row: dict) -> dict:
        if (row["label"], row["concurrency"]) == ("A", "1"):
            row["output_tokens_per_s"] = low if row["repeat"] == "0" else high
        return row

    return change


def test_repeats_exactly_a_tenth_apart_are_not_a_disagreement(tmp_path: Path) -> None:
    """Repeats of 95 and 105 tok/s spread by exactly 10% of their median: no warning; 95 and
    106 (11%) are warned about."""
    directory = write_results(tmp_path / "run")
    edit_summary(directory, _spread_a_c1("95", "105"))
    assert "repeats disagree" not in verdict(report(directory))
    edit_summary(directory, _spread_a_c1("95", "106"))
    assert "(A at c=1: 11%)" in verdict(report(directory))


def _machine_load(directory: Path, runs: list[tuple[list[float], list[float]]]) -> None:
    meta = json.loads((directory / "meta.json").read_text())
    meta["machine_load"] = [
        {
            "label": "AB"[i % 2],
            "concurrency": 1,
            "repeat": i // 2,
            "before": {"load": before, "cpus": 2},
            "after": {"load": after, "cpus": 2},
        }
        for i, (before, after) in enumerate(runs)
    ]
    (directory / "meta.json").write_text(json.dumps(meta))


def test_a_busy_machine_is_judged_on_the_one_minute_load_before_each_run(tmp_path: Path) -> None:
    """Only the 1-minute load average before a run counts: a high 5- or 15-minute load, or a
    high load after the run, is no warning."""
    directory = write_results(tmp_path / "run")
    _machine_load(directory, [([1.0, 6.0, 6.0], [7.0, 7.0, 7.0]), ([0.5, 0.5, 0.5], [6.0, 6.0, 6.0])])
    assert "machine was busy" not in verdict(report(directory))
    _machine_load(directory, [([1.0, 1.0, 1.0], [0.5, 0.5, 0.5]), ([3.5, 1.0, 1.0], [0.5, 0.5, 0.5])])
    part = verdict(report(directory))
    assert (
        "Before 1 of 2 runs the 1-minute load average was above the 2 CPUs (highest 3.5, before B c=1" in part
    )


def _gaps(ms: float) -> dict:
    gaps = np.full(40, ms)
    return {("B", 1): ItlSamples(token_ms=gaps, chunk_ms=gaps)}


def test_a_gap_of_exactly_half_a_millisecond_is_not_a_burst() -> None:
    """Only gaps under SATURATED_GAP_MS (0.5 ms) are read as a backlog: chunks exactly 0.5 ms
    apart are not a saturated client, 0.49 ms apart are."""
    rows = [{"label": label, "concurrency": 1, "repeat": 0, "output_tokens_per_s": 10.0} for label in "AB"]
    assert "saturated" not in verdict_section(hand_made(rows, itl=_gaps(0.5)))
    assert "100% of the gaps between token-bearing chunks of B at concurrency 1" in verdict_section(
        hand_made(rows, itl=_gaps(0.49))
    )


def test_a_busy_server_is_named_with_its_own_busiest_concurrency_and_only_past_85_percent(
    tmp_path: Path,
) -> None:
    """The host-side note gives each side's busiest run with that run's concurrency (A's at
    c=1, B's at c=4); a server at exactly 85% of a core is not noted."""
    directory = write_results(tmp_path / "run")

    def busy(row: dict) -> dict:
        point = (row["label"], row["concurrency"], row["repeat"])
        share = {("A", "1", "0"): "0.9", ("B", "4", "1"): "0.97"}.get(point, "0.5")
        return {**row, "server_cpu": share}

    edit_summary(directory, busy)
    part = verdict(report(directory))
    assert "A's server process 90% (concurrency 1); B's server process 97% (concurrency 4)" in part
    edit_summary(directory, lambda row: {**row, "server_cpu": "0.85"})
    assert "host side" not in verdict(report(directory))


# --- reports/results.py ----------------------------------------------------------------------


def _rewrite_summary(directory: Path, change) -> None:
    """Rewrite summary.csv with change(rows) -> rows (dicts of strings)."""
    path = directory / "summary.csv"
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    changed = change(rows)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in changed for k in r)))
        writer.writeheader()
        writer.writerows(changed)


def test_concurrencies_come_out_in_increasing_order_whatever_the_row_order(tmp_path: Path) -> None:
    """A summary whose rows list concurrency 4 first still reports concurrency 1 first: in
    the verdict and in the tables."""
    directory = write_results(tmp_path / "run")
    _rewrite_summary(directory, lambda rows: sorted(rows, key=lambda r: -int(r["concurrency"])))
    results = load_results(directory)
    assert results.concurrencies == [1, 4]
    text = render_report(results, [])
    assert text.index("### Concurrency 1") < text.index("### Concurrency 4")
    part = verdict(text)
    assert part.index("- Concurrency 1:") < part.index("- Concurrency 4:")


def test_a_summary_row_without_a_label_is_skipped_and_said_so(tmp_path: Path) -> None:
    """A row with a concurrency but no label is left out of every figure, and the report's
    input problems say so."""
    directory = write_results(tmp_path / "run")
    _rewrite_summary(directory, lambda rows: [*rows, {**rows[0], "label": ""}])
    results = load_results(directory)
    assert results.labels == ["A", "B"] and len(results.summary) == 8
    assert results.problems == ("summary.csv: skipped 1 row(s) without a label or concurrency",)


def test_a_summary_without_a_repeat_column_numbers_the_repeats_of_each_point(tmp_path: Path) -> None:
    """Without `repeat`, the rows of one (label, concurrency) are its repeats 0, 1, ... in
    file order."""
    directory = write_results(tmp_path / "run")
    _rewrite_summary(directory, lambda rows: [{k: v for k, v in r.items() if k != "repeat"} for r in rows])
    summary = load_results(directory).summary
    got = list(zip(summary["label"], summary["concurrency"], summary["repeat"]))
    assert got == [(label, c, r) for c in (1, 4) for r in (0, 1) for label in "AB"]


def _garble_per_position(row_index: int):
    def change(rows: list[dict]) -> list[dict]:
        rows[row_index]["acceptance_per_position"] = "oops"
        return rows

    return change


def test_a_malformed_json_cell_is_reported_with_its_line_in_the_file(tmp_path: Path) -> None:
    """A per-position cell that is not JSON on the fourth data row is reported as row 5 of
    summary.csv (the header is row 1), and the rest of the file is still read."""
    directory = write_results(tmp_path / "run")
    _rewrite_summary(directory, _garble_per_position(3))
    results = load_results(directory)
    assert results.problems == ("summary.csv row 5 acceptance_per_position: not JSON: 'oops'",)
    assert results.summary["acceptance_per_position"][3] is None
    assert results.summary["acceptance_per_position"][1] == pytest.approx([0.9, 0.7, 0.5])


def test_a_malformed_json_cell_after_a_skipped_row_names_its_own_line(tmp_path: Path) -> None:
    """A row without a label (line 2) is skipped; a malformed per-position cell on line 6 is
    reported as row 6 of summary.csv."""
    directory = write_results(tmp_path / "run")

    def change(rows: list[dict]) -> list[dict]:
        rows = _garble_per_position(3)(rows)
        return [{**rows[0], "label": ""}, *rows[:4]]

    _rewrite_summary(directory, change)
    problems = load_results(directory).problems
    assert "summary.csv row 6 acceptance_per_position: not JSON: 'oops'" in problems


def test_ab_rows_without_a_concurrency_are_dropped(tmp_path: Path) -> None:
    """An `ab.csv` row whose concurrency is blank is left out; the others make the table."""
    directory = write_results(tmp_path / "run")
    write_ab(
        directory,
        [
            ["output_tokens_per_s", 1, 102.5, 230.0, 2.2439, 2.2101, 2.2784, "false"],
            ["output_tokens_per_s", "", 381.5, 810.0, 2.1232, 2.0917, 2.1519, "false"],
        ],
    )
    results = load_results(directory)
    assert results.ab["concurrency"].tolist() == [1]
    assert "| Output throughput (tok/s) | 1 | 102.5 | 230.0 | 2.244 |" in render_report(results, [])


def test_an_ab_csv_without_ratios_is_a_problem_and_no_table(tmp_path: Path) -> None:
    """`ab.csv` without a `ratio` column gives no ratio table, an input problem saying so,
    and the verdict's ratios from the medians."""
    directory = write_results(tmp_path / "run")
    (directory / "ab.csv").write_text("metric,concurrency,a_median,b_median\noutput_tokens_per_s,1,1.0,2.0\n")
    results = load_results(directory)
    assert results.ab is None
    assert results.problems == ("ab.csv lacks column(s) ['ratio']; no ratio table",)
    text = render_report(results, [])
    assert "`ab.csv` is absent or unreadable: no intervals." in text
    assert "(no interval: `ab.csv` absent)" in verdict(text)


def test_an_empty_ab_csv_is_a_problem(tmp_path: Path) -> None:
    """An empty `ab.csv` is listed among the input problems, and there is no ratio table."""
    directory = write_results(tmp_path / "run")
    (directory / "ab.csv").write_text("")
    results = load_results(directory)
    assert results.ab is None and results.problems == ("ab.csv is empty",)
    assert "- ab.csv is empty" in render_report(results, [])


def _one_request(directory: Path, times: list[float], tokens: list[int]) -> ItlSamples | None:
    row = {"label": "B", "concurrency": 1, "repeat": 0, "index": 0, "success": True}
    (directory / "requests.jsonl").write_text(
        json.dumps({**row, "chunk_times_s": times, "chunk_tokens": tokens}) + "\n"
    )
    return load_results(directory).itl.get(("B", 1))


def test_a_request_whose_chunk_times_and_token_counts_disagree_has_no_itl(tmp_path: Path) -> None:
    """Chunk times and token counts of different lengths cannot be paired: the request adds no
    ITL sample (and breaks nothing)."""
    directory = write_results(tmp_path / "run")
    assert _one_request(directory, [0.0, 0.01, 0.02], [1, 1, 1, 1]) is None
    assert _one_request(directory, [0.0, 0.01, 0.02, 0.03], [1, 1, 1]) is None


def test_a_chunk_without_tokens_is_a_chunk_gap_but_no_token_gap(tmp_path: Path) -> None:
    """A gap ending at a chunk of 0 tokens is a chunk ITL sample; the per-token sample gets
    nothing from it."""
    directory = write_results(tmp_path / "run")
    samples = _one_request(directory, [0.0, 0.01, 0.02], [1, 0, 2])
    assert samples.chunk_ms.tolist() == pytest.approx([10.0, 10.0])
    assert samples.token_ms.tolist() == pytest.approx([5.0, 5.0])


def test_a_null_per_position_rate_is_a_gap_not_a_bad_row(tmp_path: Path) -> None:
    """A null among the per-position rates reads as NaN at that position; the others are kept
    and no problem is reported."""
    directory = write_results(tmp_path / "run")

    def change(rows: list[dict]) -> list[dict]:
        rows[1]["acceptance_per_position"] = "[0.9, null, 0.5]"
        return rows

    _rewrite_summary(directory, change)
    results = load_results(directory)
    rates = results.summary["acceptance_per_position"][1]
    assert rates[0] == 0.9 and math.isnan(rates[1]) and rates[2] == 0.5
    assert results.problems == ()


def test_histogram_lengths_written_as_floats_are_read_as_lengths(tmp_path: Path) -> None:
    """An acceptance histogram whose keys are `"2.0"` (a float written as text) is read as
    length 2."""
    directory = write_results(tmp_path / "run")

    def change(rows: list[dict]) -> list[dict]:
        rows[1]["acceptance_histogram"] = json.dumps({"1.0": 3, "2.0": 5})
        return rows

    _rewrite_summary(directory, change)
    results = load_results(directory)
    assert results.summary["acceptance_histogram"][1] == {1: 3.0, 2: 5.0}
    assert results.problems == ()


def test_a_side_named_after_its_own_label_is_shown_once(tmp_path: Path) -> None:
    """A side whose name is its label reads `A`, not `A = A`."""
    directory = write_results(tmp_path / "run")
    name_sides(directory, a="A", b="dflash")
    assert "| Metric | A (n=2) | B = dflash (n=2) | B/A |" in report(directory)


# --- reports/tables.py -----------------------------------------------------------------------

RESULTS_C1 = """\
| Metric | A (n=2) | B (n=2) | B/A |
| --- | ---: | ---: | ---: |
| Output throughput (tok/s) | 102.5 (101.5–103.5) | 230.0 (229.0–231.0) | 2.244 |
| Request throughput (req/s) | 0.801 (0.793–0.809) | 1.797 (1.789–1.805) | 2.244 |
| TTFT p50 (ms) | 34.25 | 17.38 | 0.507 |
| TTFT p99 (ms) | 56.75 | 28.62 | 0.504 |
| TPOT mean (ms) | 34.25 | 17.38 | 0.507 |
| ITL per token, mean (ms) | 45.50 | 23.00 | 0.505 |
| ITL per chunk, mean (ms) | 56.75 | 28.62 | 0.504 |
| E2E mean (ms) | 68.00 | 34.25 | 0.504 |
| Achieved concurrency | 0.95 | 0.95 | 1.000 |
| Acceptance length | n/a | 3.62 | n/a |
| Acceptance rate | n/a | 0.420 | n/a |
| Acceptance source | n/a | prometheus |  |"""


def test_the_results_table_has_every_metric_row_with_its_digits(tmp_path: Path) -> None:
    """The table of one concurrency: each metric's median from its own column, with its own
    number of decimals, the min–max range for the throughputs, and B/A to 3 decimals."""
    assert results_tables(load_results(write_results(tmp_path / "run")))[1] == RESULTS_C1


def test_a_label_measured_at_some_concurrencies_only_has_a_column_only_there(tmp_path: Path) -> None:
    """B measured at concurrency 1 only: the table of concurrency 4 has A's column alone and
    no ratio column."""
    directory = write_results(tmp_path / "run", ab=False, requests=False)
    _rewrite_summary(
        directory, lambda rows: [r for r in rows if (r["label"], r["concurrency"]) != ("B", "4")]
    )
    tables = results_tables(load_results(directory))
    assert tables[4].splitlines()[0] == "| Metric | A (n=2) |"
    assert tables[1].splitlines()[0] == "| Metric | A (n=2) | B (n=2) | B/A |"


def test_ratio_rows_run_by_metric_then_concurrency_whatever_the_file_order(tmp_path: Path) -> None:
    """The ratio table lists throughput before latencies, and each metric's concurrencies in
    increasing order, though `ab.csv` lists them otherwise."""
    directory = write_results(tmp_path / "run")
    write_ab(
        directory,
        [
            ["ttft_ms_median", 4, 45.0, 22.5, 0.5, 0.45, 0.55, "false"],
            ["output_tokens_per_s", 4, 381.5, 810.0, 2.1232, 2.0917, 2.1519, "false"],
            ["ttft_ms_median", 1, 36.25, 18.625, 0.5138, 0.4712, 1.0391, "true"],
            ["output_tokens_per_s", 1, 102.5, 230.0, 2.2439, 2.2101, 2.2784, "false"],
        ],
    )
    rows = ratio_table(load_results(directory).ab).splitlines()[2:]
    assert [tuple(c.strip() for c in r.split("|")[1:3]) for r in rows] == [
        ("Output throughput (tok/s)", "1"),
        ("Output throughput (tok/s)", "4"),
        ("TTFT p50 (ms)", "1"),
        ("TTFT p50 (ms)", "4"),
    ]


def _ratio_rows(tmp_path: Path, rows: list[list]) -> str:
    directory = write_results(tmp_path / "run")
    write_ab(directory, rows)
    return ratio_table(load_results(directory).ab)


def test_ratio_table_medians_have_one_decimal_in_tokens_per_second_and_two_otherwise(tmp_path: Path) -> None:
    """The ratio table prints output throughput medians with one decimal, request throughput
    and latency medians with two."""
    table = _ratio_rows(
        tmp_path,
        [
            ["output_tokens_per_s", 1, 102.5, 230.04, 2.2443, 2.21, 2.28, "false"],
            ["request_throughput", 1, 0.801, 1.797, 2.2434, 2.1, 2.3, "false"],
            ["e2e_ms_mean", 1, 68.0, 34.25, 0.5037, 0.45, 0.55, "false"],
        ],
    )
    assert table_line(table, "Output throughput (tok/s)") == (
        "| Output throughput (tok/s) | 1 | 102.5 | 230.0 | 2.244 | [2.210, 2.280] | no | better |"
    )
    assert table_line(table, "Request throughput (req/s)") == (
        "| Request throughput (req/s) | 1 | 0.80 | 1.80 | 2.243 | [2.100, 2.300] | no | better |"
    )
    assert table_line(table, "E2E mean (ms)") == (
        "| E2E mean (ms) | 1 | 68.00 | 34.25 | 0.504 | [0.450, 0.550] | no | better |"
    )


def test_goodput_medians_have_the_decimals_of_request_throughput(tmp_path: Path) -> None:
    """Goodput is in requests per second like request throughput: its medians print with two
    decimals, 0.45 and 0.04 req/s as `0.45` and `0.04`."""
    table = _ratio_rows(tmp_path, [["goodput_requests_per_s", 1, 0.45, 0.04, 0.0889, 0.05, 0.12, "false"]])
    assert table_line(table, "Goodput (req/s)").startswith("| Goodput (req/s) | 1 | 0.45 | 0.04 | 0.089 |")


def _judged(tmp_path: Path, rows: list[list]) -> dict[tuple[str, str], str]:
    """(metric title, concurrency) -> the ratio table's `B vs A` cell."""
    table = _ratio_rows(tmp_path, rows)
    return {
        tuple(c.strip() for c in line.split("|")[1:3]): line.split("|")[-2].strip()
        for line in table.splitlines()[2:]
    }


def test_a_ratio_of_exactly_one_is_no_clear_change_even_outside_the_noise(tmp_path: Path) -> None:
    """B/A of exactly 1 reads `no clear change` though `ab.csv` does not call it noise."""
    judged = _judged(tmp_path, [["output_tokens_per_s", 1, 10.0, 10.0, 1.0, 0.9, 1.1, "false"]])
    assert judged == {("Output throughput (tok/s)", "1"): "no clear change"}


def test_more_goodput_is_better(tmp_path: Path) -> None:
    """Goodput is higher-is-better: B/A of 1.2 outside the noise is `better`, 0.8 `worse`."""
    judged = _judged(
        tmp_path,
        [
            ["goodput_requests_per_s", 1, 1.0, 1.2, 1.2, 1.1, 1.3, "false"],
            ["goodput_requests_per_s", 4, 1.0, 0.8, 0.8, 0.7, 0.9, "false"],
        ],
    )
    assert judged == {("Goodput (req/s)", "1"): "better", ("Goodput (req/s)", "4"): "worse"}


def test_a_metric_with_no_known_direction_is_only_higher_or_lower(tmp_path: Path) -> None:
    """A metric that is neither a throughput nor a latency (`accepted_tokens`) is not judged
    better or worse: its ratio reads `higher` or `lower`."""
    judged = _judged(
        tmp_path,
        [
            ["accepted_tokens", 1, 10.0, 12.0, 1.2, 1.1, 1.3, "false"],
            ["accepted_tokens", 4, 10.0, 8.0, 0.8, 0.7, 0.9, "false"],
        ],
    )
    assert judged == {("accepted_tokens", "1"): "higher", ("accepted_tokens", "4"): "lower"}


def test_an_unreadable_ratio_is_not_judged(tmp_path: Path) -> None:
    """A ratio cell that does not read as a number gives `n/a`, both as B/A and as B vs A."""
    table = _ratio_rows(tmp_path, [["tpot_ms_mean", 1, 10.0, 12.0, "garbled", 1.1, 1.3, "false"]])
    assert table_line(table, "TPOT mean (ms)") == (
        "| TPOT mean (ms) | 1 | 10.00 | 12.00 | n/a | [1.100, 1.300] | no | n/a |"
    )


def test_metric_titles_name_any_statistic_and_leave_unknown_metrics_alone() -> None:
    """A statistic the titles do not know is named as written (`p95`); a metric that merely
    begins like a known one is returned unchanged."""
    assert metric_title("ttft_ms_p95") == "TTFT p95 (ms)"
    assert metric_title("e2e_ms_p90") == "E2E p90 (ms)"
    assert metric_title("output_tokens_per_second") == "output_tokens_per_second"


def test_counts_all_unknown_for_a_point_read_n_a_not_zero(tmp_path: Path) -> None:
    """A point that failed but whose `completed` cells are all blank shows `n/a` completed in
    the failure table."""
    directory = write_results(tmp_path / "run")

    def blank(row: dict) -> dict:
        if (row["label"], row["concurrency"]) == ("B", "4"):
            row["completed"] = ""
        return row

    edit_summary(directory, blank)
    assert "| B | 4 | n/a | 1 | HTTP 500: boom |" in failure_table(load_results(directory))


def test_the_failure_table_has_a_row_only_for_points_with_failures(tmp_path: Path) -> None:
    """Of the four points only the one with a failed request is a row."""
    table = failure_table(load_results(write_results(tmp_path / "run")))
    assert table.splitlines()[2:] == ["| B | 4 | 16 | 1 | HTTP 500: boom |"]


def _fail(directory: Path, errors: list[str | None]) -> str:
    """Make B's first requests at c=4 repeat 1 fail with these errors; the failure table's row."""

    def change(rows: list[dict]) -> list[dict]:
        extra = [
            {**rows[-1], "index": 3 + i, "success": False, "error": None}
            for i in range(max(0, len(errors) - 3))
        ]
        rows = rows + extra
        failing = [r for r in rows if (r["label"], r["concurrency"], r["repeat"]) == ("B", 4, 1)]
        for r, error in zip(failing, errors):
            r.update(success=False, error=error)
        return rows

    rewrite_requests(directory, change)
    return table_line(failure_table(load_results(directory)), "B")


def test_errors_are_counted_from_requests_jsonl_most_frequent_first(tmp_path: Path) -> None:
    """Per point, each distinct error once with its count from requests.jsonl (not summary.csv's
    uncounted list), the most frequent first."""
    directory = write_results(tmp_path / "run")
    row = _fail(directory, ["HTTP 503: busy", "HTTP 500: boom", "HTTP 500: boom"])
    assert row.endswith("| HTTP 500: boom (x2); HTTP 503: busy |")


def test_at_most_five_distinct_errors_are_listed(tmp_path: Path) -> None:
    """Six distinct errors: five listed and the sixth counted as more."""
    directory = write_results(tmp_path / "run")
    row = _fail(directory, [f"error {i}" for i in range(6)])
    assert row.endswith("| error 0; error 1; error 2; error 3; error 4; and 1 more |")


def test_an_error_is_cut_at_200_characters(tmp_path: Path) -> None:
    """An error message of 150 characters is shown whole; one of 250 is cut to its first 200."""
    directory = write_results(tmp_path / "run")
    short, long = "s" * 150, "l" * 250
    row = _fail(directory, [short, long])
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert sorted(cells[-1].split("; ")) == sorted([short, "l" * 200])


def test_a_failure_without_a_message_says_so(tmp_path: Path) -> None:
    """A failed request that carries no error text is listed as `(no error message)`."""
    directory = write_results(tmp_path / "run")
    assert _fail(directory, [None]).endswith("| (no error message) |")


def test_summary_errors_repeated_over_repeats_are_listed_once(tmp_path: Path) -> None:
    """Without requests.jsonl the errors come from summary.csv: the same errors in two repeats
    are listed once each, in the order first seen."""
    directory = write_results(tmp_path / "run", requests=False)

    def errors(row: dict) -> dict:
        if (row["label"], row["concurrency"]) == ("B", "4"):
            row.update(failed="1", errors="HTTP 500: boom; timeout")
        return row

    edit_summary(directory, errors)
    table = failure_table(load_results(directory))
    assert table_line(table, "B") == "| B | 4 | 16 | 2 | HTTP 500: boom; timeout |"


# --- reports/markdown.py ---------------------------------------------------------------------


def _with_meta(directory: Path, **fields) -> None:
    meta = json.loads((directory / "meta.json").read_text())
    (directory / "meta.json").write_text(json.dumps({**meta, **fields}))


def test_the_title_heads_the_report_and_is_not_repeated_in_the_run_table(tmp_path: Path) -> None:
    """meta.json's title is the report's heading only."""
    directory = write_results(tmp_path / "run")
    _with_meta(directory, title="Qwen3 on H200")
    text = report(directory)
    assert text.startswith("# Qwen3 on H200\n") and text.count("Qwen3 on H200") == 1


def test_lists_in_meta_json_read_as_comma_separated_values(tmp_path: Path) -> None:
    """A list of values outside a command reads `H100, H200` in the run table."""
    directory = write_results(tmp_path / "run")
    _with_meta(directory, gpus=["H100", "H200"], concurrency=[1, 4])
    run = report(directory).split("## Run")[1].split("## Metric definitions")[0]
    assert "| gpus | H100, H200 |" in run and "| concurrency | 1, 4 |" in run


def test_compare_md_wins_over_the_equivalence_summary(tmp_path: Path) -> None:
    """With both compare.md and compare_summary.json, the report includes compare.md."""
    directory = write_results(tmp_path / "run")
    (directory / "compare.md").write_text("# Equivalence\n\n42/42 identical\n")
    (directory / "compare_summary.json").write_text(json.dumps({"verdict": "fail"}))
    section = report(directory).split("## HTTP equivalence")[1]
    assert "### Equivalence\n\n42/42 identical" in section and "verdict" not in section


def test_a_single_input_problem_is_shown(tmp_path: Path) -> None:
    """One unreadable input is enough for the report's input problems list."""
    directory = write_results(tmp_path / "run")
    (directory / "meta.json").write_text("[1, 2]")
    text = report(directory)
    assert (
        "Input problems (the report shows what could be read):\n\n"
        "- meta.json holds a list, expected a JSON object"
    ) in text


def test_each_labels_token_counts_come_from_its_own_rows(tmp_path: Path) -> None:
    """A's counts from the server's ids and B's from usage: each label's row names its own
    source only."""
    directory = write_results(tmp_path / "run")
    edit_summary(
        directory, lambda row: {**row, "count_source": "server_ids" if row["label"] == "A" else "usage"}
    )
    text = report(directory)
    assert "| A | – | server_ids | – |" in text and "| B | – | usage | – |" in text


# --- reports/phases.py -----------------------------------------------------------------------


def _times(**fields) -> PhaseTimes:
    values = {
        "label": "dflash-c1",
        "mode": "dflash",
        "concurrency": 1,
        "source": "nsys",
        "step_ms": 100.0,
        "phase_ms": {"draft": 20.0, "verify": 50.0, "sample": 5.0},
    }
    return PhaseTimes(**{**values, **fields})


def test_a_phase_of_zero_milliseconds_with_calls_keeps_its_row() -> None:
    """A top-level phase that ran (it has calls) but took 0 ms is a row of 0 ms."""
    table = breakdown(_times(phase_ms={"schedule": 0.0, "verify": 50.0}, instances={"schedule": 4}))
    assert "schedule" in table.index and table.loc["schedule", "total_ms"] == 0.0
    assert table.loc["schedule", "instances"] == 4


def test_others_gpu_time_leaves_out_the_nested_phases() -> None:
    """`other`'s GPU time is the step's less the top-level phases' that ran; a nested phase's
    GPU time is already inside its parent's."""
    gpu = {STEP: 90.0, "draft": 25.0, "verify": 45.0, "sample": 4.0}
    table = breakdown(_times(gpu_ms=gpu))
    assert table.loc[OTHER, "gpu_ms"] == pytest.approx(20.0)
    assert table.loc["sample", "gpu_ms"] == pytest.approx(4.0)


def test_a_phase_without_gpu_time_has_it_unknown() -> None:
    """Where the capture has no GPU projection for a phase, its GPU time is NaN, not 0."""
    table = breakdown(_times(gpu_ms={STEP: 90.0, "verify": 45.0}))
    assert math.isnan(table.loc["draft", "gpu_ms"]) and math.isnan(table.loc["sample", "gpu_ms"])


def _bench(**fields) -> dict:
    return {"file": "bench.csv", "mode": "dflash", "concurrency": 2, "ms_step": 10.0, **fields}


def test_a_blank_call_count_of_the_timer_is_unknown() -> None:
    """A benchmark row whose `n_<phase>` is blank (NaN) knows that phase's time, not its calls."""
    times = from_bench_row(_bench(ms_draft=3.0, n_draft=float("nan"), ms_verify=4.0, n_verify=2))
    assert times.instances == {"verify": 2}
    assert math.isnan(breakdown(times).loc["draft", "mean_ms"])


def test_the_timers_nested_phases_are_shown_but_not_summed() -> None:
    """`ms_sample` of a benchmark row is a row of its own, inside prefill and decode, outside
    the sum."""
    table = breakdown(from_bench_row(_bench(ms_decode=6.0, ms_sample=2.0)))
    assert table.loc["sample", "total_ms"] == 2.0 and not table.loc["sample", "summed"]
    assert table.loc[OTHER, "total_ms"] == pytest.approx(4.0)


def test_the_throughput_spread_over_repeats_is_noted() -> None:
    """A benchmark row with the throughput's min and max gives a note of its spread."""
    row = _bench(output_tokens_per_s=100.0, output_tokens_per_s_min=98.0, output_tokens_per_s_max=101.0)
    assert from_bench_row(row).notes[-1] == (
        "dflash-c2 output_tokens_per_s: median 100.0 tok/s, min 98.0, max 101.0 over the repeats"
    )


def test_a_spread_without_its_median_is_not_noted() -> None:
    """Min and max of the throughput without the median itself give no note."""
    row = _bench(output_tokens_per_s_min=98.0, output_tokens_per_s_max=101.0)
    assert not any("output_tokens_per_s" in note for note in from_bench_row(row).notes)


def test_the_cuda_event_note_needs_the_timer_to_say_so() -> None:
    """Only a row whose `phase_clock` is `cuda_events` is said to be in CUDA-event time; one
    without the column says nothing of it."""
    assert not any("CUDA-event" in note for note in from_bench_row(_bench()).notes)
    assert any("CUDA-event" in note for note in from_bench_row(_bench(phase_clock="cuda_events")).notes)


def test_runs_without_a_concurrency_come_after_the_others(tmp_path: Path) -> None:
    """Profiles run by concurrency; a capture whose label has none (`plain`) comes last."""
    for label, name in (("plain-c1", "plain"), ("dflash-c8", "dflash-c8")):
        for report_name in REPORTS:
            shutil.copy(NSYS / f"{label}_{report_name}.csv", tmp_path / f"{name}_{report_name}.csv")
    assert [p.label for p in load_profiles(tmp_path, "nsys")] == ["dflash-c8", "plain"]


def test_a_captures_step_range_is_the_step_total_not_a_phase() -> None:
    """The `step` range of a capture is its step time, and not among its phases."""
    times = from_capture(load_capture(NSYS, "plain-c1"), {})
    assert STEP not in times.phase_ms and times.step_ms == pytest.approx(10651.178162)
