"""Where an engine step's time goes: the phase breakdown of one profiled run, from either
source, Nsight Systems (NVTX ranges, reports/nsys.py) or the engine benchmark's built-in
phase timer (its CSV's ms_<phase> and ms_step columns).

Nesting (reference_engine/engine.py, speculative_step.py): a step runs schedule, prefill, decode,
draft, verify, accept and commit one after another, none inside another; `sample` runs
inside `prefill` (a prompt's last chunk) and inside `decode`, and an eager DFlash2 draft's
`conv` and `selector` inside `draft` (runtime/stats.py NESTED). So the step's time is the sum
of the top-level phases plus `other`, the time inside a step but outside every phase
(request bookkeeping after the commit, finishing requests, the timer's once-per-step read
of its CUDA events); the nested phases are shown but never summed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from .nsys import REPORTS, Capture, capture_labels, load_capture

STEP = "step"
OTHER = "other"
TOP_LEVEL = ("schedule", "prefill", "decode", "draft", "verify", "accept", "commit")
# phase -> the phases it runs inside: runtime/stats.py NESTED (reports import no engine code)
NESTED = {"sample": ("prefill", "decode"), "conv": ("draft",), "selector": ("draft",)}
MODE_ORDER = ("plain", "dflash")
LABEL = re.compile(r"^(?P<mode>.+)-c(?P<concurrency>\d+)$")
BENCH_COLUMNS = ("mode", "concurrency", "ms_step")


class ProfileError(ValueError):
    """A directory no phase profile can be built from."""


@dataclass(frozen=True, eq=False)
class PhaseTimes:
    """One run's time per phase, whatever its source: the input of `breakdown`."""

    label: str  # "<mode>-c<concurrency>"
    mode: str
    concurrency: int | None
    source: str  # "nsys" or "timer"
    step_ms: float  # all steps together
    phase_ms: dict[str, float]  # phase -> ms over all steps (top-level and nested phases)
    instances: dict[str, int] = field(default_factory=dict)  # where known; step included
    gpu_ms: dict[str, float] = field(default_factory=dict)  # GPU-projected ms (nsys); step too
    output_tokens: int | None = None  # the tokens those steps produced, where known
    kernels: pd.DataFrame | None = None  # cuda_gpu_kern_sum, by total time (nsys)
    notes: tuple[str, ...] = ()

    @property
    def steps(self) -> int | None:
        return self.instances.get(STEP)


def breakdown(times: PhaseTimes) -> pd.DataFrame:
    """One row per phase: the top-level phases that ran, `other`, the nested phases, `step`.
    Columns: instances, total_ms, mean_ms, share_pct (of step time), gpu_ms, per_token_ms,
    summed (whether the row is part of the sum that equals step time) and inside (for a
    nested phase, the phases it runs inside). Rows with `summed` add up to step exactly."""
    rows = []

    def row(phase: str, total: float, summed: bool, inside: str = "") -> None:
        instances = times.instances.get(phase)
        rows.append(
            {
                "phase": phase,
                "instances": instances,
                "total_ms": total,
                "mean_ms": total / instances if instances else math.nan,
                "share_pct": 100 * total / times.step_ms if times.step_ms else math.nan,
                "gpu_ms": times.gpu_ms.get(phase, math.nan),
                "per_token_ms": total / times.output_tokens if times.output_tokens else math.nan,
                "summed": summed,
                "inside": inside,
            }
        )

    ran = [p for p in TOP_LEVEL if times.phase_ms.get(p) or times.instances.get(p)]
    for phase in ran:
        row(phase, times.phase_ms.get(phase, 0.0), summed=True)
    row(OTHER, times.step_ms - sum(times.phase_ms.get(p, 0.0) for p in TOP_LEVEL), summed=True)
    if STEP in times.gpu_ms:
        rows[-1]["gpu_ms"] = times.gpu_ms[STEP] - sum(times.gpu_ms.get(p, 0.0) for p in ran)
    for phase, parents in NESTED.items():
        if times.phase_ms.get(phase) or times.instances.get(phase):
            row(phase, times.phase_ms.get(phase, 0.0), summed=False, inside=", ".join(parents))
    row(STEP, times.step_ms, summed=False)
    return pd.DataFrame(rows).set_index("phase")


