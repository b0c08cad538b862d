"""A/B orchestration: start (or attach to) a baseline server A and a candidate server B,
run the same workload on both, interleaved A, B, A, B to cancel machine drift, and report
B/A ratios with bootstrap confidence intervals."""

from __future__ import annotations

import csv
import getpass
import json
import math
import os
import platform
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

RATIO_METRICS = (
    "output_tokens_per_s",
    "request_throughput",
    "ttft_ms_median",
    "tpot_ms_median",
    "itl_token_ms_median",
    "itl_chunk_ms_median",
    "e2e_ms_median",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ManagedServer:
    """A server this run started from a command template (`{port}` is filled in), or one
    it attaches to by URL."""

    url: str
    command: list[str] | None = None
    process: subprocess.Popen | None = None

    log: Path | None = None  # its stdout and stderr

    @classmethod
    def start(cls, template: str, log: Path, health_timeout: float = 300.0) -> ManagedServer:
        """Start the command, its output in `log`, and wait until /health says 200."""
        port = free_port()
        command = shlex.split(template.replace("{port}", str(port)))
        with log.open("w") as sink:  # the child keeps its own copy of the descriptor
            process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        server = cls(f"http://127.0.0.1:{port}", command, process, log)
        server.wait_healthy(health_timeout)
        return server

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"server {' '.join(self.command)} exited with "
                    f"{self.process.returncode} before it became healthy; {self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server at {self.url} not healthy after {timeout} s; {self.log_tail()}")

    def log_tail(self, lines: int = 8) -> str:
        """The last lines of the server's output, where its reason for dying is."""
        if self.log is None or not self.log.exists():
            return "no output kept"
        tail = self.log.read_text(errors="replace").strip().splitlines()[-lines:]
        if not tail:
            return f"it wrote nothing ({self.log})"
        return f"its last output ({self.log}):\n  " + "\n  ".join(tail)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def bootstrap_ratio(
    a: list[float], b: list[float], seed: int = 0, samples: int = 2000
) -> tuple[float, float, float]:
    """Ratio of medians b/a with a 95% bootstrap interval (repeats resampled). A resample of A
    whose median is 0 (a repeat at 0, such as one whose requests all failed, drawn more than
    once) makes that resample's ratio infinite, or leaves it out where B's is 0 too; the point
    needs A's median above 0."""
    rng = random.Random(seed)
    point = statistics.median(b) / statistics.median(a)
    ratios = []
    for _ in range(samples):
        mb, ma = statistics.median(rng.choices(b, k=len(b))), statistics.median(rng.choices(a, k=len(a)))
        if ma:
            ratios.append(mb / ma)
        elif mb:
            ratios.append(math.copysign(math.inf, mb))
    ratios.sort()
    if not ratios:
        return point, point, point
    n = len(ratios)
    return point, ratios[int(0.025 * n)], ratios[max(int(0.975 * n) - 1, 0)]


def summary_numbers(rows: list[dict[str, str]]) -> list[dict]:
    """summary.csv's rows (as csv.DictReader reads them) in the form `ratios` takes: the label,
    the concurrency as an integer, each ratio metric as a float (NaN where the cell is empty)."""
    return [
        {
            "label": row["label"],
            "concurrency": int(row["concurrency"]),
            **{m: float(row[m]) if row.get(m) not in (None, "") else math.nan for m in RATIO_METRICS},
        }
        for row in rows
    ]


def ratios(summaries: list[dict], out: Path) -> list[dict]:
    """B/A ratio rows per (metric, concurrency), written to `ab.csv`."""
    rows = []
    concurrencies = sorted({s["concurrency"] for s in summaries})
    for c in concurrencies:
        for metric in RATIO_METRICS:
            a = [
                s[metric]
                for s in summaries
                if s["label"] == "A" and s["concurrency"] == c and s.get(metric) == s.get(metric)
            ]
            b = [
                s[metric]
                for s in summaries
                if s["label"] == "B" and s["concurrency"] == c and s.get(metric) == s.get(metric)
            ]
            if not a or not b or statistics.median(a) == 0:
                continue
            point, low, high = bootstrap_ratio(a, b)
            rows.append(
                {
                    "metric": metric,
                    "concurrency": c,
                    "a_median": statistics.median(a),
                    "b_median": statistics.median(b),
                    "ratio": point,
                    "ci_low": low,
                    "ci_high": high,
                    "within_noise": low <= 1.0 <= high,
                }
            )
    if rows:
        with out.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return rows


def metadata(argv: list[str], servers: dict[str, ManagedServer], notes: str | None) -> dict:
    def git_commit() -> str | None:
        try:
            return (
                subprocess.run(
                    ["git", "rev-parse", "HEAD"],
                    capture_output=True,
                    text=True,
                    cwd=Path(__file__).parent,
                    timeout=5,
                ).stdout.strip()
                or None
            )
        except OSError:
            return None

    gpu = None
    try:
        gpu = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except OSError:
        pass
    return {
        "command": [sys.executable, "-m", "harness", *argv],
        "servers": {
            k: {"url": s.url, "command": s.command, **server_info(s.url)} for k, s in servers.items()
        },
        "python": sys.version.split()[0],
        "httpx": httpx.__version__,
        "host": platform.node(),
        "platform": platform.platform(),
        "user": getpass.getuser(),
        "gpu": gpu,
        "git_commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "notes": notes,
    }


def machine_load() -> dict:
    """The 1-, 5- and 15-minute load averages and the CPUs this process may run on: recorded
    before and after each run, since a benchmark on a machine that is busy with something
    else measures that too (the report warns: reports/verdict.py)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"load": [round(x, 2) for x in os.getloadavg()], "cpus": cpus}


def server_info(url: str) -> dict:
    """torch version, device, dtype and where the engine steps, of a server that says (ours:
    GET /info); {} otherwise."""
    try:
        response = httpx.get(url.rstrip("/") + "/info", timeout=5)
        info = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return {}
    if not isinstance(info, dict):
        return {}
    keys = ("torch", "device", "dtype", "threads", "mode", "block_size", "engine_loop")
    return {k: info[k] for k in keys if k in info}


def write_meta(out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
