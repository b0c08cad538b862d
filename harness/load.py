"""Measure one server: warm-up, then the measured requests at a fixed concurrency (and an
optional arrival rate), per concurrency of a sweep; per-request rows appended to
`requests.jsonl` as they complete, one summary row per (label, concurrency, repeat).

A closed-loop run can spread its streams over several client processes
(`LoadSpec.client_processes`): one asyncio process reads a few tens of thousands of SSE chunks
a second at most, and a client near that limit measures itself (its event loop's queue adds to
every TTFT and gap it times). Each process takes every P-th prompt and its share of the
concurrency (the most processes, up to the number asked for, that share it evenly), all
start on one signal, and their records come back to this process as they complete."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .client import Endpoint, RequestRecord, payload, send
from .metrics import GROUP_LATENCIES, calculate_metrics, count_sources
from .prometheus import (
    MetricsPageError,
    acceptance_from_counters,
    acceptance_from_requests,
    counter_contradictions,
    scrape,
    server_cpu,
)
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
    client_processes: int = 1  # closed loop only: processes the streams are spread over


# streams one client process takes in the automatic choice, and the share of the machine's
# cores the client may use (the servers under test usually run on the same machine)
STREAMS_PER_CLIENT = 8
CLIENT_CORE_SHARE = 4


def client_processes_for(concurrency: int, cpus: int | None = None) -> int:
    """The automatic number of client processes: one per STREAMS_PER_CLIENT streams, at most
    a CLIENT_CORE_SHARE-th of the cores this process may run on (one on a small machine)."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(-(-concurrency // STREAMS_PER_CLIENT), cpus // CLIENT_CORE_SHARE))


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
    """Send the prompts with at most `concurrency` in flight, from this process; returns
    records (in prompt order) and the wall time from the first send to the last completion."""
    records, duration, _ = await _run_here(endpoint, prompts, spec, on_record, label)
    return records, duration


async def _run_here(
    endpoint: Endpoint, prompts: list[Prompt], spec: LoadSpec, on_record=None, label: str = ""
) -> tuple[list[RequestRecord], float, float]:
    """`run_requests`, and the share of the run's wall time this process was busy on a core
    (its CPU time over the run's duration: near 1, the client measured its own queue)."""
    collected = Collected(len(prompts), on_record, label)
    items = list(enumerate(prompts))
    async with _client(spec.concurrency, spec) as client:
        start, cpu = time.perf_counter(), time.process_time()  # the client is built: the run starts
        end = await _send_all(client, endpoint, items, spec.concurrency, spec, start, collected.take)
        busy = (time.process_time() - cpu) / max(end - start, 1e-9)
    return collected.records, end - start, busy


class Collected:
    """A run's records as they complete, in prompt order: each handed to `on_record` and
    counted on the progress bar (shown when the run has a `label`)."""

    def __init__(self, count: int, on_record=None, label: str = "") -> None:
        self.records: list[RequestRecord | None] = [None] * count
        self.on_record = on_record
        self.progress = Progress(count, label) if label else None

    def take(self, record: RequestRecord) -> None:
        self.records[record.index] = record
        if self.on_record is not None:
            self.on_record(record)
        if self.progress is not None:
            self.progress.update(record)


def _client(concurrency: int, spec: LoadSpec) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(limits=limits, timeout=spec.timeout_s)


