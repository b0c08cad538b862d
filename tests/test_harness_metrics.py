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


def test_a_failed_request_adds_nothing_to_throughput_or_latency() -> None:
    """A request that failed (a stream cut off after some tokens keeps its count) is counted
    as failed, and adds no request, token or latency to the rates."""
    ok = record(0, None, 0.01, [0.004, 0.004], [2, 2])  # 5 tokens
    cut = RequestRecord(1, 0.0, success=False, error="stream cut", ttft_s=0.002, e2e_s=0.5)
    cut.output_tokens, cut.chunk_times_s, cut.chunk_tokens = 3, [0.002, 0.003], [1, 2]
    row = calculate_metrics([ok, cut], duration_s=1.0)
    assert (row["completed"], row["failed"]) == (1, 1)
    assert row["request_throughput"] == pytest.approx(1.0)
    assert row["output_tokens_per_s"] == pytest.approx(5.0)
    assert row["ttft_ms_mean"] == pytest.approx(10.0)
    assert row["achieved_concurrency"] == pytest.approx(ok.e2e_s)


def test_where_the_token_counts_came_from_names_every_source_when_requests_differ() -> None:
    """One source for every completed request is named alone; requests that differ are each
    counted, so an estimate behind a few requests is not hidden behind the first source."""
    from harness.metrics import count_sources

    def counted(index: int, source: str, success: bool = True) -> RequestRecord:
        return RequestRecord(index, 0.0, success=success, count_source=source)

    same = [counted(0, "server_ids"), counted(1, "server_ids"), counted(2, "estimated", success=False)]
    assert count_sources(same) == "server_ids"
    sources = ["tokenizer", "estimated", "tokenizer", "tokenizer"]
    mixed = [counted(i, source) for i, source in enumerate(sources)]
    assert count_sources(mixed) == "tokenizer (3), estimated (1)"
