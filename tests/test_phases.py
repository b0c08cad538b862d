"""reports/phases.py: the phase breakdown adds up to the step time, from either source; its
nesting (which phases run inside which) is the engine's, checked on the NVTX ranges a real
engine emits; a real CPU benchmark CSV becomes a breakdown that sums to its ms_step."""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from reference_engine import bench
from reference_engine.checkpoint import load_draft, load_target
from reference_engine.runtime import stats
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.profiling import RANGE_NAMES, NvtxRanges
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.stats import PHASES
from reports import nsys
from reports.phases import (
    NESTED,
    OTHER,
    STEP,
    TOP_LEVEL,
    PhaseTimes,
    ProfileError,
    bench_rows,
    breakdown,
    from_bench_row,
    load_profiles,
)
from tests.test_profiling import FakeNvtx


def parents(events: list[tuple[str, str | None]]) -> dict[str, set[str]]:
    """Each range name -> the names of the ranges it was opened inside (directly)."""
    stack: list[str] = []
    out: dict[str, set[str]] = {}
    for kind, name in events:
        if kind == "push":
            out.setdefault(name, set()).add(stack[-1] if stack else "")
            stack.append(name)
        else:
            stack.pop()
    return out


def test_the_report_knows_the_engine_phase_and_range_names() -> None:
    assert nsys.RANGE_NAMES == RANGE_NAMES
    assert {STEP, *TOP_LEVEL, *NESTED} == set(RANGE_NAMES)
    assert {*TOP_LEVEL, *NESTED} == set(PHASES)
    assert NESTED == stats.NESTED


def test_the_nesting_is_the_engines(tiny_pair) -> None:
    """Top-level phases open directly inside `step`, nested ones only inside their parents,
    for a plain and a speculative engine (prefill's sample, decode's sample) and an eager
    DFlash2 draft (draft's conv and selector)."""
    hybrid_dir, dflash_dir = tiny_pair("qwen3_5", block_size=4)
    hybrid = load_target(hybrid_dir, dtype=torch.float64)
    dense_dir, dflash2_dir = tiny_pair("qwen3", block_size=4, draft_arch="dflash2")
    dense = load_target(dense_dir, dtype=torch.float64)
    dflash, dflash2 = load_draft(dflash_dir, hybrid), load_draft(dflash2_dir, dense)
    seen: dict[str, set[str]] = {}
    for target, spec in ((hybrid, None), (hybrid, dflash), (dense, dflash2)):
        fake = FakeNvtx()
        engine = Engine(target, spec, EngineConfig(max_num_seqs=2), NvtxRanges(True, fake))
        oracle = OracleProposer(list(range(100, 120)), [2], 512) if spec else None
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True), oracle=oracle)
        while engine.has_unfinished():
            engine.step()
        for name, where in parents(fake.events).items():
            seen.setdefault(name, set()).update(where)
    assert seen.pop(STEP) == {""}
    for phase, where in seen.items():
        expected = {STEP} if phase in TOP_LEVEL else set(NESTED[phase])
        assert where == expected, phase
    assert set(seen) == {*TOP_LEVEL, *NESTED}


def test_other_closes_the_sum_and_nested_phases_stay_out_of_it() -> None:
    times = PhaseTimes(
        label="dflash-c4",
        mode="dflash",
        concurrency=4,
        source="nsys",
        step_ms=100.0,
        phase_ms={
            "schedule": 1.0,
            "prefill": 9.0,
            "draft": 20.0,
            "verify": 40.0,
            "accept": 10.0,
            "commit": 15.0,
            "sample": 2.0,
        },
        instances={STEP: 10, "draft": 10, "sample": 4},
        gpu_ms={STEP: 90.0, "draft": 25.0, "verify": 45.0},
        output_tokens=50,
    )
    table = breakdown(times)
    assert list(table.index) == [
        "schedule",
        "prefill",
        "draft",
        "verify",
        "accept",
        "commit",
        OTHER,
        "sample",
        STEP,
    ]
    assert table.loc[OTHER, "total_ms"] == pytest.approx(5.0)
    assert table[table.summed]["total_ms"].sum() == pytest.approx(100.0)
    assert table.loc["sample", "inside"] == "prefill, decode"
    assert table.loc["draft", "mean_ms"] == pytest.approx(2.0)
    assert math.isnan(table.loc["verify", "mean_ms"])  # instances unknown
    assert table.loc["verify", "share_pct"] == pytest.approx(40.0)
    assert table.loc["verify", "per_token_ms"] == pytest.approx(0.8)
    assert table.loc[OTHER, "gpu_ms"] == pytest.approx(20.0)  # step's GPU time outside phases
    assert "decode" not in table.index  # a phase that never ran gets no row


