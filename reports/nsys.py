"""Nsight Systems statistics read back from CSV: the reports `nvtx_sum` (host time per NVTX
range), `nvtx_gpu_proj_sum` (GPU time projected onto each range) and `cuda_gpu_kern_sum`
(time per kernel), as `nsys stats --format csv` prints or writes them.

Inputs are read the way nsys produces them, not the way one version happened to: columns
are found by header name, never by position, with the unit taken from the header
(`Total Time (ns)`, or `(us)`/`(ms)`/`(s)` under `--timeunit`); lines before the header
(`Generating SQLite file ...`, `Processing [...] with [...]...`, `NOTICE: ...`) are skipped;
a stdout capture of several reports is split at its `Processing [... with [.../<report>.py]`
lines. `nsys stats --output PREFIX` writes one file per report, `PREFIX_<report>.csv`.

Range names: nsys shows a range pushed in a named domain as `domain:name` and one in the
default domain as `:name` (older versions: `name`). `dflash:verify` and `:verify` are both
the phase `verify`; ranges of any other domain, and names that are not the engine's, are
dropped. A leading style marker (`PushPop:`, `[StartEnd] `, ...) is tolerated.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

REPORTS = ("nvtx_sum", "nvtx_gpu_proj_sum", "cuda_gpu_kern_sum")
DOMAIN = "dflash"
# reference_engine/runtime/profiling.py RANGE_NAMES (reports import no engine code; a test pins them)
RANGE_NAMES = (
    "step",
    "schedule",
    "prefill",
    "decode",
    "draft",
    "verify",
    "accept",
    "commit",
    "sample",
    "conv",
    "selector",
)
STYLES = ("pushpop", "push/pop", "startend", "start/end")
UNIT_MS = {"ns": 1e-6, "us": 1e-3, "μs": 1e-3, "ms": 1.0, "s": 1e3, "sec": 1e3}
PROCESSING = re.compile(r"^Processing \[.*\] with \[(?:.*/)?(?P<report>[A-Za-z0-9_]+)(?:\.py)?\]")


class NsysError(ValueError):
    """An nsys statistics file that holds no table of the expected report."""


@dataclass(frozen=True)
class Field:
    """One value we read from a report: the header names it goes by (lower case, without
    the unit), and whether it is a time (converted to ms) or a count."""

    name: str
    headers: tuple[str, ...]
    kind: str  # "text", "count" or "time"
    required: bool = True


SCHEMAS: dict[str, tuple[Field, ...]] = {
    "nvtx_sum": (
        Field("range", ("range",), "text"),
        Field("instances", ("instances", "range instances", "count"), "count"),
        Field("total_ms", ("total time",), "time"),
    ),
    "nvtx_gpu_proj_sum": (
        Field("range", ("range",), "text"),
        Field("instances", ("range instances", "instances"), "count"),
        Field("gpu_ms", ("total proj time", "total projected time"), "time"),
        Field("range_ms", ("total range time",), "time", required=False),
    ),
    "cuda_gpu_kern_sum": (
        Field("kernel", ("name", "kernel name"), "text"),
        Field("instances", ("instances", "count"), "count"),
        Field("total_ms", ("total time",), "time"),
    ),
}


@dataclass(frozen=True)
class Header:
    index: dict[str, int]  # field name -> column position
    units: dict[str, float]  # time field -> factor to ms


def parse_header(cells: list[str], report: str) -> Header | None:
    """The positions of `report`'s fields in a CSV header row, or None when it is not one."""
    names = [_split_unit(c) for c in cells]
    index, units = {}, {}
    for field in SCHEMAS[report]:
        hits = [i for i, (name, _) in enumerate(names) if name in field.headers]
        # the first alias that matches wins: "range instances" before a bare "instances"
        hits.sort(key=lambda i: field.headers.index(names[i][0]))
        if not hits:
            if field.required:
                return None
            continue
        index[field.name] = hits[0]
        if field.kind == "time":
            unit = names[hits[0]][1] or "ns"
            if unit not in UNIT_MS:
                return None
            units[field.name] = UNIT_MS[unit]
    return Header(index, units)


def read_table(text: str, report: str) -> pd.DataFrame | None:
    """The first table of `report` in `text` (one report's CSV, or a stdout capture of
    several), with one column per field of SCHEMAS[report]; None when there is none."""
    tables = split_reports(text)
    if report in tables:
        return _table(tables[report], report)
    if tables:  # sections named after other reports only
        return None
    return _table(text, report)


def split_reports(text: str) -> dict[str, str]:
    """A stdout capture cut at its `Processing [...] with [.../<report>.py]` lines:
    report name -> the text that follows it (empty when nsys printed no such lines)."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        match = PROCESSING.match(line.strip())
        if match:
            current = match.group("report")
            sections.setdefault(current, [])
        elif current is not None:
            sections[current].append(line)
    return {name: "\n".join(lines) for name, lines in sections.items()}


def _table(text: str, report: str) -> pd.DataFrame | None:
    fields = SCHEMAS[report]
    lines = text.splitlines()
    for start, line in enumerate(lines):
        header = parse_header(_cells(line), report)
        if header is None:
            continue
        width = len(_cells(line))
        rows = []
        for body in lines[start + 1 :]:
            cells = _cells(body)
            if len(cells) != width:  # a blank line, or the next report's preamble
                break
            rows.append(cells)
        columns = {}
        for field in fields:
            if field.name not in header.index:
                columns[field.name] = [float("nan")] * len(rows)
                continue
            raw = [r[header.index[field.name]] for r in rows]
            if field.kind == "text":
                columns[field.name] = raw
            else:
                factor = header.units.get(field.name, 1.0)
                columns[field.name] = [_number(v) * factor for v in raw]
        return pd.DataFrame(columns, columns=[f.name for f in fields])
    return None


def phase_of(range_name: str) -> str | None:
    """The engine phase an nsys range name stands for, or None for another domain's range."""
    name = range_name.strip()
    lowered = name.lower()
    for style in STYLES:
        for prefix in (f"{style}:", f"[{style}]"):
            if lowered.startswith(prefix):
                name = name[len(prefix) :].strip()
                lowered = name.lower()
    domain, colon, rest = name.partition(":")
    if not colon:
        domain, rest = "", name
    if domain not in ("", DOMAIN):
        return None
    rest = rest.strip()
    return rest if rest in RANGE_NAMES else None


