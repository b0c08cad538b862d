"""Measure one server: warm-up, then the measured requests at a fixed concurrency (and an
optional arrival rate), per concurrency of a sweep; per-request rows appended to
`requests.jsonl` as they complete, one summary row per (label, concurrency, repeat)."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .client import Endpoint, RequestRecord, payload, send
from .metrics import GROUP_LATENCIES, calculate_metrics, count_sources
from .prometheus import acceptance_from_counters, acceptance_from_requests, scrape
from .workloads import GROUPS, Prompt, arrivals


@dataclass(frozen=True)
class LoadSpec:
    concurrency: int
    num_prompts: int
    output_len: int
    warmup: int = 2
    request_rate: float = math.inf
    burstiness: float = 1.0
    timeout_s: float = 300.0
    seed: int = 0
    slo_ms: dict = field(default_factory=dict)


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done, self.failed = total, label, 0, 0
        self.start = time.perf_counter()

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += not record.success
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        rate = self.done / max(time.perf_counter() - self.start, 1e-9)
        sys.stderr.write(
            f"\r  {self.label} [{'#' * filled}{'.' * (width - filled)}] "
            f"{self.done}/{self.total} {rate:.1f} req/s failed {self.failed}"
        )
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


async def run_requests(
    endpoint: Endpoint, prompts: list[Prompt], spec: LoadSpec, on_record=None, label: str = ""
) -> tuple[list[RequestRecord], float]:
    """Send the prompts with at most `concurrency` in flight; returns records (in prompt
    order) and the wall time from the first send to the last completion."""
    limits = httpx.Limits(max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency)
    semaphore = asyncio.Semaphore(spec.concurrency)
    progress = Progress(len(prompts), label) if label else None
    records: list[RequestRecord | None] = [None] * len(prompts)
    async with httpx.AsyncClient(limits=limits, timeout=spec.timeout_s) as client:
        start = time.perf_counter()

        async def one(i: int) -> None:
            async with semaphore:
                prompt = prompts[i]
                body = payload(endpoint, prompt, prompt.max_tokens or spec.output_len)
                record = await send(client, endpoint, body, i, start, spec.timeout_s)
            record.group = prompt.group
            records[i] = record
            if on_record is not None:
                on_record(record)
            if progress is not None:
                progress.update(record)

        tasks = []
        async for i in arrivals(len(prompts), spec.request_rate, spec.burstiness, spec.seed):
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return records, duration


def measure(
    endpoint: Endpoint,
    prompts: list[Prompt],
    spec: LoadSpec,
    out_dir: Path,
    labels: dict,
    metrics_url: str | None,
) -> dict:
    """Warm up, snapshot counters, run, snapshot again; write rows; return the summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    warm = prompts[: spec.warmup]
    if warm:
        asyncio.run(run_requests(endpoint, warm, LoadSpec(**{**spec.__dict__, "request_rate": math.inf})))
    before = scrape(metrics_url) if metrics_url else None
    requests_file = out_dir / "requests.jsonl"

    with requests_file.open("a") as sink:

        def keep(record: RequestRecord) -> None:  # as each completes: nothing is lost
            sink.write(json.dumps(record.as_row(**labels)) + "\n")
            sink.flush()

        name = f"{labels.get('label', '')} c={spec.concurrency}".strip()
        records, duration = asyncio.run(run_requests(endpoint, prompts[spec.warmup :], spec, keep, name))
    after = scrape(metrics_url) if metrics_url else None
    summary = {**labels, **calculate_metrics(records, duration, spec.slo_ms)}
    acceptance = acceptance_from_requests(records)
    counters = acceptance_from_counters(before, after)
    summary |= {**acceptance, **counters}  # counters win: they are the server's own totals
    if "acceptance_histogram" in acceptance:
        summary["acceptance_histogram"] = acceptance["acceptance_histogram"]
    summary["count_source"] = count_sources(records)
    summary["streams_without_done"] = sum(1 for r in records if r.success and not r.done_marker)
    summary["server_kind"] = endpoint.accepts.name if endpoint.server else "ours (not probed)"
    errors = [r.error for r in records if not r.success]
    summary["errors"] = "; ".join(sorted(set(errors)))[:500]
    append_summary(out_dir / "summary.csv", summary)
    return summary


SUMMARY_COLUMNS = [
    "label",
    "concurrency",
    "repeat",
    "completed",
    "failed",
    "duration_s",
    "request_throughput",
    "output_tokens_per_s",
    *[
        f"{m}_{s}"
        for m in ("ttft_ms", "tpot_ms", "itl_token_ms", "itl_chunk_ms", "e2e_ms")
        for s in ("mean", "median", "p90", "p99")
    ],
    "achieved_concurrency",
    "goodput_requests_per_s",
    "acceptance_length",
    "acceptance_rate",
    "acceptance_per_position",
    "acceptance_histogram",
    "acceptance_source",
    "errors",
    "count_source",
    "server_kind",
    "streams_without_done",
    *[
        f"{m}_{group}_{s}"
        for group in GROUPS
        for m in GROUP_LATENCIES
        for s in ("mean", "median", "p90", "p99")
    ],
]


def append_summary(path: Path, row: dict) -> None:
    """Append one row; a summary that exists keeps its own header (a resumed folder written by
    an older harness with fewer columns stays readable by column)."""
    new = not path.exists() or path.stat().st_size == 0  # a file a full disk left empty too
    columns = SUMMARY_COLUMNS
    if not new:
        with path.open(newline="") as f:
            columns = next(csv.reader(f), None) or SUMMARY_COLUMNS
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in row.items()})


def done_runs(path: Path) -> set[tuple[str, int, int]]:
    """(label, concurrency, repeat) already in a summary: a resumed run skips them."""
    if not path.exists():
        return set()
    with path.open() as f:
        return {(r["label"], int(r["concurrency"]), int(r["repeat"])) for r in csv.DictReader(f)}
