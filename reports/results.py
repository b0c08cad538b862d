"""The result set of one benchmark run: the files the harness writes into a results directory,
read with pandas and checked once, so tables and plots work from one object, not from paths.

Only `summary.csv` is required. Every other file may be absent (a single-server run has no
`ab.csv`, an interrupted one may lack `meta.json`); absent files are listed in `missing` and
files that are present but partly unreadable are described in `problems`, so the report can
say what it could not show instead of failing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

SUMMARY = "summary.csv"
AB = "ab.csv"
REQUESTS = "requests.jsonl"
META = "meta.json"
COMPARE_MD = "compare.md"
COMPARE_SUMMARY = "compare_summary.json"
OPTIONAL_FILES = (AB, REQUESTS, META, COMPARE_MD, COMPARE_SUMMARY)

STATS = ("mean", "median", "p90", "p99")
LATENCIES = ("ttft_ms", "tpot_ms", "itl_token_ms", "itl_chunk_ms", "e2e_ms")
# summary.csv columns that hold text or JSON; every other known column is numeric
TEXT_COLUMNS = (
    "label",
    "acceptance_per_position",
    "acceptance_histogram",
    "acceptance_source",
    "errors",
    "count_source",
    "server_kind",
)
NUMERIC_COLUMNS = (
    "concurrency",
    "repeat",
    "completed",
    "failed",
    "duration_s",
    "request_throughput",
    "output_tokens_per_s",
    *[f"{m}_{s}" for m in LATENCIES for s in STATS],
    "achieved_concurrency",
    "goodput_requests_per_s",
    "acceptance_length",
    "acceptance_rate",
)
# columns whose spread over repeats is shown (error bars, ranges), not only their median
SPREAD_COLUMNS = ("output_tokens_per_s", "request_throughput")


class ResultsError(ValueError):
    """A results directory that no report can be built from (absent, or no usable summary.csv)."""


@dataclass(frozen=True)
class ItlSamples:
    """Per-token and chunk ITL values (ms) of the successful requests of one (label, concurrency)."""

    token_ms: np.ndarray  # [tokens after the first chunk], one value per token
    chunk_ms: np.ndarray  # [chunks after the first], one value per gap between token chunks


@dataclass(frozen=True, eq=False)
class ResultSet:
    directory: Path
    summary: pd.DataFrame  # one row per (label, concurrency, repeat); JSON columns parsed
    ab: pd.DataFrame | None  # one row per (metric, concurrency); None without ab.csv
    requests: pd.DataFrame | None  # one row per request: label, concurrency, repeat, success, error
    itl: dict[tuple[str, int], ItlSamples]  # from requests.jsonl; empty without it
    meta: dict[str, Any]
    compare_md: str | None
    compare_summary: dict[str, Any] | None
    missing: tuple[str, ...]  # optional files that are absent
    problems: tuple[str, ...] = field(default=())  # present but (partly) unreadable
    # token ids of each successful request, keyed (label, concurrency, repeat, index); None
    # when the server reported none
    outputs: dict[tuple[str, int, int, int], tuple[int, ...] | None] = field(default_factory=dict)

    def display(self, label: str) -> str:
        """`A = plain` when the run named its sides (harness ab --a-label/--b-label), else `A`."""
        names = self.meta.get("labels")
        name = names.get(label) if isinstance(names, dict) else None
        return f"{label} = {name}" if name and name != label else label

    def name(self, label: str) -> str:
        """What the side is (`plain`), or the label itself when unnamed."""
        names = self.meta.get("labels")
        name = names.get(label) if isinstance(names, dict) else None
        return str(name) if name else label

    @property
    def labels(self) -> list[str]:
        """Labels in order of first appearance, except that baseline A comes before candidate B."""
        seen = list(dict.fromkeys(self.summary["label"]))
        return sorted(seen, key=lambda label: ({"A": 0, "B": 1}.get(label, 2), seen.index(label)))

    @property
    def concurrencies(self) -> list[int]:
        return sorted(int(c) for c in self.summary["concurrency"].unique())


def load_results(directory: Path) -> ResultSet:
    """Read every result file in `directory`. Raises ResultsError when there is nothing to report."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ResultsError(f"results directory {directory} does not exist")
    if not (directory / SUMMARY).is_file():
        found = sorted(p.name for p in directory.iterdir())
        raise ResultsError(f"{directory} has no {SUMMARY} (found: {', '.join(found) or 'nothing'})")
    problems: list[str] = []
    summary = _read_summary(directory / SUMMARY, problems)
    missing = tuple(name for name in OPTIONAL_FILES if not (directory / name).is_file())
    requests, itl, outputs = (
        (None, {}, {}) if REQUESTS in missing else _read_requests(directory / REQUESTS, problems)
    )
    meta = {} if META in missing else _read_json_object(directory / META, problems) or {}
    return ResultSet(
        directory=directory,
        summary=summary,
        ab=None if AB in missing else _read_ab(directory / AB, problems),
        requests=requests,
        itl=itl,
        meta=meta,
        compare_md=None if COMPARE_MD in missing else _read_text(directory / COMPARE_MD, problems),
        compare_summary=None
        if COMPARE_SUMMARY in missing
        else _read_json_object(directory / COMPARE_SUMMARY, problems),
        missing=missing,
        problems=tuple(problems),
        outputs=outputs,
    )


