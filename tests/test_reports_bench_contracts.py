"""Direct checks, on small hand-made inputs, of the benchmark's and the reports' arithmetic
and formatting.

The benchmark (`reference_engine/bench/`): the verify-width CSV cell lists `width:steps`
pairs by increasing width, separated by `;`; a prompts file may hold whitespace-only lines;
a DFlash decode step is timed per verify call; no speedup is given against a plain run of
zero tokens per second, nor a DFlash2 comparison against a row without draft forwards; the
mean context adds half the output before taking the nearest integer; a median row counts its
repeats; a figure or a spread with only one end of its range known prints bare and warns of
nothing; the draft-parts table divides each part by its own calls and prints shares in
percent; the weight floor is the median of its repeats; a soak's first difference between an
output and its prefix is the prefix's length.

The reports (`reports/`): an nsys `-` cell reads as unknown, and a capture whose sections are
all other reports has no table of the one asked for; markdown tables right-align all but the
first column and escape `|`; numbers carry thousands separators; a single repeat prints no
range, and a ratio against a zero baseline is `n/a`; per-position acceptance is a median over
repeats; the aggregated acceptance source is the most frequent one; acceptance histograms are
summed and sorted by length; the profile's spread notes warn only above the warning share,
skip a zero median, and an unknown profile source is refused.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from reference_engine import bench
from reference_engine.bench import drafts, soak
from reports import nsys, results, tables


def test_verify_widths_cell_lists_widths_in_increasing_order_separated_by_semicolons() -> None:
    """`widths_text` sorts by width and joins `width:steps` pairs with `;` (a CSV cell)."""
    assert bench.widths_text({4: 2, 1: 5, 2: 3}) == "1:5;2:3;4:2"
    assert bench.widths_text({}) is None


def test_a_whitespace_only_line_in_a_prompts_file_is_skipped(tmp_path: Path) -> None:
    """Blank lines, including ones holding only spaces or tabs, are not read as JSON rows."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_ids": [1, 2]}\n   \t\n{"prompt_ids": [3]}\n')
    assert bench.read_prompts(str(path), None, 2) == [[1, 2], [3]]


def test_a_dflash_decode_step_is_timed_per_verify_call() -> None:
    """DFlash: draft + verify + accept + commit time divided by the verify calls, not the
    draft calls (a draft queued ahead may run more often than the verifies)."""
    phases = {"host_s_draft": 0.004, "host_s_verify": 0.003, "host_s_accept": 0.002, "host_s_commit": 0.001}
    calls = {"draft": 5, "verify": 2, "decode": 0}
    assert bench.decode_step_ms(phases, calls, "host_s_", True) == pytest.approx(5.0)
    plain = bench.decode_step_ms({"host_s_decode": 0.006}, {"decode": 3, "verify": 0}, "host_s_", False)
    assert plain == pytest.approx(2.0)


def test_no_speedup_against_a_plain_run_that_made_no_tokens_per_second() -> None:
    """A plain row with zero output tokens per second gives no ratio (and no division by 0)."""
    common = {"numerics": "fast", "concurrency": 1, "ms_per_decode_step": 2.0}
    rows = [
        {"mode": "plain", "output_tokens_per_s": 0.0, "mean_acceptance_length": 1.0, **common},
        {
            "mode": "dflash",
            "draft": "dflash",
            "output_tokens_per_s": 5.0,
            "mean_acceptance_length": 2.0,
            **common,
        },
    ]
    assert bench.speedups(rows) == []


def test_the_mean_context_adds_half_the_output_before_taking_the_nearest_integer() -> None:
    """Mean prompt length plus half the output length, then the nearest integer: 10 + 3 / 2 = 11.5 -> 12."""
    args = SimpleNamespace(output_len=3)
    assert bench.mean_context([[0] * 10, [0] * 10], args) == 12


def test_a_median_row_counts_its_repeats() -> None:
    """`repeats` is the number of rows the medians were taken over, whatever the row width."""
    rows = [{"mode": "plain", "concurrency": 1, "x": float(v)} for v in (1, 2, 3, 4)]
    out = bench.median_row(rows)
    assert out["repeats"] == 4
    assert (out["x"], out["x_min"], out["x_max"]) == (2.5, 1.0, 4.0)


def test_a_figure_with_only_one_end_of_its_range_prints_bare() -> None:
    """`_figure` prints `median (min-max)` only when both ends are known."""
    assert bench._figure({"x": 1.25, "x_min": 0.5}, "x") == "1.2"
    assert bench._figure({"x": 1.25, "x_max": 2.0}, "x", 2) == "1.25"
    assert bench._figure({"x": 1.0, "x_min": 0.5, "x_max": 2.0}, "x") == "1.0 (0.5-2.0)"


def _draft_row(
    arch: str, step_ms: float, draft_ms: float, n_draft: int, n_conv: int, n_selector: int
) -> dict:
    return {
        "mode": "dflash",
        "draft": arch,
        "numerics": "fast",
        "concurrency": 2,
        "ms_per_decode_step": step_ms,
        "ms_draft": draft_ms,
        "n_draft": n_draft,
        "ms_conv": 2.0,
        "n_conv": n_conv,
        "ms_selector": 4.0,
        "n_selector": n_selector,
    }


