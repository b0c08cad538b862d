"""What a results directory already holds, and getting it ready to be continued.

A run is one (label, concurrency, repeat). Its rows in `requests.jsonl` are keyed by run and
request index, its row in `summary.csv` by run. A run counts as done when its summary row is
there, the run is whole (completed + failed = the requests it was meant to send) and its
failure rate is within the allowed one; `--resume` measures every other run again, after
removing whatever that run left behind, so no key appears twice. A torn last line (an
interrupted write, possibly cut inside a multi-byte character) is dropped, not fatal; a
summary.csv that a full disk left empty or with a torn header is set aside (`repair_summary`)
and its runs are measured again.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

Run = tuple[str, int, int]  # (label, concurrency, repeat)
RUN_COLUMNS = ("label", "concurrency", "repeat")  # the first columns of summary.csv

REQUESTS = "requests.jsonl"
SUMMARY = "summary.csv"
IDENTITY = "bench_run.json"  # what the folder's rows were measured with (bench_identity)

# the options of `harness bench` and `harness ab` that change what a request is, whom it goes
# to, or a row: the servers, the model and kind asked for, the workload, the SLOs
IDENTITY_OPTIONS = (
    "base_url",
    "a_url",
    "a_cmd",
    "b_url",
    "b_cmd",
    "model",
    "server_kind",
    "tokenizer",
    "endpoint",
    "num_prompts",
    "input_len",
    "output_len",
    "dataset",
    "builtin",
    "text",
    "long_input_len",
    "long_share",
    "warmup",
    "request_rate",
    "burstiness",
    "timeout",
    "seed",
    "slo_ttft_ms",
    "slo_tpot_ms",
    "slo_e2e_ms",
)


class ResumeConflict(Exception):
    """--resume of a folder whose rows were made against other servers or settings."""


def differences(saved: dict, now: dict, where: str = "") -> list[str]:
    """`key was A, now B` for every key whose value differs, nested keys as `a.b`; `command`
    first (the subcommand: the plainest difference), then by name."""
    out = []
    for key in sorted(saved.keys() | now.keys(), key=lambda k: (k != "command", k)):
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{where}{key}.")
        elif a != b:
            out.append(f"{where}{key} was {a!r}, now {b!r}")
    return out


def bench_identity(args) -> dict:
    """What the rows of a `harness bench` or `harness ab` folder were measured with: the
    command, the servers (the URL attached to, or the command that started one: its port
    changes from run to run), the model and server kind asked for, every workload setting,
    the bytes of the dataset, the SLOs. Not in it: the concurrency levels and repeats (each
    run's own key, so a resumed run may add levels or repeats), the failure threshold (it
    judges rows), labels, notes and the API key."""
    identity: dict = {"command": args.command}
    for name in IDENTITY_OPTIONS:
        if hasattr(args, name):
            value = getattr(args, name)
            identity[name] = "inf" if isinstance(value, float) and math.isinf(value) else value
    if getattr(args, "dataset", None):
        try:
            identity["dataset_sha256"] = hashlib.sha256(Path(args.dataset).read_bytes()).hexdigest()
        except OSError:
            identity["dataset_sha256"] = None  # the workload's own error says why
    return identity


def check_saved_identity(path: Path, identity: dict, held: str, differ: str, made: str, again: str) -> None:
    """ResumeConflict unless `path`, the identity file of a folder's rows, holds `identity`.
    The message: `held` (what the folder holds), `differ` (those rows, made otherwise), `made`
    (what they were made with: "compared against", "measured with"), `again` (what to do)."""
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise ResumeConflict(f"{held} but no {path.name} says what they were {made}; {again}") from None
    except ValueError:
        raise ResumeConflict(f"{path} is not JSON: cannot tell what the rows were {made}") from None
    found = differences(saved, identity) if isinstance(saved, dict) else [f"{path.name} is not an object"]
    if found:
        raise ResumeConflict(
            f"{differ}: "
            + "; ".join(found[:4])
            + (f" (and {len(found) - 4} more)" if len(found) > 4 else "")
            + f"; {again}"
        )


def check_identity(out: Path, identity: dict) -> None:
    """ResumeConflict unless every row in `out` was measured with `identity` (bench_run.json)."""
    rows, dropped = read_request_rows(out / REQUESTS)
    if not rows and not dropped and not holds_rows(out):
        return  # nothing to keep
    check_saved_identity(
        out / IDENTITY,
        identity,
        f"{out} holds measured rows",
        f"the rows in {out} were measured with other servers or settings",
        "measured with",
        "measure afresh without --resume (or into another --out)",
    )


def holds_rows(out: Path) -> bool:
    """Whether `out` holds measured rows (requests.jsonl or summary.csv not empty)."""
    return any((out / name).exists() and (out / name).stat().st_size > 0 for name in (REQUESTS, SUMMARY))


def write_identity(out: Path, identity: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _write_atomically(out / IDENTITY, json.dumps(identity, indent=2) + "\n")


def read_request_rows(path: Path) -> tuple[list[dict], int]:
    """The readable rows of a requests.jsonl and how many lines were dropped (torn or not JSON)."""
    if not path.exists():
        return [], 0
    rows, dropped = [], 0
    data = path.read_bytes()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the file ends with a newline: no torn last line
    for line in lines:
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            dropped += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            dropped += 1
    return rows, dropped


def run_of(row: dict) -> Run | None:
    try:
        return str(row["label"]), int(row["concurrency"]), int(row["repeat"])
    except (KeyError, TypeError, ValueError):
        return None


def failure_rate(row: dict) -> float:
    """Failed share of a summary row's requests (1.0 when it sent none)."""
    completed, failed = int(float(row.get("completed") or 0)), int(float(row.get("failed") or 0))
    return failed / (completed + failed) if completed + failed else 1.0


