"""reports: `python -m reports DIR` rebuilds report.md and PNG plots from result files alone,
degrades gracefully when files are absent, is idempotent, and never imports torch."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reports.__main__ import main
from reports.markdown import METRIC_DEFINITIONS, build_report
from reports.plots import PLOTS
from reports.results import ResultsError, acceptance_histograms, acceptance_per_position, load_results

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NOTE = "oracle acceptance 4.0 on a tiny random pair"
STATS = ("mean", "median", "p90", "p99")
LATENCIES = ("ttft_ms", "tpot_ms", "itl_token_ms", "itl_chunk_ms", "e2e_ms")
# output tok/s per (label, concurrency): repeats 0 and 1; medians 102.5, 381.5, 230.0, 810.0
THROUGHPUT = {
    ("A", 1): (101.5, 103.5),
    ("A", 4): (380.0, 383.0),
    ("B", 1): (229.0, 231.0),
    ("B", 4): (800.0, 820.0),
}


def summary_row(label: str, concurrency: int, repeat: int, acceptance: bool) -> dict:
    spec = acceptance and label != "A"
    tokens_per_s = THROUGHPUT.get((label, concurrency), THROUGHPUT[("A", concurrency)])[repeat]
    row = {
        "label": label,
        "concurrency": concurrency,
        "repeat": repeat,
        "completed": 8,
        "failed": 1 if (label, concurrency, repeat) == ("B", 4, 1) else 0,
        "duration_s": 10.0,
        "request_throughput": tokens_per_s / 128,
        "output_tokens_per_s": tokens_per_s,
        "achieved_concurrency": concurrency * 0.95,
        "goodput_requests_per_s": "",
        "acceptance_length": 3.5 + repeat * 0.25 if spec else "",
        "acceptance_rate": 0.42 if spec else "",
        "acceptance_per_position": json.dumps([0.9, 0.7, 0.5 - 0.1 * repeat]) if spec else "",
        "acceptance_histogram": json.dumps({"1": 10, "2": 20, "4": 30 + repeat}) if spec else "",
        "acceptance_source": "prometheus" if spec else "",
        "errors": "HTTP 500: boom" if (label, concurrency, repeat) == ("B", 4, 1) else "",
    }
    scale = (2.0 if label == "A" else 1.0) * (1 + concurrency / 8)
    for i, metric in enumerate(LATENCIES):
        for j, stat in enumerate(STATS):
            row[f"{metric}_{stat}"] = round(scale * (10 + 5 * i) * (1 + 0.5 * j) + repeat, 3)
    return row


def request_rows(label: str, concurrency: int, repeat: int) -> list[dict]:
    rows = []
    for i in range(3):
        tokens = [1, 3, 3, 1] if label == "B" else [1, 1, 1, 1]
        times = [0.05, 0.08, 0.11, 0.12] if label == "B" else [0.05, 0.06, 0.07, 0.08]
        failed = (label, concurrency, repeat, i) == ("B", 4, 1, 0)
        rows.append(
            {
                "label": label,
                "concurrency": concurrency,
                "repeat": repeat,
                "index": i,
                "success": not failed,
                "error": "HTTP 500: boom" if failed else None,
                "ttft_s": times[0],
                "e2e_s": times[-1],
                "chunk_times_s": times,
                "chunk_tokens": tokens,
                "output_tokens": sum(tokens),
            }
        )
    return rows


def write_results(
    directory: Path,
    labels: tuple[str, ...] = ("A", "B"),
    acceptance: bool = True,
    ab: bool = True,
    requests: bool = True,
    meta: bool = True,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    points = [(label, c, r) for c in (1, 4) for r in (0, 1) for label in labels]
    rows = [summary_row(*point, acceptance=acceptance) for point in points]
    with (directory / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    if ab:
        with (directory / "ab.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(
                [
                    "metric",
                    "concurrency",
                    "a_median",
                    "b_median",
                    "ratio",
                    "ci_low",
                    "ci_high",
                    "within_noise",
                ]
            )
            writer.writerow(["output_tokens_per_s", 1, 102.5, 230.0, 2.2439, 2.2101, 2.2784, "false"])
            writer.writerow(["output_tokens_per_s", 4, 381.5, 810.0, 2.1232, 2.0917, 2.1519, "false"])
            writer.writerow(["ttft_ms_median", 1, 36.25, 18.625, 0.5138, 0.4712, 1.0391, "true"])
            writer.writerow(["ttft_ms_median", 4, 45.0, 22.5, 0.5, 0.45, 0.55, "false"])
    if requests:
        with (directory / "requests.jsonl").open("w") as f:
            for point in points:
                for row in request_rows(*point):
                    f.write(json.dumps(row) + "\n")
    if meta:
        (directory / "meta.json").write_text(
            json.dumps(
                {
                    "notes": NOTE,
                    "git_commit": "abc1234",
                    "gpu": "NVIDIA H200",
                    "commands": {
                        "A": "python -m reference_engine.serve --port 8001",
                        "B": "python -m reference_engine.serve --port 8002 --draft tiny/draft",
                    },
                    "versions": {"python": "3.12.3", "vllm": None},
                }
            )
        )
    return directory


@pytest.fixture
def results_dir(tmp_path: Path) -> Path:
    return write_results(tmp_path / "run")


def test_cli_writes_report_with_tables_notes_definitions_and_plots(results_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "reports", str(results_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    report = results_dir / "report.md"
    assert done.stdout.strip() == str(report)
    text = report.read_text()
    assert f"> **Note:** {NOTE}" in text
    assert METRIC_DEFINITIONS.strip() in text and text.count("## Metric definitions") == 1
    assert "### Concurrency 1" in text and "### Concurrency 4" in text
    assert "| Metric | A (n=2) | B (n=2) | B/A |" in text
    # medians over the two repeats, with their min-max range
    assert "| Output throughput (tok/s) | 102.5 (101.5–103.5) | 230.0 (229.0–231.0) | 2.244 |" in text
    assert "810.0 (800.0–820.0)" in text
    assert "| Acceptance length | n/a | 3.62 |" in text
    assert "| Acceptance source | n/a | prometheus |  |" in text
    # the ratio table, with intervals and the noise flag
    assert "| Output throughput (tok/s) | 1 | 102.5 | 230.0 | 2.244 | [2.210, 2.278] | no | better |" in text
    assert "| TTFT p50 (ms) | 1 | 36.25 | 18.62 | 0.514 | [0.471, 1.039] | yes | no clear change |" in text
    assert "| TTFT p50 (ms) | 4 | 45.00 | 22.50 | 0.500 | [0.450, 0.550] | no | better |" in text
    # failures with the error from requests.jsonl, header metadata, relative plot links
    assert "| B | 4 | 16 | 1 | HTTP 500: boom |" in text
    assert "| git_commit | `abc1234` |" in text and "--draft tiny/draft" in text
    for _, filename, _ in PLOTS:
        assert f"](plots/{filename})" in text
        assert (results_dir / "plots" / filename).read_bytes()[:8] == PNG_MAGIC
    missing = text.split("Missing inputs:")[1].split("##")[0]
    assert "`compare.md`" in missing and "`ab.csv`" not in missing and "`meta.json`" not in missing


def test_rebuilding_is_idempotent(results_dir: Path) -> None:
    def files() -> dict[Path, bytes]:
        return {p.relative_to(results_dir): p.read_bytes() for p in results_dir.rglob("*") if p.is_file()}

    build_report(results_dir)
    first = files()
    build_report(results_dir)
    assert files() == first


def test_without_acceptance_or_optional_files_the_report_says_what_is_missing(tmp_path: Path) -> None:
    directory = write_results(tmp_path / "run", acceptance=False, ab=False, requests=False, meta=False)
    text = build_report(directory).read_text()
    for name in ("ab.csv", "requests.jsonl", "meta.json", "compare.md"):
        assert f"- `{name}`:" in text
    assert "Acceptance length" not in text.split("## Results by concurrency")[1].split("## Failures")[0]
    assert "No acceptance metrics in `summary.csv`" in text
    assert "`ab.csv` is absent" in text and "| Output throughput (tok/s) | 102.5" in text
    assert "Not drawn: no acceptance_histogram" in text and "Not drawn: requests.jsonl absent" in text
    # the error text comes from summary.csv's errors column when requests.jsonl is absent
    assert "| B | 4 | 16 | 1 | HTTP 500: boom |" in text
    plots = directory / "plots"
    assert not (plots / "acceptance_histogram.png").exists()
    assert (plots / "throughput.png").read_bytes()[:8] == PNG_MAGIC


def test_plots_of_absent_data_are_removed_on_rebuild(results_dir: Path) -> None:
    build_report(results_dir)
    assert (results_dir / "plots" / "acceptance_per_position.png").exists()
    write_results(results_dir, acceptance=False)
    build_report(results_dir)
    assert not (results_dir / "plots" / "acceptance_per_position.png").exists()


def test_single_server_run_has_one_column_and_no_ratios(tmp_path: Path) -> None:
    directory = write_results(tmp_path / "run", labels=("vllm",), ab=False)
    assert main([str(directory)]) == 0
    text = (directory / "report.md").read_text()
    assert "| Metric | vllm (n=2) |" in text
    assert "## A/B ratios" not in text and "| B/A |" not in text and "- `ab.csv`:" not in text
    assert "No failed requests (32 completed)." in text
    assert (directory / "plots" / "itl.png").read_bytes()[:8] == PNG_MAGIC


def test_compare_md_is_included_with_its_headings_nested(results_dir: Path) -> None:
    compare = "# Equivalence\n\n42/42 prompts identical\n\n```\n# not a heading\n```\n"
    (results_dir / "compare.md").write_text(compare)
    text = build_report(results_dir).read_text()
    assert "## HTTP equivalence\n\n### Equivalence\n\n42/42 prompts identical" in text
    assert "```\n# not a heading\n```" in text


def test_torn_and_malformed_inputs_are_reported_not_fatal(results_dir: Path) -> None:
    with (results_dir / "requests.jsonl").open("a") as f:
        f.write('{"label": "A", "concurr')
    (results_dir / "meta.json").write_text("[1, 2]")
    results = load_results(results_dir)
    assert "requests.jsonl: skipped 1 unreadable line(s)" in results.problems
    assert "meta.json holds a list, expected a JSON object" in results.problems
    assert "Input problems" in build_report(results_dir).read_text()


def test_acceptance_histogram_sums_and_per_position_takes_the_median_over_repeats(results_dir: Path) -> None:
    summary = load_results(results_dir).summary
    assert acceptance_histograms(summary) == {"B": {1: 40.0, 2: 80.0, 4: 122.0}}
    rates = acceptance_per_position(summary)
    assert sorted(rates) == [("B", 1), ("B", 4)]
    assert rates[("B", 4)] == pytest.approx([0.9, 0.7, 0.45])


def test_missing_directory_exits_2_with_one_error_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "reports", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error:") and len(done.stderr.strip().splitlines()) == 1
    assert "does not exist" in done.stderr


def test_directory_without_summary_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ab.csv").write_text("metric,concurrency\n")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "no summary.csv (found: ab.csv)" in err


def test_summary_without_label_column_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "summary.csv").write_text("concurrency,output_tokens_per_s\n1,10\n")
    with pytest.raises(ResultsError, match=r"lacks column\(s\) \['label'\]"):
        load_results(tmp_path)


def test_reports_imports_no_torch_engine_or_harness() -> None:
    code = (
        "import sys, reports.__main__; bad = [m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'reference_engine', 'harness')]; assert not bad, bad"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_repeats_are_aggregated_by_their_median_with_the_spread_beside_it() -> None:
    """Three repeats of which one is an outlier: the median (not the mean) of every number,
    min and max beside the spread columns, counts summed."""
    import pandas as pd

    from reports.results import aggregate_repeats

    summary = pd.DataFrame(
        [
            {
                "label": "A",
                "concurrency": 1,
                "repeat": r,
                "output_tokens_per_s": v,
                "completed": 8,
                "failed": f,
            }
            for r, (v, f) in enumerate(((100.0, 0), (400.0, 1), (110.0, 0)))
        ]
    )
    row = aggregate_repeats(summary).loc[("A", 1)]
    assert row["output_tokens_per_s"] == 110.0 and row["n"] == 3
    assert (row["output_tokens_per_s_min"], row["output_tokens_per_s_max"]) == (100.0, 400.0)
    assert (row["completed"], row["failed"]) == (24, 1)


def test_the_reports_itl_samples_are_the_harness_definitions() -> None:
    """The report's ITL samples from requests.jsonl follow harness/metrics.py: a gap between
    token-bearing chunks, split evenly among the later chunk's tokens (per token), and whole
    (per chunk)."""
    import tempfile

    from harness.client import RequestRecord
    from harness.metrics import chunk_itl, per_token_itl
    from reports.results import _read_requests

    times, tokens = [0.0, 0.01, 0.03, 0.034], [1, 1, 4, 2]
    record = RequestRecord(0, 0.0, success=True, chunk_times_s=times, chunk_tokens=tokens)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "requests.jsonl"
        row = {"label": "B", "concurrency": 1, "repeat": 0, "index": 0, "success": True}
        path.write_text(json.dumps({**row, "chunk_times_s": times, "chunk_tokens": tokens}) + "\n")
        _, itl, _ = _read_requests(path, [])
    samples = itl[("B", 1)]
    assert list(samples.token_ms) == pytest.approx([1000 * v for v in per_token_itl(record)])
    assert list(samples.token_ms) == pytest.approx([10, 5, 5, 5, 5, 2, 2])
    assert list(samples.chunk_ms) == pytest.approx([1000 * v for v in chunk_itl(record)])


def test_the_reports_itl_samples_leave_out_failed_requests() -> None:
    """A request that failed mid-stream is not measured (harness/metrics.py counts the
    successful ones only): its chunk gaps are in neither sample of the report."""
    import tempfile

    from reports.results import _read_requests

    row = {"label": "A", "concurrency": 4, "repeat": 0}
    lines = [
        {**row, "index": 0, "success": True, "chunk_times_s": [0.0, 0.01], "chunk_tokens": [1, 1]},
        {**row, "index": 1, "success": False, "chunk_times_s": [0.0, 0.5, 0.9], "chunk_tokens": [1, 1, 1]},
    ]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "requests.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        _, itl, _ = _read_requests(path, [])
    assert list(itl[("A", 4)].token_ms) == pytest.approx([10.0])
    assert list(itl[("A", 4)].chunk_ms) == pytest.approx([10.0])


def test_points_with_different_repeat_counts_show_the_range_of_repeats(results_dir: Path) -> None:
    """The header gives the repeats per point as one number when every point has as many,
    and as min–max when one point has fewer (a run cut short)."""
    assert "repeats per point: 2 (8 rows in `summary.csv`)." in build_report(results_dir).read_text()
    with (results_dir / "summary.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    with (results_dir / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows[:-1])
    assert "repeats per point: 1–2 (7 rows in `summary.csv`)." in build_report(results_dir).read_text()


def test_included_headings_nest_two_levels_deeper_down_to_the_sixth(results_dir: Path) -> None:
    """compare.md's headings move two levels down, a fourth-level one to the sixth, and none
    deeper than markdown's six levels."""
    (results_dir / "compare.md").write_text("# Top\n\n#### Four\n\n##### Five\n\ntext\n")
    text = build_report(results_dir).read_text()
    assert "\n### Top\n\n###### Four\n\n###### Five\n\ntext" in text