def aggregate_repeats(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (label, concurrency): the median over repeats of every numeric column, `n`
    (repeats), `<col>_min`/`<col>_max` for SPREAD_COLUMNS, summed `completed`/`failed`, and
    the most common `acceptance_source`. Indexed by (label, concurrency)."""
    keys = ["label", "concurrency"]
    numeric = [c for c in NUMERIC_COLUMNS if c in summary.columns and c not in keys]
    groups = summary.groupby(keys, sort=True)
    out = groups[numeric].median()
    out["n"] = groups.size()
    for col in SPREAD_COLUMNS:
        if col in summary.columns:
            out[f"{col}_min"] = groups[col].min()
            out[f"{col}_max"] = groups[col].max()
    for col in ("completed", "failed"):
        if col in summary.columns:
            out[col] = groups[col].sum(min_count=1)
    if "acceptance_source" in summary.columns:
        out["acceptance_source"] = groups["acceptance_source"].agg(_most_common)
    return out


def acceptance_histograms(summary: pd.DataFrame) -> dict[str, dict[int, float]]:
    """Per label: step counts by acceptance length, summed over concurrencies and repeats."""
    out: dict[str, dict[int, float]] = {}
    for label, hist in zip(summary["label"], summary.get("acceptance_histogram", [])):
        if hist:
            total = out.setdefault(label, {})
            for length, count in hist.items():
                total[length] = total.get(length, 0.0) + count
    return {label: dict(sorted(h.items())) for label, h in out.items()}


def acceptance_per_position(summary: pd.DataFrame) -> dict[tuple[str, int], list[float]]:
    """Per (label, concurrency): per-position acceptance rates (position 1 first), the median
    over repeats position by position."""
    if "acceptance_per_position" not in summary.columns:
        return {}
    out: dict[tuple[str, int], list[float]] = {}
    rows = summary.dropna(subset=["acceptance_per_position"])
    for (label, concurrency), group in rows.groupby(["label", "concurrency"], sort=True):
        rates = list(group["acceptance_per_position"])
        width = max(len(r) for r in rates)
        padded = np.full((len(rates), width), np.nan)
        for i, r in enumerate(rates):
            padded[i, : len(r)] = r
        out[(label, int(concurrency))] = [float(v) for v in np.nanmedian(padded, axis=0)]
    return out


def _read_summary(path: Path, problems: list[str]) -> pd.DataFrame:
    try:
        df = pd.read_csv(
            path,
            dtype={c: str for c in TEXT_COLUMNS},
            keep_default_na=False,
            na_values=["", "nan", "NaN", "None", "null"],
        )
    except pd.errors.EmptyDataError as e:
        raise ResultsError(f"{path} is empty") from e
    except (pd.errors.ParserError, UnicodeDecodeError) as e:  # a torn or foreign line
        raise ResultsError(f"{path} cannot be read as CSV: {' '.join(str(e).split())}") from e
    absent = [c for c in ("label", "concurrency") if c not in df.columns]
    if absent:
        raise ResultsError(f"{path} lacks column(s) {absent}; columns found: {list(df.columns)}")
    for col in NUMERIC_COLUMNS:
        if col in df.columns:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    bad = df["concurrency"].isna() | df["label"].isna()
    if bad.any():
        problems.append(f"{path.name}: skipped {int(bad.sum())} row(s) without a label or concurrency")
        df = df[~bad].copy()
    if df.empty:
        raise ResultsError(f"{path} has no rows with a label and a concurrency")
    df["concurrency"] = df["concurrency"].astype(int)
    if "repeat" not in df.columns:
        df["repeat"] = df.groupby(["label", "concurrency"]).cumcount()
    for col in ("acceptance_source", "errors"):
        if col in df.columns:
            df[col] = df[col].where(df[col].notna(), None)
    lines = [int(i) + 2 for i in df.index]  # each row's line in the file (its header is line 1)
    df = df.reset_index(drop=True)
    if "acceptance_per_position" in df.columns:
        df["acceptance_per_position"] = [
            _rates(v, f"{path.name} row {line} acceptance_per_position", problems)
            for line, v in zip(lines, df["acceptance_per_position"])
        ]
    if "acceptance_histogram" in df.columns:
        df["acceptance_histogram"] = [
            _histogram(v, f"{path.name} row {line} acceptance_histogram", problems)
            for line, v in zip(lines, df["acceptance_histogram"])
        ]
    return df


def _read_ab(path: Path, problems: list[str]) -> pd.DataFrame | None:
    try:
        df = pd.read_csv(path, dtype={"metric": str, "within_noise": str})
    except pd.errors.EmptyDataError:
        problems.append(f"{path.name} is empty")
        return None
    except (pd.errors.ParserError, UnicodeDecodeError) as e:
        problems.append(f"{path.name} cannot be read as CSV ({' '.join(str(e).split())}); no ratio table")
        return None
    absent = [c for c in ("metric", "concurrency", "ratio") if c not in df.columns]
    if absent:
        problems.append(f"{path.name} lacks column(s) {absent}; no ratio table")
        return None
    for col in ("concurrency", "a_median", "b_median", "ratio", "ci_low", "ci_high"):
        df[col] = pd.to_numeric(df[col], errors="coerce") if col in df.columns else math.nan
    df = df.dropna(subset=["metric", "concurrency"]).copy()
    df["concurrency"] = df["concurrency"].astype(int)
    flags = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    noise = df["within_noise"] if "within_noise" in df.columns else pd.Series(None, index=df.index)
    df["within_noise"] = [flags.get(str(v).strip().lower()) for v in noise]
    return df.reset_index(drop=True)


def _read_requests(
    path: Path, problems: list[str]
) -> tuple[pd.DataFrame | None, dict[tuple[str, int], ItlSamples], dict]:
    rows: list[dict[str, Any]] = []
    outputs: dict[tuple[str, int, int, int], tuple[int, ...] | None] = {}
    token_ms: dict[tuple[str, int], list[float]] = {}
    chunk_ms: dict[tuple[str, int], list[float]] = {}
    bad = 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                key = (str(record["label"]), int(record["concurrency"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                bad += 1  # a run killed mid-write leaves a torn last line
                continue
            times = record.get("chunk_times_s") or []
            tokens = record.get("chunk_tokens") or []
            if not (_numbers(times, int | float) and _numbers(tokens, int)):  # a hand-edited or foreign line
                bad += 1
                continue
            rows.append(
                {
                    "label": key[0],
                    "concurrency": key[1],
                    "repeat": record.get("repeat"),
                    "success": bool(record.get("success")),
                    "error": record.get("error"),
                }
            )
            if (
                record.get("success")
                and isinstance(record.get("index"), int)
                and isinstance(record.get("repeat"), int)
            ):
                ids = record.get("token_ids")
                outputs[(*key, record["repeat"], record["index"])] = (
                    tuple(ids) if isinstance(ids, list) else None
                )
            if record.get("success") and len(times) == len(tokens):
                # the definitions of harness/metrics.py: gaps between token-bearing chunks,
                # each split evenly among the tokens of the later chunk
                for i in range(1, len(times)):
                    gap_ms = (times[i] - times[i - 1]) * 1000.0
                    chunk_ms.setdefault(key, []).append(gap_ms)
                    if tokens[i] > 0:
                        token_ms.setdefault(key, []).extend([gap_ms / tokens[i]] * tokens[i])
    if bad:
        problems.append(f"{path.name}: skipped {bad} unreadable line(s)")
    itl = {
        key: ItlSamples(np.asarray(token_ms.get(key, []), dtype=float), np.asarray(gaps, dtype=float))
        for key, gaps in chunk_ms.items()
    }
    return (pd.DataFrame(rows) if rows else None), itl, outputs


def _numbers(values, kind) -> bool:
    """A JSON list of finite numbers of `kind` (true and false are not numbers here)."""
    return isinstance(values, list) and all(
        isinstance(v, kind) and not isinstance(v, bool) and math.isfinite(v) for v in values
    )


def _read_text(path: Path, problems: list[str]) -> str:
    """A text file as UTF-8; bytes that are not are replaced, and said so."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        problems.append(f"{path.name} is not UTF-8 text ({e.reason} at byte {e.start}); bad bytes replaced")
        return data.decode("utf-8", errors="replace")


def _read_json_object(path: Path, problems: list[str]) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        problems.append(f"{path.name} is not valid JSON ({e})")
        return None
    except UnicodeDecodeError as e:
        problems.append(f"{path.name} is not UTF-8 text ({e.reason} at byte {e.start})")
        return None
    if not isinstance(value, dict):
        problems.append(f"{path.name} holds a {type(value).__name__}, expected a JSON object")
        return None
    return value


def _parse_json(value: Any, kind: type, where: str, problems: list[str]) -> Any:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value == "":
        return None
    try:
        parsed = json.loads(value)
    except (json.JSONDecodeError, TypeError):
        problems.append(f"{where}: not JSON: {str(value)[:80]!r}")
        return None
    if not isinstance(parsed, kind):
        problems.append(f"{where}: expected a JSON {kind.__name__}, got {str(value)[:80]!r}")
        return None
    return parsed or None


def _rates(value: Any, where: str, problems: list[str]) -> list[float] | None:
    rates = _parse_json(value, list, where, problems)
    try:
        return [math.nan if r is None else float(r) for r in rates] if rates else None
    except (TypeError, ValueError):
        problems.append(f"{where}: {rates!r} is not a list of rates")
        return None


def _histogram(value: Any, where: str, problems: list[str]) -> dict[int, float] | None:
    hist = _parse_json(value, dict, where, problems)
    try:
        return {int(float(k)): float(v) for k, v in hist.items()} if hist else None
    except (TypeError, ValueError):
        problems.append(f"{where}: {hist!r} is not {{acceptance length: count}}")
        return None


def _most_common(values: pd.Series) -> str | None:
    present = values.dropna()
    return None if present.empty else str(present.mode().iloc[0])
