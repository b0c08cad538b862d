"""reports/nsys.py: nsys stats CSVs are read by header name whatever the column order or
time unit, after any preamble, from per-report files or a stdout capture; range names map
to engine phases and other domains are dropped. Expected values come from the fixture
files themselves (read here with the csv module), so real captures can replace them."""

from __future__ import annotations

import csv
import io
import shutil
from pathlib import Path

import pandas as pd
import pytest

from reports.nsys import REPORTS, NsysError, capture_labels, load_capture, phase_of, read_table, top_kernels
from reports.phases import STEP, breakdown, from_capture

FIXTURES = Path(__file__).parent / "fixtures" / "nsys"
LABELS = sorted(p.name[: -len("_nvtx_sum.csv")] for p in FIXTURES.glob("*_nvtx_sum.csv"))
GENERATING = "Generating SQLite file {label}.sqlite from {label}.nsys-rep\n"
PROCESSING = (
    "Processing [{label}.sqlite] with [/opt/nvidia/nsight-systems/2025.3.1/host-linux-x64/"
    "reports/{report}.py]... \n"
)


def rows(label: str, report: str) -> list[dict[str, str]]:
    with open(FIXTURES / f"{label}_{report}.csv", newline="") as f:
        return list(csv.DictReader(f))


def expected_ms(label: str, report: str, column: str) -> dict[str, float]:
    """Our-domain ranges of a fixture -> the column's value in ms, read without our parser."""
    out: dict[str, float] = {}
    for row in rows(label, report):
        if row["Range"].startswith("dflash:"):
            name = row["Range"].removeprefix("dflash:")
            out[name] = out.get(name, 0.0) + float(row[column]) / 1e6
    return out


def write_csv(path: Path, header: list[str], body: list[list[str]], preamble: str = "") -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(body)
    path.write_text(preamble + buffer.getvalue())


