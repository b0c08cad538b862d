"""The harness client and metric math against a scripted SSE server on loopback."""

from __future__ import annotations

import asyncio
import json
import time

from harness.bench import LoadSpec, measure, run_requests
from harness.client import Endpoint
from harness.metrics import calculate_metrics, chunk_itl, per_token_itl, tpot
from harness.workloads import synthetic

from .sse_stub import Script, serve

# first chunk after 50 ms with 1 token, then 3 chunks 40 ms apart carrying 4, 1, 3 tokens
CHUNKS = [(0.05, [1]), (0.04, [2, 3, 4, 5]), (0.04, [6]), (0.04, [7, 8, 9])]
TOL = 0.015  # seconds: timer and scheduling noise on a busy 2-core machine


def one_record(script: Script):
    server, url = serve(script)
    try:
        spec = LoadSpec(concurrency=1, num_prompts=1, output_len=9, timeout_s=2.0)
        records, duration = asyncio.run(run_requests(Endpoint(url), synthetic(1, 4, 0), spec))
        return records[0], duration
    finally:
        server.shutdown()


def test_ttft_tpot_itl_e2e_equal_the_scripted_timing() -> None:
    record, duration = one_record(Script(CHUNKS))
    assert record.success and record.output_tokens == 9
    assert record.chunk_tokens == [1, 4, 1, 3]
    assert abs(record.ttft_s - 0.05) < TOL
    assert abs(record.e2e_s - 0.17) < TOL
    assert abs(tpot(record) - 0.12 / 8) < TOL / 8
    chunks = chunk_itl(record)
    assert all(abs(g - 0.04) < TOL for g in chunks)
    tokens = per_token_itl(record)  # each gap split among the tokens it brought
    assert len(tokens) == 8
    assert all(abs(t - 0.01) < TOL / 4 for t in tokens[:4])
    assert abs(tokens[4] - 0.04) < TOL
    assert all(abs(t - 0.04 / 3) < TOL / 3 for t in tokens[5:])
    row = calculate_metrics([record], duration)
    assert abs(row["output_tokens_per_s"] - 9 / duration) < 1e-9
    assert abs(row["itl_chunk_ms_mean"] - 40) < TOL * 1000
    assert row["itl_token_ms_mean"] < row["itl_chunk_ms_mean"]


def test_a_malformed_sse_line_is_a_counted_failure() -> None:
    record, _ = one_record(Script(CHUNKS, malformed_at=2))
    assert not record.success and "malformed SSE line" in record.error


def test_a_timeout_is_a_counted_failure() -> None:
    record, _ = one_record(Script(CHUNKS, hang_s=3.0))
    assert not record.success and "timed out" in record.error


def test_a_server_dying_mid_stream_is_a_counted_failure_and_rows_are_kept(tmp_path) -> None:
    server, url = serve(Script(CHUNKS, die_at=2))
    try:
        spec = LoadSpec(concurrency=2, num_prompts=4, output_len=9, warmup=0, timeout_s=2.0)
        summary = measure(Endpoint(url), synthetic(4, 4, 0), spec, tmp_path,
                          {"label": "A", "concurrency": 2, "repeat": 0}, None)
    finally:
        server.shutdown()
    assert summary["failed"] == 4 and summary["completed"] == 0
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["error"] for r in rows)
    assert (tmp_path / "summary.csv").read_text().count("\n") == 2


def test_one_client_process_sustains_hundreds_of_requests_per_second() -> None:
    """The client is not the bottleneck: against a stub that answers at once, one process
    completes this many short streaming requests per second (printed; floor asserted)."""
    server, url = serve(Script([(0.0, [1]), (0.0, [2, 3])]))
    try:
        spec = LoadSpec(concurrency=32, num_prompts=400, output_len=3, timeout_s=10.0)
        start = time.perf_counter()
        records, _ = asyncio.run(run_requests(Endpoint(url), synthetic(400, 4, 0), spec))
        rate = len(records) / (time.perf_counter() - start)
    finally:
        server.shutdown()
    assert all(r.success for r in records)
    print(f"\nclient ceiling: {rate:.0f} requests/s (3 tokens each, concurrency 32)")
    assert rate > 100


def test_the_same_seed_sends_the_same_prompts_in_the_same_order() -> None:
    assert synthetic(5, 8, seed=3) == synthetic(5, 8, seed=3)
    assert synthetic(5, 8, seed=3) != synthetic(5, 8, seed=4)


def test_poisson_arrivals_are_spread_at_the_requested_rate() -> None:
    from harness.workloads import arrivals

    async def times() -> list[float]:
        start, out = time.perf_counter(), []
        async for _ in arrivals(40, 200.0, 1.0, seed=1):
            out.append(time.perf_counter() - start)
        return out

    t = asyncio.run(times())
    # 39 gaps with mean 5 ms: the last arrival lands near 0.2 s, far from "all at once"
    assert 0.08 < t[-1] < 0.6