def test_no_draft_comparison_against_a_dflash_row_without_draft_forwards() -> None:
    """A DFlash row with steps but no counted draft forward gives no DFlash2 comparison."""
    rows = [_draft_row("dflash", 2.0, 0.0, 0, 0, 0), _draft_row("dflash2", 3.0, 15.0, 10, 10, 10)]
    assert drafts.draft_comparison(rows) == []


def test_the_conv_and_selector_times_are_per_call_of_their_own_phase() -> None:
    """`conv_ms` and `selector_ms` divide by the calls of that phase, not by the draft forwards."""
    (parts,) = drafts.draft_parts([_draft_row("dflash2", 3.0, 20.0, 10, 4, 8)])
    assert (parts["conv_ms"], parts["selector_ms"]) == (0.5, 0.5)
    assert (parts["conv_share"], parts["selector_share"]) == (0.1, 0.2)


def test_the_first_difference_of_a_prefix_is_where_the_shorter_output_ends() -> None:
    """Outputs that agree up to the end of the shorter differ at its length."""
    assert soak.first_difference([1, 2], [1, 2, 3]) == 2
    assert soak.first_difference([1, 2, 3], [1, 2]) == 2
    assert soak.first_difference([1, 5, 3], [1, 2, 3]) == 1


def test_the_weight_floor_is_the_median_of_its_repeats(tiny_checkpoint, monkeypatch) -> None:
    """The floor's time is the median over repeats (one slow repeat leaves it), its range the
    fastest and slowest repeat; a fake clock gives repeats of 1, 1 and 10 ms."""
    import torch

    from reference_engine.bench import floor
    from reference_engine.checkpoint import load_target

    ticks = iter([0.0, 0.001, 1.0, 1.001, 2.0, 2.010])
    monkeypatch.setattr(floor, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    model = load_target(tiny_checkpoint("qwen3"), dtype=torch.float32)
    got = floor.weight_streaming_floor(model, repeats=3)
    assert (got.ms_median, got.ms_min, got.ms_max) == pytest.approx((1.0, 1.0, 10.0))


def test_an_nsys_cell_of_a_dash_reads_as_unknown() -> None:
    """nsys prints `-` for a value it has not got: read as NaN, not an error."""
    text = "Time (%),Total Time (ns),Instances,Range\n50.0,-,3,:verify\n50.0,2000000,2,:draft\n"
    table = nsys.read_table(text, "nvtx_sum")
    assert pd.isna(table["total_ms"][0]) and table["total_ms"][1] == pytest.approx(2.0)
    assert table["instances"].tolist() == [3, 2]


def test_a_markdown_table_right_aligns_all_but_the_first_column_by_default() -> None:
    """The label column stays left-aligned; the number columns are right-aligned."""
    text = tables.markdown_table(["Metric", "A", "B"], [["x", "1", "2"]])
    assert text.splitlines()[1] == "| --- | ---: | ---: |"
    assert tables.markdown_table(["a", "b"], [["x", "y"]], right=()).splitlines()[1] == "| --- | --- |"


def _result_set(rows: list[dict]) -> results.ResultSet:
    return results.ResultSet(Path("."), pd.DataFrame(rows), None, None, {}, {}, None, None, ())


def _summary(label: str, repeat: int, tok_s: float, **extra) -> dict:
    return {"label": label, "concurrency": 1, "repeat": repeat, "output_tokens_per_s": tok_s, **extra}


def test_numbers_in_tables_have_thousands_separators_and_missing_values_read_n_a() -> None:
    """`fmt` groups thousands with commas and prints None or NaN as `n/a`."""
    assert tables.fmt(12345.678, 1) == "12,345.7"
    assert tables.fmt(None, 2) == tables.fmt(float("nan"), 2) == "n/a"


def test_a_single_repeat_prints_its_median_without_a_range() -> None:
    """The min-max range follows a median only over two or more repeats."""
    rs = _result_set([_summary("A", 0, 100.0), _summary("B", 0, 200.0), _summary("B", 1, 220.0)])
    line = next(row for row in tables.results_tables(rs)[1].splitlines() if row.startswith("| Output"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "100.0"
    assert cells[2] == "210.0 (200.0–220.0)"
    assert cells[3] == "2.100"


def test_the_ratio_against_a_zero_baseline_is_n_a() -> None:
    """B/A has no value when A's median is 0 (no division by zero)."""
    rs = _result_set([_summary("A", 0, 0.0), _summary("B", 0, 5.0)])
    line = next(row for row in tables.results_tables(rs)[1].splitlines() if row.startswith("| Output"))
    assert line.rstrip(" |").endswith("n/a")


def test_a_pipe_or_newline_inside_a_cell_does_not_break_the_markdown_row() -> None:
    """`|` in a cell is escaped and a newline becomes a space."""
    text = tables.markdown_table(["Error", "n"], [["a|b\nc", "1"]])
    assert text.splitlines()[2] == "| a\\|b c | 1 |"


def test_per_position_acceptance_is_the_median_over_repeats_position_by_position() -> None:
    """Each position's rate is the median of the repeats that reached it (a shorter list
    leaves the later positions to the others)."""
    summary = pd.DataFrame(
        [
            {"label": "B", "concurrency": 1, "acceptance_per_position": [0.9, 0.5, 0.4]},
            {"label": "B", "concurrency": 1, "acceptance_per_position": [0.8, 0.1]},
            {"label": "B", "concurrency": 1, "acceptance_per_position": [0.2, 0.3]},
        ]
    )
    got = results.acceptance_per_position(summary)
    assert got == {("B", 1): pytest.approx([0.8, 0.3, 0.4])}


def test_the_acceptance_source_of_repeats_is_the_most_frequent_one() -> None:
    """Aggregated repeats name the acceptance source most of them had, missing ones aside."""
    rows = [
        _summary("B", 0, 1.0, acceptance_source="server"),
        _summary("B", 1, 1.0, acceptance_source="oracle"),
        _summary("B", 2, 1.0, acceptance_source="oracle"),
        _summary("B", 3, 1.0, acceptance_source=None),
    ]
    agg = results.aggregate_repeats(pd.DataFrame(rows))
    assert agg.loc[("B", 1), "acceptance_source"] == "oracle"
    assert agg.loc[("B", 1), "n"] == 4


def test_acceptance_histograms_are_summed_and_listed_by_increasing_length() -> None:
    """Step counts per acceptance length add up over rows and come out shortest length first."""
    summary = pd.DataFrame(
        [
            {"label": "B", "acceptance_histogram": {4: 1.0, 1: 2.0}},
            {"label": "B", "acceptance_histogram": {2: 3.0, 1: 1.0}},
            {"label": "A", "acceptance_histogram": None},
        ]
    )
    got = results.acceptance_histograms(summary)
    assert list(got) == ["B"]
    assert list(got["B"].items()) == [(1, 3.0), (2, 3.0), (4, 1.0)]


def test_the_profile_warns_only_of_a_spread_above_the_warning_share() -> None:
    """A step time whose repeats spread by exactly 10% of the median is noted, not warned
    about; 10.5% is warned about (printed as 11%)."""
    from reports.phases import from_bench_row

    row = {"file": "b.csv", "mode": "dflash", "concurrency": 4, "ms_step": 10.0, "ms_step_min": 10.0}
    calm = from_bench_row({**row, "ms_step_max": 11.0}).notes
    assert any("ms_step: median 10.0 ms, min 10.0, max 11.0" in n for n in calm)
    assert not any("warning" in n for n in calm)
    noisy = from_bench_row({**row, "ms_step_max": 11.05}).notes
    assert any("warning: repeats disagree by 11%" in n for n in noisy)


def test_a_zero_median_step_time_gives_no_spread_note() -> None:
    """A spread is read against the median: with a median of 0 there is no note (and no
    division by zero)."""
    from reports.phases import from_bench_row

    row = {"file": "b.csv", "mode": "plain", "concurrency": 1, "ms_step": 0.0}
    notes = from_bench_row({**row, "ms_step_min": 0.0, "ms_step_max": 1.0}).notes
    assert not any("ms_step" in n for n in notes)


def test_an_unknown_profile_source_is_refused(tmp_path: Path) -> None:
    """`load_profiles` takes only auto, nsys or timer as its source."""
    from reports.phases import ProfileError, load_profiles

    for source in ("", "nvtx"):
        with pytest.raises(ProfileError, match="source must be auto, nsys or timer"):
            load_profiles(tmp_path, source)


def test_a_spread_with_only_its_maximum_known_is_not_a_disagreement() -> None:
    """`disagreements` needs both ends of the range; a row with only `<col>_max` gives none."""
    row = {"mode": "plain", "concurrency": 1, "x": 10.0, "x_max": 20.0}
    assert bench.disagreements(row, ["x"]) == []
    assert bench.disagreements({**row, "x_min": 10.0}, ["x"]) == [
        "plain c=1 x 10.0 (10.0-20.0, 100% of the median)"
    ]


def test_the_draft_parts_table_prints_shares_in_percent(capsys: pytest.CaptureFixture[str]) -> None:
    """The conv and selector shares of the draft phase are printed as percentages."""
    drafts.print_drafts([_draft_row("dflash2", 3.0, 20.0, 10, 4, 8)])
    assert "fast | 2 | 10.0 | 0.50 | 20.0 | 0.50" in capsys.readouterr().out


def test_a_capture_of_other_reports_only_has_no_table_of_the_one_asked_for() -> None:
    """When a stdout capture is split into sections and none is the report asked for, there is
    no table, even if another report's header has the same column names."""
    text = (
        "Processing [r.sqlite] with [/opt/nsys/reports/cuda_kern_exec_sum.py]...\n"
        "Total Time (ns),Instances,Name\n"
        "1000,2,gemm\n"
    )
    assert nsys.read_table(text, "cuda_gpu_kern_sum") is None
    section = text.replace("cuda_kern_exec_sum", "cuda_gpu_kern_sum")
    assert nsys.read_table(section, "cuda_gpu_kern_sum")["kernel"].tolist() == ["gemm"]