def load_profiles(directory: Path, source: str = "auto") -> list[PhaseTimes]:
    """Every run profiled in `directory`, ordered by concurrency then mode. `source`: "nsys"
    (captures `<label>_nvtx_sum.csv` ...), "timer" (engine benchmark CSVs with ms_step), or
    "auto" (nsys when there is a capture, else the timer)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ProfileError(f"{directory} does not exist or is not a directory")
    if source not in ("auto", "nsys", "timer"):
        raise ProfileError(f"source must be auto, nsys or timer, got {source!r}")
    bench = bench_rows(directory)
    labels = capture_labels(directory) if source in ("auto", "nsys") else []
    if labels:
        profiles = [from_capture(load_capture(directory, label), bench) for label in labels]
    elif source == "nsys":
        raise ProfileError(
            f"no nsys captures in {directory} (expected <mode>-c<concurrency>"
            f"_nvtx_sum.csv from `nsys stats --output`, or <label>.txt)"
        )
    else:
        profiles = [from_bench_row(r, _variant(r, run)) for run in bench.values() for r in run]
    if not profiles:
        raise ProfileError(
            f"nothing to profile in {directory}: no nsys captures (<label>_nvtx_sum.csv) and "
            f"no engine benchmark CSV with columns {', '.join(BENCH_COLUMNS)}"
        )
    return sorted(profiles, key=_order)


def bench_rows(directory: Path) -> dict[tuple[str, int], list[dict]]:
    """(mode, concurrency) -> the engine benchmark's rows of that run, from every CSV in
    `directory` that is one: several when one run measured several drafts or numerics
    (`--draft-arch dflash,dflash2`, `--numerics exact,fast`). A later file's rows for a run
    replace an earlier file's (files named after a capture, `<label>.csv`, come last and so
    win)."""
    rows: dict[tuple[str, int], list[dict]] = {}
    paths = [
        p for p in sorted(directory.glob("*.csv")) if not any(p.name.endswith(f"_{r}.csv") for r in REPORTS)
    ]
    paths.sort(key=lambda p: LABEL.match(p.stem) is not None)
    for path in paths:
        try:
            frame = pd.read_csv(path)
        except (ValueError, UnicodeDecodeError):  # pandas' parser errors are ValueErrors
            continue
        if not set(BENCH_COLUMNS) <= set(frame.columns):
            continue
        found: dict[tuple[str, int], list[dict]] = {}
        for record in frame.to_dict("records"):
            record["file"] = path.name
            found.setdefault((str(record["mode"]), int(record["concurrency"])), []).append(record)
        rows.update(found)
    return rows


VARIANT_COLUMNS = ("draft", "numerics")  # what tells apart a run's rows (bench_rows)


def _variant(row: dict, others: list[dict]) -> str:
    """The values of VARIANT_COLUMNS in which `row` differs from another row of its run,
    as a label's suffix (empty when it is the run's only row)."""
    differ = [c for c in VARIANT_COLUMNS if len({str(r.get(c)) for r in others}) > 1]
    return "".join(f" {c} {row.get(c)}" for c in differ)


def from_bench_row(row: dict, variant: str = "") -> PhaseTimes:
    """A benchmark CSV row: ms_<phase> (CUDA-event time on a GPU, host time on a CPU: its
    phase_clock), n_<phase>, ms_step (host wall time in engine.step()) and steps, medians
    over its repeats; `variant` (of a run that measured several drafts or numerics) follows
    the label."""
    phases = {p: float(row[f"ms_{p}"]) for p in (*TOP_LEVEL, *NESTED) if f"ms_{p}" in row}
    instances = {p: int(row[f"n_{p}"]) for p in phases if _known(row.get(f"n_{p}"))}
    clock = row.get("phase_clock", "")
    notes = [
        f"{row['file']}: medians over {row.get('repeats', '?')} repeat(s), each column on "
        "its own, so `other` also holds the differences between medians"
    ]
    if clock == "cuda_events":
        notes.append(
            "phases in CUDA-event time, step in host wall time: `other` is the step's "
            "time outside every phase's GPU work (launch gaps, bookkeeping)"
        )
    notes += _spread_notes(row)
    steps = row.get("steps")
    tokens = row.get("output_tokens")
    return PhaseTimes(
        label=f"{row['mode']}-c{int(row['concurrency'])}{variant}",
        mode=str(row["mode"]),
        concurrency=int(row["concurrency"]),
        source="timer",
        step_ms=float(row["ms_step"]),
        phase_ms=phases,
        instances={**instances, STEP: int(steps)} if _known(steps) else instances,
        output_tokens=int(tokens) if _known(tokens) else None,
        notes=tuple(notes),
    )


SPREAD_WARNING = 0.10  # as the engine benchmark: repeats farther apart than this disagree


def _spread_notes(row: dict) -> list[str]:
    """The spread over repeats of the step time and the throughput (benchmark CSVs that
    carry `<column>_min`/`_max`), with a warning when it passes SPREAD_WARNING."""
    notes = []
    label = f"{row['mode']}-c{row['concurrency']}"
    for column, unit in (("ms_step", "ms"), ("output_tokens_per_s", "tok/s")):
        low, high, median = (row.get(f"{column}_min"), row.get(f"{column}_max"), row.get(column))
        if not (_known(low) and _known(high) and _known(median)) or float(median) <= 0:
            continue
        low, high, median = float(low), float(high), float(median)
        spread = (high - low) / median
        note = f"{label} {column}: median {median:.1f} {unit}, min {low:.1f}, max {high:.1f} over the repeats"
        if spread > SPREAD_WARNING:
            note = (
                f"**warning: repeats disagree by {spread:.0%}** ({label} {column}: median "
                f"{median:.1f} {unit}, min {low:.1f}, max {high:.1f}); the figures of this "
                "run are not stable"
            )
        notes.append(note)
    return notes


def from_capture(capture: Capture, bench: dict[tuple[str, int], list[dict]]) -> PhaseTimes:
    """An nsys capture: host time per range (nvtx_sum) and GPU-projected time
    (nvtx_gpu_proj_sum), over the captured repeats; output tokens from the benchmark CSV of
    the same run (tokens of one run x its repeats, summed over the drafts or numerics the
    run measured, all of which the capture holds), when it has them all."""
    mode, concurrency = _mode_and_concurrency(capture.label)
    notes = [f"{capture.label}: {r} absent or empty" for r in capture.missing]
    ranges = capture.ranges if capture.ranges is not None else pd.DataFrame(columns=["instances", "total_ms"])
    if STEP not in ranges.index:
        notes.append(
            f"{capture.label}: no `{STEP}` range, so no step total (were DFLASH_NVTX=1 "
            "and the nvtx package there?)"
        )
    gpu = capture.gpu if capture.gpu is not None else pd.DataFrame(columns=["gpu_ms"])
    tokens = None
    run = bench.get((mode, concurrency), []) if concurrency is not None else []
    if run and all(_known(row.get("output_tokens")) for row in run):
        tokens = sum(int(row["output_tokens"]) * int(row.get("repeats", 1) or 1) for row in run)
    return PhaseTimes(
        label=capture.label,
        mode=mode,
        concurrency=concurrency,
        source="nsys",
        step_ms=float(ranges["total_ms"].get(STEP, math.nan)),
        phase_ms={p: float(v) for p, v in ranges["total_ms"].items() if p != STEP},
        instances={p: int(v) for p, v in ranges["instances"].items() if _known(v)},
        gpu_ms={p: float(v) for p, v in gpu["gpu_ms"].items() if _known(v)},
        output_tokens=tokens,
        kernels=capture.kernels,
        notes=tuple(notes),
    )


def _mode_and_concurrency(label: str) -> tuple[str, int | None]:
    match = LABEL.match(label)
    return (match["mode"], int(match["concurrency"])) if match else (label, None)


def _order(times: PhaseTimes) -> tuple:
    mode = MODE_ORDER.index(times.mode) if times.mode in MODE_ORDER else len(MODE_ORDER)
    c = times.concurrency
    return (c is None, c or 0, mode, times.label)


def _known(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))