@dataclass(frozen=True)
class Resumed:
    done: set[Run]  # runs kept as they are
    redo: set[Run]  # planned runs whose earlier rows were removed
    dropped_lines: int  # torn or unreadable lines removed from requests.jsonl
    repaired: str | None = None  # what repair_summary did to summary.csv


def prepare(out: Path, planned: dict[Run, int], max_failure_rate: float) -> Resumed:
    """Keep the planned runs that are done; remove every row of the other planned runs (and
    torn lines) from requests.jsonl and summary.csv. Runs outside the plan stay untouched.
    `planned` maps each run to the number of measured requests it sends."""
    repaired = repair_summary(out / SUMMARY)
    summary_rows = _read_summary(out / SUMMARY)
    done = set()
    for row in summary_rows:
        run = run_of(row)
        if (
            run in planned
            and failure_rate(row) <= max_failure_rate
            and int(float(row.get("completed") or 0)) + int(float(row.get("failed") or 0)) == planned[run]
        ):
            done.add(run)
    redo = set(planned) - done
    rows, dropped = read_request_rows(out / REQUESTS)
    kept_rows, seen = [], set()
    for row in reversed(rows):  # the last copy of a key wins
        run = run_of(row)
        key = (run, row.get("index"))
        if run in redo or key in seen:
            continue
        seen.add(key)
        kept_rows.append(row)
    kept_rows.reverse()
    if (out / REQUESTS).exists():
        _write_atomically(out / REQUESTS, "".join(json.dumps(r) + "\n" for r in kept_rows))
    kept_summary = [r for r in summary_rows if run_of(r) not in redo]
    if (out / SUMMARY).exists():
        _write_summary(out / SUMMARY, kept_summary)
    left_behind = {run_of(r) for r in summary_rows} | {run_of(r) for r in rows}
    return Resumed(done, redo & left_behind, dropped, repaired)


def trim_torn_tail(path: Path) -> bool:
    """Cut an unterminated last line off a JSONL file, so the next append starts a fresh
    line; True when there was one."""
    if not path.exists() or path.stat().st_size == 0:
        return False
    with path.open("rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return False
        f.truncate(data.rfind(b"\n") + 1)
    return True


def repair_summary(path: Path) -> str | None:
    """Make a summary.csv that new rows can be appended to, after a full disk or a kill: an
    empty one is removed (the next row writes the header), a torn last row is cut, one whose
    header is torn is moved aside to summary.csv.torn (its rows cannot be read by column).
    Returns what was done, or None when the file was whole."""
    if not path.exists():
        return None
    if path.stat().st_size == 0:
        path.unlink()
        return f"{path.name} was empty: removed"
    with path.open("rb") as f:
        first = f.readline()
    if not first.endswith(b"\n") or first.decode("utf-8", "replace").split(",")[:3] != list(RUN_COLUMNS):
        aside = path.with_name(path.name + ".torn")
        os.replace(path, aside)
        return f"{path.name} had no whole header: moved to {aside.name}, its runs measured again"
    if trim_torn_tail(path):
        return f"{path.name} ended in a torn row: cut"
    return None


def _read_summary(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(newline="", encoding="utf-8", errors="replace") as f:
        return [row for row in csv.DictReader(f) if run_of(row) is not None]


def _write_summary(path: Path, rows: list[dict]) -> None:
    with path.open(newline="", encoding="utf-8", errors="replace") as f:
        header = next(csv.reader(f), None)
    if not header:
        return
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
