"""Run metrics (harness/metrics.py): a workload's groups get their own TTFT and ITL."""

from __future__ import annotations

import math

import pytest

from harness.client import RequestRecord
from harness.metrics import calculate_metrics


def record(
    index: int, group: str | None, ttft_s: float, gaps: list[float], tokens: list[int]
) -> RequestRecord:
    times = [ttft_s]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(
        index,
        0.0,
        success=True,
        ttft_s=ttft_s,
        e2e_s=times[-1],
        chunk_times_s=times,
        chunk_tokens=[1, *tokens],
        output_tokens=1 + sum(tokens),
        group=group,
    )


def test_ttft_and_itl_are_reported_for_each_group_alone() -> None:
    records = [
        record(0, "short", 0.010, [0.004, 0.004], [1, 1]),
        record(1, "long", 0.200, [0.008], [2]),
        record(2, "short", 0.020, [0.006], [3]),
    ]
    row = calculate_metrics(records, duration_s=1.0)
    assert row["ttft_ms_short_mean"] == pytest.approx(15.0)
    assert row["ttft_ms_long_median"] == pytest.approx(200.0)
    assert row["itl_token_ms_long_mean"] == pytest.approx(4.0)  # one gap of 8 ms over 2 tokens
    assert row["itl_chunk_ms_long_mean"] == pytest.approx(8.0)
    assert row["itl_token_ms_short_mean"] == pytest.approx((4 + 4 + 2 + 2 + 2) / 5)
    assert row["ttft_ms_mean"] == pytest.approx((10 + 200 + 20) / 3)  # all requests, as before


def test_a_group_whose_requests_all_failed_reports_nan_and_untagged_runs_report_no_groups() -> None:
    failed = RequestRecord(1, 0.0, success=False, error="boom", group="long")
    row = calculate_metrics([record(0, "short", 0.01, [0.004], [1]), failed], duration_s=1.0)
    assert math.isnan(row["ttft_ms_long_median"])
    untagged = calculate_metrics([record(0, None, 0.01, [0.004], [1])], duration_s=1.0)
    assert not any("_short_" in k or "_long_" in k for k in untagged)
