"""Every figure the engine benchmark prints carries its spread over the repeats (min and max),
and repeats that disagree by more than 10% are warned about; the profile report built from
its CSV says the same (reference_engine/bench/, reports/phases.py)."""

from __future__ import annotations

import pytest

from reference_engine import bench
from reports.phases import from_bench_row


def run_row(tokens_per_s: float, ms_step: float) -> dict:
    return {
        "mode": "dflash",
        "draft": "dflash",
        "numerics": "exact",
        "concurrency": 4,
        "output_tokens_per_s": tokens_per_s,
        "ms_per_step": ms_step / 40,
        "mean_acceptance_length": 2.5,
        **{f"ms_{p}": 10.0 for p in bench.PHASES},
        "ms_step": ms_step,
        "phase_clock": "host",
        "steps": 40,
        "output_tokens": 256,
        "wall_s": 1.0,
    }


def test_medians_carry_min_and_max_and_disagreeing_repeats_are_warned_about(
    capsys: pytest.CaptureFixture[str],
) -> None:
    steady = bench.median_row([run_row(100.0, 50.0), run_row(102.0, 51.0), run_row(101.0, 50.5)])
    assert (
        steady["output_tokens_per_s"],
        steady["output_tokens_per_s_min"],
        steady["output_tokens_per_s_max"],
    ) == (101.0, 100.0, 102.0)
    noisy = bench.median_row([run_row(100.0, 50.0), run_row(130.0, 51.0), run_row(110.0, 50.5)])
    bench.print_table([steady])
    calm = capsys.readouterr().out
    assert "101.0 (100.0-102.0)" in calm and "warning" not in calm
    bench.print_table([noisy])
    out = capsys.readouterr().out
    assert "110.0 (100.0-130.0)" in out
    assert (
        "# warning: repeats disagree by more than 10%: dflash c=4 output_tokens_per_s "
        "110.0 (100.0-130.0, 27% of the median)"
    ) in out


def test_the_spread_is_read_against_the_median() -> None:
    """95 to 105.5 around a median of 100 spreads by 10.5% of the median: warned (against the
    highest repeat it would be 9.95%, and against the lowest 11.1%: 96 to 106 is 10% of the
    median, not warned)."""
    wide = bench.median_row([run_row(95.0, 50.0), run_row(100.0, 50.0), run_row(105.5, 50.0)])
    assert [w.split(" (")[0] for w in bench.disagreements(wide, ["output_tokens_per_s"])] == [
        "dflash c=4 output_tokens_per_s 100.0"
    ]
    edge = bench.median_row([run_row(96.0, 50.0), run_row(100.0, 50.0), run_row(106.0, 50.0)])
    assert bench.disagreements(edge, ["output_tokens_per_s"]) == []


def test_the_profile_report_names_the_spread_and_warns_when_repeats_disagree() -> None:
    steady = {**bench.median_row([run_row(100.0, 50.0), run_row(101.0, 51.0)]), "file": "b.csv"}
    notes = from_bench_row({k: str(v) for k, v in steady.items()}).notes
    assert "dflash-c4 ms_step: median 50.5 ms, min 50.0, max 51.0 over the repeats" in notes
    noisy = {**bench.median_row([run_row(100.0, 40.0), run_row(101.0, 60.0)]), "file": "b.csv"}
    notes = from_bench_row({k: str(v) for k, v in noisy.items()}).notes
    assert any(n.startswith("**warning: repeats disagree by 40%** (dflash-c4 ms_step") for n in notes)
