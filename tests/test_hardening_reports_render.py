"""How `python -m reports DIR` and `python -m reports profile DIR` turn result files into
numbers and text: medians over repeats, sums of completed and failed requests, ITL in ms
split among a chunk's tokens, per-position and histogram acceptance over repeats, the ratio
column and its digits, escaped labels, the min-max range only over several repeats, error
lists, metadata cells, included headings, nsys units, header aliases, thousands
separators, per-phase sums over domains, kernel shares, token counts of a capture and the
profile's per-token tables; a requests line whose chunk times are not numbers is skipped and
counted, and a busy-machine entry that does not name its run is still warned about. Inputs are
small hand-made files with figures worked out by hand.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pandas as pd
import pytest

from reports.__main__ import main
from reports.markdown import _demote_headings, _metadata, build_report
from reports.nsys import Capture, phase_table, read_table, top_kernels
from reports.phases import PhaseTimes, breakdown, from_bench_row, from_capture
from reports.profile import kernel_table, side_by_side
from reports.results import acceptance_histograms, acceptance_per_position, load_results
from reports.tables import failure_table, metric_title, ratio_table, results_tables


def write_csv(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def cells(table: str, first: str) -> list[str]:
    """The cells of the table row whose first cell is `first`."""
    line = next(row for row in table.splitlines() if row.startswith(f"| {first} |"))
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


# --- results.py: what is read and aggregated -------------------------------------------------


def test_table_figures_are_medians_over_repeats_not_means(tmp_path: Path) -> None:
    """TTFT p99 of repeats 10, 20 and 90 ms shows as 20.00, their median."""
    rows = [
        {"label": "A", "concurrency": 1, "repeat": r, "output_tokens_per_s": 100.0, "ttft_ms_p99": v}
        for r, v in enumerate((10.0, 20.0, 90.0))
    ]
    write_csv(tmp_path / "summary.csv", rows)
    table = results_tables(load_results(tmp_path))[1]
    assert cells(table, "TTFT p99 (ms)")[1] == "20.00"


def test_completed_and_failed_are_summed_over_repeats(tmp_path: Path) -> None:
    """Two repeats of 5 completed and 2 failed requests: 10 completed, 4 failed, and the
    report's failure section counts all of them."""
    rows = [
        {"label": "A", "concurrency": 2, "repeat": r, "completed": 5, "failed": 2, "errors": "boom"}
        for r in range(2)
    ]
    write_csv(tmp_path / "summary.csv", rows)
    table = failure_table(load_results(tmp_path))
    assert cells(table, "A")[:4] == ["A", "2", "10", "4"]


def test_no_failures_names_the_completed_requests_of_every_repeat(tmp_path: Path) -> None:
    rows = [{"label": "A", "concurrency": c, "repeat": 0, "completed": 7, "failed": 0} for c in (1, 2)]
    write_csv(tmp_path / "summary.csv", rows)
    text = build_report(tmp_path).read_text()
    assert "No failed requests (14 completed)." in text


def test_only_points_with_failures_are_listed_in_the_failure_table(tmp_path: Path) -> None:
    rows = [
        {"label": "A", "concurrency": 1, "repeat": 0, "completed": 5, "failed": 0},
        {"label": "A", "concurrency": 4, "repeat": 0, "completed": 4, "failed": 1, "errors": "x"},
    ]
    write_csv(tmp_path / "summary.csv", rows)
    table = failure_table(load_results(tmp_path))
    assert "| A | 4 |" in table
    assert "| A | 1 |" not in table


def test_itl_from_requests_is_in_ms_and_split_among_the_chunks_tokens(tmp_path: Path) -> None:
    """Chunks at 0, 10 and 30 ms carrying 1, 2 and 4 tokens: chunk gaps 10 and 20 ms, per-token
    gaps 5, 5 and 5, 5, 5, 5 ms; the first chunk is TTFT, not an ITL."""
    write_csv(tmp_path / "summary.csv", [{"label": "A", "concurrency": 1, "repeat": 0}])
    record = {
        "label": "A",
        "concurrency": 1,
        "repeat": 0,
        "index": 0,
        "success": True,
        "chunk_times_s": [0.0, 0.010, 0.030],
        "chunk_tokens": [1, 2, 4],
    }
    (tmp_path / "requests.jsonl").write_text(json.dumps(record) + "\n")
    samples = load_results(tmp_path).itl[("A", 1)]
    assert samples.chunk_ms.tolist() == pytest.approx([10.0, 20.0])
    assert samples.token_ms.tolist() == pytest.approx([5.0] * 6)