def phase_table(table: pd.DataFrame, value_columns: tuple[str, ...]) -> pd.DataFrame:
    """Rows of an NVTX report summed per engine phase (a phase may show in both domains);
    other domains' ranges dropped. Indexed by phase, with `instances` and `value_columns`."""
    phases = table["range"].map(phase_of)
    kept = table.assign(phase=phases)[phases.notna()]
    columns = ["instances", *value_columns]
    return kept.groupby("phase")[columns].sum(min_count=1)


@dataclass(frozen=True)
class Capture:
    """One profiled process (`<label>_<report>.csv` files, or a stdout capture `<label>.txt`)."""

    label: str
    ranges: pd.DataFrame | None  # index phase: instances, total_ms (host time); nvtx_sum
    gpu: pd.DataFrame | None  # index phase: instances, gpu_ms, range_ms; nvtx_gpu_proj_sum
    kernels: pd.DataFrame | None  # kernel, instances, total_ms, by total time; cuda_gpu_kern_sum
    missing: tuple[str, ...]  # reports absent or empty


def load_capture(directory: Path, label: str) -> Capture:
    """Read `label`'s reports from `directory`: `<label>_<report>.csv` (what `nsys stats
    --output DIR/<label>` writes) or else a stdout capture `<label>.txt`."""
    directory = Path(directory)
    capture_text = _read(directory / f"{label}.txt")
    tables: dict[str, pd.DataFrame | None] = {}
    for report in REPORTS:
        path = directory / f"{label}_{report}.csv"
        text = _read(path)
        if text is not None:
            table = read_table(text, report)
            if table is None and not _skipped(text):
                raise NsysError(_no_table(path, text, report))
        elif capture_text is not None:
            table = read_table(capture_text, report)
        else:
            table = None
        tables[report] = table if table is not None and len(table) else None
    ranges = tables["nvtx_sum"]
    gpu = tables["nvtx_gpu_proj_sum"]
    kernels = tables["cuda_gpu_kern_sum"]
    return Capture(
        label=label,
        ranges=None if ranges is None else phase_table(ranges, ("total_ms",)),
        gpu=None if gpu is None else phase_table(gpu, ("gpu_ms", "range_ms")),
        kernels=None
        if kernels is None
        else kernels.sort_values("total_ms", ascending=False, kind="stable").reset_index(drop=True),
        missing=tuple(r for r in REPORTS if tables[r] is None),
    )


def capture_labels(directory: Path) -> list[str]:
    """Labels of the captures in `directory`: `<label>_nvtx_sum.csv` files, and `<label>.txt`
    stdout captures that hold an nvtx_sum table."""
    directory = Path(directory)
    labels = {p.name[: -len("_nvtx_sum.csv")] for p in directory.glob("*_nvtx_sum.csv")}
    for path in directory.glob("*.txt"):
        text = _read(path) or ""
        if read_table(text, "nvtx_sum") is not None:
            labels.add(path.stem)
    return sorted(labels)


def top_kernels(kernels: pd.DataFrame, n: int) -> pd.DataFrame:
    """The `n` kernels with the most total time, with their share of all kernel time (%)
    and mean time per launch (us)."""
    total = kernels["total_ms"].sum()
    top = kernels.head(n).copy()
    top["share_pct"] = 100 * top["total_ms"] / total if total else float("nan")
    top["mean_us"] = 1000 * top["total_ms"] / top["instances"].where(top["instances"] > 0)
    return top


def _no_table(path: Path, text: str, report: str) -> str:
    wanted = ", ".join(repr(f.headers[0]) for f in SCHEMAS[report] if f.required)
    first = text.strip().splitlines()[0][:120] if text.strip() else ""
    return f"{path}: no {report} table (expected a header with {wanted}; first line {first!r})"


def _split_unit(cell: str) -> tuple[str, str]:
    """`Total Time (ns)` -> ("total time", "ns"); `Time(%)` -> ("time", "%")."""
    match = re.fullmatch(r"\s*(.*?)\s*(?:\(([^()]*)\))?\s*", cell.strip().strip('"'))
    name = re.sub(r"\s+", " ", match.group(1)).lower()
    return name, (match.group(2) or "").strip().lower()


def _cells(line: str) -> list[str]:
    if not line.strip():
        return []
    return next(csv.reader(io.StringIO(line)))


def _number(value: str) -> float:
    text = value.strip().replace(",", "")
    if text in ("", "-", "n/a", "N/A", "nan"):
        return float("nan")
    return float(text)


def _skipped(text: str) -> bool:
    """nsys wrote the report's file but found no data for it (`SKIPPED: ... does not contain`)."""
    return any(line.startswith("SKIPPED") for line in text.splitlines())


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return None