@pytest.fixture(scope="module")
def cpu_bench_csv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real engine benchmark on the CPU: a small random Qwen3 shape, tiny lengths."""
    directory = tmp_path_factory.mktemp("profile")
    with contextlib.redirect_stdout(io.StringIO()):
        code = bench.main(
            [
                "--random-shape",
                "qwen3-small",
                "--dtype",
                "float32",
                "--device",
                "cpu",
                "--concurrency",
                "1,2",
                "--repeats",
                "1",
                "--input-len",
                "8",
                "--output-len",
                "8",
                "--oracle-acceptance",
                "4",
                "--out",
                str(directory / "bench.csv"),
            ]
        )
    assert code == 0
    return directory


def test_a_cpu_benchmark_csv_breaks_down_to_its_step_time(cpu_bench_csv: Path) -> None:
    rows = pd.read_csv(cpu_bench_csv / "bench.csv")
    profiles = load_profiles(cpu_bench_csv)
    assert [p.label for p in profiles] == ["plain-c1", "dflash-c1", "plain-c2", "dflash-c2"]
    for times, (_, row) in zip(profiles, rows.sort_values("concurrency", kind="stable").iterrows()):
        assert times.source == "timer" and times.mode == row["mode"]
        table = breakdown(times)
        summed = table[table.summed]["total_ms"].sum()
        assert summed == pytest.approx(row["ms_step"], rel=1e-6)
        # one repeat on the host clock: the phases lie inside the steps, so other >= 0
        assert table.loc[OTHER, "total_ms"] >= 0
        assert table.loc[STEP, "instances"] == row["steps"]
        assert table.loc["schedule", "instances"] == row["steps"]
        assert table.loc["prefill", "total_ms"] == pytest.approx(row["ms_prefill"])
        assert times.output_tokens == row["output_tokens"]
        speculative = {"draft", "verify", "accept", "commit"}
        ran = set(table.index) - {OTHER, STEP, "sample"}
        assert ran == (
            {"schedule", "prefill", "decode"}
            if row["mode"] == "plain"
            else {"schedule", "prefill"} | speculative
        )


def test_benchmark_rows_of_other_csvs_and_older_benchmarks_are_ignored(tmp_path: Path) -> None:
    (tmp_path / "notes.csv").write_text("a,b\n1,2\n")
    (tmp_path / "old.csv").write_text("mode,concurrency,ms_prefill\nplain,1,3.0\n")
    (tmp_path / "broken.csv").write_bytes(b"\xff\xfe\x00garbage")
    assert bench_rows(tmp_path) == {}
    with pytest.raises(ProfileError, match="nothing to profile"):
        load_profiles(tmp_path)
    with pytest.raises(ProfileError, match="does not exist"):
        load_profiles(tmp_path / "absent")


def test_a_gpu_benchmark_row_says_its_phases_are_cuda_event_time() -> None:
    row = {
        "mode": "dflash",
        "concurrency": 8,
        "ms_step": 10.0,
        "ms_verify": 6.0,
        "ms_draft": 3.0,
        "phase_clock": "cuda_events",
        "steps": 4,
        "output_tokens": 20,
        "repeats": 3,
        "file": "bench.csv",
    }
    times = from_bench_row(row)
    assert any("CUDA-event time" in note for note in times.notes)
    assert breakdown(times).loc[OTHER, "total_ms"] == pytest.approx(1.0)


def test_a_csv_named_after_a_capture_wins_over_another_benchmark_csv(tmp_path: Path) -> None:
    """Two benchmark CSVs with a row for the same run: the one named after the capture
    (`<mode>-c<concurrency>.csv`) is read last and wins, whatever the names' order."""
    header = "mode,concurrency,ms_step\n"
    (tmp_path / "plain-c1.csv").write_text(header + "plain,1,7.0\n")
    (tmp_path / "zz_sweep.csv").write_text(header + "plain,1,9.0\nplain,2,5.0\n")
    rows = bench_rows(tmp_path)
    assert [(r["file"], r["ms_step"]) for r in rows[("plain", 1)]] == [("plain-c1.csv", 7.0)]
    assert [r["file"] for r in rows[("plain", 2)]] == ["zz_sweep.csv"]


@pytest.mark.parametrize(("low", "high", "warned"), [(48.0, 52.0, False), (46.0, 54.0, True)])
def test_repeats_more_than_ten_percent_apart_are_warned_about(low: float, high: float, warned: bool) -> None:
    """The step time's spread over repeats, (max - min) / median, is noted; past 10% (here
    16% against 8%) the note is a warning that the run is not stable."""
    row = {
        "mode": "plain",
        "concurrency": 2,
        "ms_step": 50.0,
        "ms_step_min": low,
        "ms_step_max": high,
        "file": "b.csv",
    }
    notes = [n for n in from_bench_row(row).notes if "ms_step" in n]
    assert len(notes) == 1
    assert notes[0].startswith("**warning: repeats disagree by 16%**") is warned