def test_per_position_acceptance_is_the_median_of_the_repeats(tmp_path: Path) -> None:
    rows = [
        {"label": "B", "concurrency": 1, "repeat": r, "acceptance_per_position": json.dumps([v, 0.5])}
        for r, v in enumerate((0.9, 0.8, 0.2))
    ]
    write_csv(tmp_path / "summary.csv", rows)
    rates = acceptance_per_position(load_results(tmp_path).summary)
    assert rates[("B", 1)] == pytest.approx([0.8, 0.5])


def test_acceptance_histograms_add_up_every_row_of_a_label(tmp_path: Path) -> None:
    rows = [
        {"label": "B", "concurrency": c, "repeat": 0, "acceptance_histogram": json.dumps({"1": n, "3": 2})}
        for c, n in ((1, 4), (2, 6))
    ]
    write_csv(tmp_path / "summary.csv", rows)
    assert acceptance_histograms(load_results(tmp_path).summary) == {"B": {1: 10.0, 3: 4.0}}


def test_a_summary_without_a_repeat_column_numbers_the_repeats_of_each_point(tmp_path: Path) -> None:
    rows = [{"label": label, "concurrency": 1} for label in ("A", "B", "A", "B", "A")]
    write_csv(tmp_path / "summary.csv", rows)
    summary = load_results(tmp_path).summary
    assert summary["repeat"].tolist() == [0, 0, 1, 1, 2]


def test_baseline_a_comes_before_b_whatever_order_the_rows_are_in(tmp_path: Path) -> None:
    rows = [
        {"label": "B", "concurrency": 1, "repeat": 0, "output_tokens_per_s": 200.0},
        {"label": "A", "concurrency": 1, "repeat": 0, "output_tokens_per_s": 100.0},
    ]
    write_csv(tmp_path / "summary.csv", rows)
    results = load_results(tmp_path)
    assert results.labels == ["A", "B"]
    table = results_tables(results)[1]
    assert cells(table, "Output throughput (tok/s)") == [
        "Output throughput (tok/s)",
        "100.0",
        "200.0",
        "2.000",
    ]


# --- tables.py: how numbers are printed ------------------------------------------------------


def test_a_label_with_a_pipe_is_escaped_in_the_table_header(tmp_path: Path) -> None:
    rows = [{"label": "x|y", "concurrency": 1, "repeat": 0, "output_tokens_per_s": 10.0}]
    write_csv(tmp_path / "summary.csv", rows)
    header = results_tables(load_results(tmp_path))[1].splitlines()[0]
    assert header == "| Metric | x\\|y (n=1) |"


def test_a_single_repeat_shows_no_range_and_several_show_min_to_max(tmp_path: Path) -> None:
    rows = [
        {"label": "A", "concurrency": 1, "repeat": 0, "output_tokens_per_s": 100.0},
        {"label": "A", "concurrency": 2, "repeat": 0, "output_tokens_per_s": 150.0},
        {"label": "A", "concurrency": 2, "repeat": 1, "output_tokens_per_s": 170.0},
    ]
    write_csv(tmp_path / "summary.csv", rows)
    tables = results_tables(load_results(tmp_path))
    assert cells(tables[1], "Output throughput (tok/s)")[1] == "100.0"
    assert cells(tables[2], "Output throughput (tok/s)")[1] == "160.0 (150.0–170.0)"


def test_optional_rows_without_any_value_are_left_out(tmp_path: Path) -> None:
    rows = [
        {
            "label": "A",
            "concurrency": 1,
            "repeat": 0,
            "output_tokens_per_s": 10.0,
            "goodput_requests_per_s": "",
        }
    ]
    write_csv(tmp_path / "summary.csv", rows)
    table = results_tables(load_results(tmp_path))[1]
    assert "Goodput" not in table
    assert "Acceptance length" not in table
    assert "| TTFT p50 (ms) | n/a |" in table  # a required row stays, as n/a


def test_ratio_table_prints_throughput_to_a_tenth_and_latency_to_a_hundredth() -> None:
    ab = pd.DataFrame(
        [
            ["output_tokens_per_s", 1, 1234.56, 2469.12, 2.0, 1.9, 2.1, False],
            ["ttft_ms_median", 1, 12.345, 6.1725, 0.5, 0.4, 0.6, False],
        ],
        columns=[
            "metric",
            "concurrency",
            "a_median",
            "b_median",
            "ratio",
            "ci_low",
            "ci_high",
            "within_noise",
        ],
    )
    table = ratio_table(ab)
    assert cells(table, "Output throughput (tok/s)")[2:5] == ["1,234.6", "2,469.1", "2.000"]
    assert cells(table, "TTFT p50 (ms)")[2:8] == ["12.35", "6.17", "0.500", "[0.400, 0.600]", "no", "better"]