async def _send_all(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    items: list[tuple[int, Prompt]],
    concurrency: int,
    spec: LoadSpec,
    start: float,
    done,
) -> float:
    """Send `items` (index, prompt) with at most `concurrency` in flight, arriving at
    `spec`'s rate, timed from `start` (time.perf_counter()); `done(record)` as each ends.
    Returns the time of the last completion."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(k: int) -> None:
        i, prompt = items[k]
        async with semaphore:
            body = payload(endpoint, prompt, prompt.max_tokens or spec.output_len)
            record = await send(client, endpoint, body, i, start, spec.timeout_s)
        record.group = prompt.group
        done(record)

    tasks = []
    async for k in arrivals(len(items), spec.request_rate, spec.burstiness, spec.seed):
        tasks.append(asyncio.create_task(one(k)))
    await asyncio.gather(*tasks)
    return time.perf_counter()


def client_split(concurrency: int, processes: int, prompts: int) -> int:
    """The processes a closed loop of `concurrency` streams and `prompts` requests runs in:
    the most, up to `processes`, that share the streams evenly (each its own closed loop of
    concurrency / P streams and every P-th prompt; an uneven split would leave the process
    with fewer streams finishing last, the run's end at lower concurrency)."""
    top = max(1, min(processes, concurrency, prompts))
    return max(d for d in range(1, top + 1) if concurrency % d == 0)


def merged_end(so_far: tuple[float, float], reported: tuple[float, float]) -> tuple[float, float]:
    """The run's (end, busiest share) once one more client process has reported its own: the
    latest end and the highest share, whatever order the processes' reports are read in."""
    return max(so_far[0], reported[0]), max(so_far[1], reported[1])


def run_in_processes(
    endpoint: Endpoint, prompts: list[Prompt], spec: LoadSpec, on_record=None, label: str = ""
) -> tuple[list[RequestRecord], float, float]:
    """`run_requests` over `client_split(...)` processes (a closed loop): process k sends
    prompts k, k + P, ... with concurrency / P streams. Each builds its client, says it is
    ready, and waits; all then start on one signal and are timed from one start (the system's
    monotonic clock, which every process reads alike). Each sends its records on a pipe of
    its own as they complete; a process that fails or dies ends its part (its requests not
    done are failed records) and the others run on. The last value: the busiest process's
    share of the run spent on a core (`_run_here`)."""
    if not math.isinf(spec.request_rate):
        raise ValueError("client processes split a closed loop only (no --request-rate)")
    count = client_split(spec.concurrency, spec.client_processes, len(prompts))
    context = multiprocessing.get_context("spawn")  # no fork of a process that holds threads
    go = context.Event()
    start_at = context.RawValue("d", 0.0)
    collected = Collected(len(prompts), on_record, label)
    workers, pipes = [], {}
    ready: set[int] = set()
    end = start = time.perf_counter()
    busy = 0.0

    try:
        for k in range(count):
            reader, writer = context.Pipe(duplex=False)
            items = list(enumerate(prompts))[k::count]
            worker = context.Process(
                target=_client_process,
                args=(k, endpoint, items, spec.concurrency // count, spec, go, start_at, writer),
                daemon=True,
            )
            workers.append(worker)
            pipes[reader] = k
            worker.start()
            writer.close()  # the child's end: the parent reads EOF once the child is gone
        while pipes:
            if len(ready) == count and not go.is_set():  # every client built: the run starts
                start = start_at.value = time.perf_counter()
                go.set()
            for reader in multiprocessing.connection.wait(list(pipes), timeout=1.0):
                k = pipes[reader]
                try:
                    kind, value = reader.recv()
                except (EOFError, OSError):  # gone: whatever it sent came before the EOF
                    del pipes[reader]
                    ready.add(k)  # the others must not wait for it
                    continue
                if kind == "ready":
                    ready.add(k)
                elif kind == "record":
                    collected.take(value)
                elif kind == "end":
                    end, busy = merged_end((end, busy), value)
                else:  # "failed", with its traceback
                    print(f"\na client process failed:\n{value}", file=sys.stderr)
    finally:
        go.set()
        for worker in workers:
            if worker.pid is not None:
                worker.join(5.0)
                if worker.is_alive():
                    worker.kill()
        for reader in pipes:
            reader.close()
    for i, record in enumerate(collected.records):
        if record is None:  # its process ended first
            failed = RequestRecord(index=i, send_s=0.0, error="the client process sending it ended")
            failed.group = prompts[i].group
            collected.take(failed)
    return collected.records, max(end - start, 0.0), busy


def _client_process(k: int, endpoint, items, concurrency, spec, go, start_at, pipe) -> None:
    """Client process `k` of `run_in_processes`: its records, its end and any failure go on
    `pipe` as ("record", RequestRecord), ("end", time), ("failed", traceback)."""

    async def run() -> tuple[float, float]:
        async with _client(concurrency, spec) as client:
            pipe.send(("ready", None))
            go.wait()  # nothing else runs on this loop yet
            start, cpu = start_at.value, time.process_time()
            end = await _send_all(
                client, endpoint, items, concurrency, spec, start, lambda r: pipe.send(("record", r))
            )
            return end, (time.process_time() - cpu) / max(end - start, 1e-9)

    try:
        pipe.send(("end", asyncio.run(run())))
    except BaseException:  # noqa: BLE001 - said to the parent, which fails what is left
        try:
            pipe.send(("failed", f"client process {k}: {traceback.format_exc()}"))
        except OSError:
            pass
    finally:
        pipe.close()


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
        measured = prompts[spec.warmup :]
        processes = client_split(spec.concurrency, spec.client_processes, len(measured))
        if not math.isinf(spec.request_rate):
            processes = 1
        if processes > 1:
            records, duration, busy = run_in_processes(endpoint, measured, spec, keep, name)
        else:
            records, duration, busy = asyncio.run(_run_here(endpoint, measured, spec, keep, name))
    unreadable = ""
    try:  # a page that broke during the run loses its counters, never the run's requests
        after = scrape(metrics_url) if metrics_url else None
    except MetricsPageError as e:
        after, unreadable = None, f"the /metrics page after the run: {e}"
    summary = {**labels, **calculate_metrics(records, duration, spec.slo_ms)}
    acceptance = acceptance_from_requests(records)
    counters = acceptance_from_counters(before, after)
    summary |= {**acceptance, **counters}  # counters win: they are the server's own totals
    if "acceptance_histogram" in acceptance:
        summary["acceptance_histogram"] = acceptance["acceptance_histogram"]
    summary["acceptance_check"] = unreadable or counter_contradictions(before, after, records)
    summary["count_source"] = count_sources(records)
    summary["streams_without_done"] = sum(1 for r in records if r.success and not r.done_marker)
    summary["server_kind"] = endpoint.accepts.name if endpoint.server else "ours (not probed)"
    summary["client_processes"] = processes
    summary["client_cpu"] = round(busy, 3)
    summary |= server_cpu(before, after, duration)
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
    "acceptance_check",
    "errors",
    "count_source",
    "server_kind",
    "streams_without_done",
    "client_processes",
    "client_cpu",
    "server_cpu",
    "engine_cpu",
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