def copy_label(label: str, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for report in REPORTS:
        shutil.copy(FIXTURES / f"{label}_{report}.csv", directory)
    return directory


def test_the_fixtures_hold_a_plain_and_a_dflash_capture() -> None:
    assert {"plain-c1", "dflash-c1"} <= set(LABELS)
    assert capture_labels(FIXTURES) == LABELS


def test_a_real_stdout_capture_reads_like_the_files_of_the_same_capture() -> None:
    captured = load_capture(FIXTURES / "stdout", "dflash-c1")
    files = load_capture(FIXTURES / "small", "dflash-c1")
    assert captured.missing == ()
    pd.testing.assert_frame_equal(captured.ranges, files.ranges)
    pd.testing.assert_frame_equal(captured.gpu, files.gpu)
    pd.testing.assert_frame_equal(captured.kernels, files.kernels)


@pytest.mark.parametrize("label", LABELS)
def test_host_and_gpu_times_per_phase_equal_the_files(label: str) -> None:
    capture = load_capture(FIXTURES, label)
    assert capture.missing == ()
    host = expected_ms(label, "nvtx_sum", "Total Time (ns)")
    assert capture.ranges["total_ms"].to_dict() == pytest.approx(host, rel=1e-12)
    gpu = expected_ms(label, "nvtx_gpu_proj_sum", "Total Proj Time (ns)")
    assert capture.gpu["gpu_ms"].to_dict() == pytest.approx(gpu, rel=1e-12)
    instances = {
        r["Range"].removeprefix("dflash:"): int(r["Instances"])
        for r in rows(label, "nvtx_sum")
        if r["Range"].startswith("dflash:")
    }
    assert capture.ranges["instances"].astype(int).to_dict() == instances


@pytest.mark.parametrize("label", LABELS)
def test_the_breakdown_sums_to_the_step_total(label: str) -> None:
    times = from_capture(load_capture(FIXTURES, label), {})
    table = breakdown(times)
    step = expected_ms(label, "nvtx_sum", "Total Time (ns)")[STEP]
    assert table.loc[STEP, "total_ms"] == pytest.approx(step, rel=1e-12)
    assert table[table.summed]["total_ms"].sum() == pytest.approx(step, rel=1e-6)
    assert table[table.summed]["share_pct"].sum() == pytest.approx(100.0, rel=1e-6)
    # sample runs inside prefill and decode: listed, never summed
    if "sample" in table.index:
        assert not table.loc["sample", "summed"] and table.loc["sample", "inside"]


def test_columns_in_another_order_parse_the_same(tmp_path: Path) -> None:
    for report in REPORTS:
        with open(FIXTURES / f"dflash-c1_{report}.csv", newline="") as f:
            header, *body = list(csv.reader(f))
        order = list(reversed(range(len(header))))
        write_csv(
            tmp_path / f"dflash-c1_{report}.csv",
            [header[i] for i in order],
            [[r[i] for i in order] for r in body],
        )
    moved, original = load_capture(tmp_path, "dflash-c1"), load_capture(FIXTURES, "dflash-c1")
    pd.testing.assert_frame_equal(moved.ranges, original.ranges)
    pd.testing.assert_frame_equal(moved.gpu, original.gpu)
    pd.testing.assert_frame_equal(moved.kernels, original.kernels)


def test_a_preamble_before_the_header_is_skipped(tmp_path: Path) -> None:
    for report in REPORTS:
        text = (FIXTURES / f"plain-c1_{report}.csv").read_text()
        preamble = (
            "NOTICE: Existing SQLite export found.\n"
            + GENERATING.format(label="plain-c1")
            + PROCESSING.format(label="plain-c1", report=report)
        )
        (tmp_path / f"plain-c1_{report}.csv").write_text(preamble + text)
    with_preamble, original = load_capture(tmp_path, "plain-c1"), load_capture(FIXTURES, "plain-c1")
    pd.testing.assert_frame_equal(with_preamble.ranges, original.ranges)
    pd.testing.assert_frame_equal(with_preamble.kernels, original.kernels)


def test_a_stdout_capture_in_another_report_order_reads_like_the_files(tmp_path: Path) -> None:
    """`nsys stats --report a,b,c --format csv REP > <label>.txt`: one text, each report
    after its `Processing [...]` line, blank lines between."""
    text = GENERATING.format(label="dflash-c1")
    for report in ("cuda_gpu_kern_sum", "nvtx_sum", "nvtx_gpu_proj_sum"):
        text += PROCESSING.format(label="dflash-c1", report=report)
        text += (FIXTURES / f"dflash-c1_{report}.csv").read_text() + "\n"
    (tmp_path / "dflash-c1.txt").write_text(text)
    assert capture_labels(tmp_path) == ["dflash-c1"]
    captured, original = load_capture(tmp_path, "dflash-c1"), load_capture(FIXTURES, "dflash-c1")
    pd.testing.assert_frame_equal(captured.ranges, original.ranges)
    pd.testing.assert_frame_equal(captured.gpu, original.gpu)
    pd.testing.assert_frame_equal(captured.kernels, original.kernels)


def test_other_domains_are_dropped_and_the_default_domain_counts(tmp_path: Path) -> None:
    copy_label("dflash-c1", tmp_path)
    path = tmp_path / "dflash-c1_nvtx_sum.csv"
    with open(path, newline="") as f:
        header, *body = list(csv.reader(f))
    total, count, name = (header.index(c) for c in ("Total Time (ns)", "Instances", "Range"))

    def extra(range_name: str, ns: int) -> list[str]:
        row = list(body[0])
        row[total], row[count], row[name] = str(ns), "3", range_name
        return row

    body += [
        extra(":verify", 5_000_000),
        extra("PushPop:dflash:verify", 1_000_000),
        extra("other:verify", 7_000_000),
        extra("NCCL:step", 9_000_000),
        extra(":mixer: MoE", 11_000_000),
        extra("dflash:not_a_phase", 13_000_000),
    ]
    write_csv(path, header, body)
    ranges = load_capture(tmp_path, "dflash-c1").ranges
    original = load_capture(FIXTURES, "dflash-c1").ranges
    assert ranges.loc["verify", "total_ms"] == pytest.approx(original.loc["verify", "total_ms"] + 6.0)
    assert ranges.loc["verify", "instances"] == original.loc["verify", "instances"] + 6
    assert ranges.loc[STEP, "total_ms"] == original.loc[STEP, "total_ms"]
    assert list(ranges.index) == list(original.index)


@pytest.mark.parametrize(
    ("name", "phase"),
    [
        ("dflash:verify", "verify"),
        (":verify", "verify"),
        ("verify", "verify"),
        ("dflash:step", "step"),
        ("PushPop:dflash:draft", "draft"),
        ("[StartEnd] :commit", "commit"),
        ("Push/Pop: dflash:sample", "sample"),
        ("nccl:verify", None),
        (":mixer: MoE", None),
        ("dflash:forward", None),
        (":dflash/draft", None),
        ("", None),
    ],
)
def test_range_names_map_to_phases(name: str, phase: str | None) -> None:
    assert phase_of(name) == phase


def test_time_units_come_from_the_header() -> None:
    text = (
        "Time (%),Total Time (us),Instances,Avg (us),Style,Range\n"
        "60.0,1500.5,3,500.2,PushPop,dflash:verify\n"
        "40.0,1000,2,500,PushPop,dflash:draft\n"
    )
    table = read_table(text, "nvtx_sum")
    assert table["total_ms"].tolist() == pytest.approx([1.5005, 1.0])
    seconds = read_table(text.replace("(us)", "(s)"), "nvtx_sum")
    assert seconds["total_ms"].tolist() == pytest.approx([1_500_500.0, 1_000_000.0])


def test_the_top_kernels_are_the_longest_with_names_intact() -> None:
    kernels = load_capture(FIXTURES, "plain-c1").kernels
    fixture = rows("plain-c1", "cuda_gpu_kern_sum")
    top = top_kernels(kernels, 3)
    by_total = sorted(fixture, key=lambda r: -float(r["Total Time (ns)"]))[:3]
    assert top["kernel"].tolist() == [r["Name"] for r in by_total]  # commas inside names kept
    assert top["total_ms"].tolist() == pytest.approx([float(r["Total Time (ns)"]) / 1e6 for r in by_total])
    all_ms = sum(float(r["Total Time (ns)"]) for r in fixture) / 1e6
    assert top["share_pct"].tolist() == pytest.approx([100 * t / all_ms for t in top["total_ms"]])
    assert len(top_kernels(kernels, 1000)) == len(fixture)


def test_an_absent_or_skipped_report_is_missing_not_fatal(tmp_path: Path) -> None:
    copy_label("plain-c1", tmp_path)
    (tmp_path / "plain-c1_cuda_gpu_kern_sum.csv").unlink()
    (tmp_path / "plain-c1_nvtx_gpu_proj_sum.csv").write_text(
        "SKIPPED: plain-c1.sqlite does not contain GPU projection data.\n"
    )
    capture = load_capture(tmp_path, "plain-c1")
    assert capture.missing == ("nvtx_gpu_proj_sum", "cuda_gpu_kern_sum")
    assert capture.ranges is not None and capture.gpu is None and capture.kernels is None


def test_a_file_without_the_report_table_is_an_error_naming_it(tmp_path: Path) -> None:
    copy_label("plain-c1", tmp_path)
    (tmp_path / "plain-c1_nvtx_sum.csv").write_text("Name,Count\nfoo,1\n")
    with pytest.raises(NsysError, match=r"plain-c1_nvtx_sum.csv: no nvtx_sum table .*'Name,Count'"):
        load_capture(tmp_path, "plain-c1")


def test_the_first_alias_wins_over_an_earlier_column_with_a_later_alias() -> None:
    """A GPU projection report with both `Instances` and `Range Instances` counts the range's
    instances (the first alias), wherever the columns stand."""
    text = (
        "Range,Style,Instances,Total Proj Time (ns),Range Instances\n"
        ":verify,PushPop,99,2000000,4\n"
        ":draft,PushPop,98,1000000,3\n"
    )
    table = read_table(text, "nvtx_gpu_proj_sum")
    assert table["instances"].tolist() == [4, 3]
    assert table["gpu_ms"].tolist() == pytest.approx([2.0, 1.0])


def test_a_report_without_the_optional_range_time_leaves_it_unknown_not_zero(tmp_path: Path) -> None:
    """`Total Range Time` is optional in nvtx_gpu_proj_sum: without it the phase's range_ms
    is NaN (unknown), not a sum of nothing that reads as 0 ms."""
    copy_label("plain-c1", tmp_path)
    write_csv(
        tmp_path / "plain-c1_nvtx_gpu_proj_sum.csv",
        ["Range", "Style", "Total Proj Time (ns)", "Range Instances"],
        [[":verify", "PushPop", "3000000", "2"], ["dflash:verify", "PushPop", "1000000", "1"]],
    )
    gpu = load_capture(tmp_path, "plain-c1").gpu
    assert gpu.loc["verify", "gpu_ms"] == pytest.approx(4.0)
    assert gpu.loc["verify", "instances"] == 3
    assert pd.isna(gpu.loc["verify", "range_ms"])


def test_a_kernels_mean_time_is_in_microseconds_per_launch() -> None:
    """top_kernels: mean_us = total ms x 1000 / instances (a kernel never launched: NaN)."""
    kernels = pd.DataFrame({"kernel": ["gemm", "idle"], "instances": [4, 0], "total_ms": [2.0, 0.0]})
    top = top_kernels(kernels, 2)
    assert top["mean_us"].iloc[0] == pytest.approx(500.0)
    assert pd.isna(top["mean_us"].iloc[1])
    assert top["share_pct"].tolist() == pytest.approx([100.0, 0.0])


def test_a_captures_output_tokens_are_one_runs_tokens_times_its_repeats() -> None:
    """The capture spans every measured repeat, the benchmark CSV's output_tokens one run: the
    capture's tokens are their product (a row without repeats counts one)."""
    capture = load_capture(FIXTURES, "plain-c1")
    times = from_capture(capture, {("plain", 1): [{"output_tokens": 40, "repeats": 3}]})
    assert (times.mode, times.concurrency, times.output_tokens) == ("plain", 1, 120)
    assert from_capture(capture, {("plain", 1): [{"output_tokens": 40}]}).output_tokens == 40
    assert from_capture(capture, {("plain", 8): [{"output_tokens": 40}]}).output_tokens is None


def test_a_time_header_without_a_unit_is_in_nanoseconds() -> None:
    """nsys's default time unit is the nanosecond: a `Total Time` header with no unit reads
    as ns."""
    text = "Time (%),Total Time,Instances,Range\n100.0,2500000,5,dflash:verify\n"
    assert read_table(text, "nvtx_sum")["total_ms"].tolist() == pytest.approx([2.5])