def test_metric_titles_carry_the_unit_of_each_metric() -> None:
    assert metric_title("output_tokens_per_s") == "Output throughput (tok/s)"
    assert metric_title("request_throughput") == "Request throughput (req/s)"
    assert metric_title("goodput_requests_per_s") == "Goodput (req/s)"
    assert metric_title("e2e_ms_p90") == "E2E p90 (ms)"


def test_five_errors_are_listed_and_the_rest_counted(tmp_path: Path) -> None:
    write_csv(
        tmp_path / "summary.csv", [{"label": "A", "concurrency": 1, "repeat": 0, "completed": 0, "failed": 7}]
    )
    lines = [
        json.dumps(
            {"label": "A", "concurrency": 1, "repeat": 0, "index": i, "success": False, "error": f"e{i}"}
        )
        for i in range(7)
    ]
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    errors = cells(failure_table(load_results(tmp_path)), "A")[4]
    assert errors == "e0; e1; e2; e3; e4; and 2 more"


def test_a_long_error_message_is_cut_to_200_characters(tmp_path: Path) -> None:
    write_csv(
        tmp_path / "summary.csv", [{"label": "A", "concurrency": 1, "repeat": 0, "completed": 0, "failed": 1}]
    )
    record = {"label": "A", "concurrency": 1, "repeat": 0, "index": 0, "success": False, "error": "z" * 500}
    (tmp_path / "requests.jsonl").write_text(json.dumps(record) + "\n")
    errors = cells(failure_table(load_results(tmp_path)), "A")[4]
    assert errors == "z" * 200


# --- markdown.py: the report's text ----------------------------------------------------------


def test_headings_inside_a_code_fence_of_the_included_report_are_not_demoted() -> None:
    text = "# Title\n```\n# a shell comment\n```\n## Part"
    assert _demote_headings(text, levels=2) == "### Title\n```\n# a shell comment\n```\n#### Part"


def test_a_command_argv_reads_as_one_line_and_a_commit_as_code() -> None:
    text = _metadata({"command": ["python", "-m", "harness", "ab"], "git_commit": "abc123"})
    assert "```\npython -m harness ab\n```" in text
    assert "| git_commit | `abc123` |" in text


def test_the_header_gives_the_range_of_repeats_per_point(tmp_path: Path) -> None:
    rows = [{"label": "A", "concurrency": 1, "repeat": r} for r in range(3)]
    rows += [{"label": "A", "concurrency": 2, "repeat": r} for r in range(2)]
    write_csv(tmp_path / "summary.csv", rows)
    text = build_report(tmp_path).read_text()
    assert "repeats per point: 2–3 (5 rows in `summary.csv`)." in text


def test_a_single_server_run_does_not_list_ab_csv_as_missing(tmp_path: Path) -> None:
    write_csv(tmp_path / "summary.csv", [{"label": "solo", "concurrency": 1, "repeat": 0}])
    text = build_report(tmp_path).read_text()
    assert "`ab.csv`:" not in text
    assert "- `meta.json`: no run metadata" in text


def test_a_requests_line_with_a_null_chunk_time_does_not_stop_the_report(tmp_path: Path, capsys) -> None:
    """An unreadable part of an optional file is an input problem, not a traceback."""
    write_csv(tmp_path / "summary.csv", [{"label": "A", "concurrency": 1, "repeat": 0}])
    record = {
        "label": "A",
        "concurrency": 1,
        "repeat": 0,
        "index": 0,
        "success": True,
        "chunk_times_s": [0.0, None, 0.2],
        "chunk_tokens": [1, 1, 1],
    }
    (tmp_path / "requests.jsonl").write_text(json.dumps(record) + "\n")
    assert main([str(tmp_path)]) == 0
    assert "requests.jsonl" in (tmp_path / "report.md").read_text().split("## Metric definitions")[0]


# --- nsys.py ----------------------------------------------------------------------------------


def test_a_time_header_without_a_unit_is_in_nanoseconds() -> None:
    table = read_table("Range,Instances,Total Time\n:step,2,3000000\n", "nvtx_sum")
    assert table["total_ms"].tolist() == [pytest.approx(3.0)]


@pytest.mark.parametrize(("unit", "ms"), [("us", 3.0), ("μs", 3.0), ("ms", 3000.0), ("s", 3e6)])
def test_time_units_of_the_header_are_converted_to_ms(unit: str, ms: float) -> None:
    table = read_table(f"Range,Instances,Total Time ({unit})\n:step,2,3000\n", "nvtx_sum")
    assert table["total_ms"].tolist() == [pytest.approx(ms)]


def test_range_instances_win_over_a_bare_instances_column() -> None:
    text = "Range,Instances,Range Instances,Total Proj Time (ns)\n:verify,99,4,1000000\n"
    table = read_table(text, "nvtx_gpu_proj_sum")
    assert table["instances"].tolist() == [4.0]


def test_numbers_with_thousands_separators_are_read_whole() -> None:
    table = read_table('Range,Instances,Total Time (ns)\n:step,"1,200","12,345,678"\n', "nvtx_sum")
    assert table["instances"].tolist() == [1200.0]
    assert table["total_ms"].tolist() == [pytest.approx(12.345678)]


def test_a_table_ends_at_the_first_line_that_is_not_one_of_its_rows() -> None:
    text = "Range,Instances,Total Time (ns)\n:step,1,1000000\n\nNOTICE: more\n:verify,1,2000000\n"
    table = read_table(text, "nvtx_sum")
    assert table["range"].tolist() == [":step"]


def test_a_phase_in_both_domains_is_summed() -> None:
    table = read_table(
        "Range,Instances,Total Time (ns)\n"
        ":verify,2,1000000\ndflash:verify,3,2000000\nother:verify,5,9000000\n",
        "nvtx_sum",
    )
    phases = phase_table(table, ("total_ms",))
    assert phases.loc["verify"].tolist() == pytest.approx([5.0, 3.0])


def test_a_kernels_share_is_of_all_kernel_time_not_of_the_top_ones() -> None:
    kernels = pd.DataFrame({"kernel": ["a", "b", "c"], "instances": [2, 1, 1], "total_ms": [6.0, 3.0, 1.0]})
    top = top_kernels(kernels, 1)
    assert top["share_pct"].tolist() == [pytest.approx(60.0)]
    assert top["mean_us"].tolist() == [pytest.approx(3000.0)]


# --- phases.py and profile.py -----------------------------------------------------------------


def _capture(label: str) -> Capture:
    ranges = pd.DataFrame({"instances": [10, 10], "total_ms": [100.0, 60.0]}, index=["step", "decode"])
    gpu = pd.DataFrame({"instances": [10, 10], "gpu_ms": [80.0, 50.0]}, index=["step", "decode"])
    return Capture(label=label, ranges=ranges, gpu=gpu, kernels=None, missing=())


def test_a_captures_tokens_are_one_runs_tokens_times_its_repeats() -> None:
    bench = {("plain", 1): [{"mode": "plain", "concurrency": 1, "output_tokens": 64, "repeats": 3}]}
    assert from_capture(_capture("plain-c1"), bench).output_tokens == 192


def test_other_on_the_gpu_is_the_steps_gpu_time_outside_the_top_level_phases() -> None:
    table = breakdown(from_capture(_capture("plain-c1"), {}))
    assert table.loc["other", "total_ms"] == pytest.approx(40.0)
    assert table.loc["other", "gpu_ms"] == pytest.approx(30.0)


def _bench_row(**extra) -> dict:
    return {
        "file": "bench.csv",
        "mode": "plain",
        "concurrency": 1,
        "ms_step": 100.0,
        "ms_decode": 40.0,
        **extra,
    }


def test_step_times_that_spread_past_a_tenth_of_the_median_are_warned_about() -> None:
    notes = from_bench_row(_bench_row(ms_step_min=95.0, ms_step_max=107.0)).notes
    assert any("repeats disagree by 12%" in n for n in notes)
    calm = from_bench_row(_bench_row(ms_step_min=96.0, ms_step_max=104.0)).notes
    assert not any("disagree" in n for n in calm)


def test_the_side_by_side_table_is_per_output_token_when_every_run_counts_them() -> None:
    run = PhaseTimes("plain-c1", "plain", 1, "timer", 100.0, {"decode": 40.0}, output_tokens=50)
    table = side_by_side([run])
    assert cells(table, "decode")[1:3] == ["0.800", "40.0"]
    assert cells(table, "other")[1:3] == ["1.200", "60.0"]


def test_a_kernel_name_past_90_characters_is_cut_with_an_ellipsis() -> None:
    kernels = pd.DataFrame({"kernel": ["k" * 120], "instances": [1], "total_ms": [1.0]})
    run = PhaseTimes("plain-c1", "plain", 1, "nsys", 10.0, {}, kernels=kernels)
    table = kernel_table(run, 10)
    assert f"`{'k' * 89}…`" in table


def test_a_busy_machine_entry_without_its_runs_name_is_still_warned_about(tmp_path: Path) -> None:
    """A machine_load entry holding only its `before` reading (a hand-edited meta.json) still
    gives the busy-machine warning instead of a traceback."""
    rows = [{"label": label, "concurrency": 1, "repeat": 0, "output_tokens_per_s": 100.0} for label in "AB"]
    write_csv(tmp_path / "summary.csv", rows)
    meta = {"machine_load": [{"before": {"load": [9.0, 1.0, 1.0], "cpus": 2}}]}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert main([str(tmp_path)]) == 0
    assert "the machine was busy" in (tmp_path / "report.md").read_text()
