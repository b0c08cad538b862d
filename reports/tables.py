"""Markdown tables from a result set: results by concurrency (labels side by side), the A/B
ratio table with bootstrap intervals, and failures. Values are medians over repeats."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import pandas as pd

from .results import ResultSet, aggregate_repeats

MISSING = "n/a"


@dataclass(frozen=True)
class Row:
    """One metric row of the results table: a summary.csv column and how to print it."""

    title: str
    column: str
    digits: int
    optional: bool = False  # left out when no label has a value (goodput, acceptance)


RESULT_ROWS = (
    Row("Output throughput (tok/s)", "output_tokens_per_s", 1),
    Row("Request throughput (req/s)", "request_throughput", 3),
    Row("TTFT p50 (ms)", "ttft_ms_median", 2),
    Row("TTFT p99 (ms)", "ttft_ms_p99", 2),
    Row("TPOT mean (ms)", "tpot_ms_mean", 2),
    Row("ITL per token, mean (ms)", "itl_token_ms_mean", 2),
    Row("ITL per chunk, mean (ms)", "itl_chunk_ms_mean", 2),
    Row("E2E mean (ms)", "e2e_ms_mean", 2),
    Row("Achieved concurrency", "achieved_concurrency", 2),
    Row("Goodput (req/s)", "goodput_requests_per_s", 3, optional=True),
    Row("Acceptance length", "acceptance_length", 2, optional=True),
    Row("Acceptance rate", "acceptance_rate", 3, optional=True),
)

# how ab.csv metrics are named in the ratio table, and which way is better
METRIC_TITLES = {
    "output_tokens_per_s": "Output throughput",
    "request_throughput": "Request throughput",
    "goodput_requests_per_s": "Goodput",
    "ttft_ms": "TTFT",
    "tpot_ms": "TPOT",
    "itl_token_ms": "ITL per token",
    "itl_chunk_ms": "ITL per chunk",
    "e2e_ms": "E2E",
}
STAT_TITLES = {"mean": "mean", "median": "p50", "p90": "p90", "p99": "p99"}
HIGHER_IS_BETTER = (
    "output_tokens_per_s",
    "request_throughput",
    "goodput_requests_per_s",
    "acceptance_length",
    "acceptance_rate",
)


def markdown_table(header: list[str], rows: list[list[str]], right: Collection[int] | None = None) -> str:
    """A GitHub markdown table. Columns whose index is in `right` (default: all but the first,
    for tables of numbers) are right-aligned."""
    right = range(1, len(header)) if right is None else right
    cells = [[_cell(c) for c in row] for row in [header, *rows]]
    rule = ["---:" if i in right else "---" for i in range(len(header))]
    lines = [cells[0], rule, *cells[1:]]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def fmt(value: float | None, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    return f"{value:,.{digits}f}"


def results_tables(results: ResultSet) -> dict[int, str]:
    """Per concurrency: a table of RESULT_ROWS with one column per label (median over its n
    repeats), and a ratio column (last label / first) when there are exactly two labels."""
    agg = aggregate_repeats(results.summary)
    labels = results.labels
    tables: dict[int, str] = {}
    for concurrency in results.concurrencies:
        present = [label for label in labels if (label, concurrency) in agg.index]
        header = [
            "Metric",
            *[f"{results.display(label)} (n={int(agg.loc[(label, concurrency), 'n'])})" for label in present],
        ]
        pair = len(present) == 2
        if pair:
            header.append(f"{present[1]}/{present[0]}")
        rows = []
        for row in RESULT_ROWS:
            values = [_value(agg, label, concurrency, row.column) for label in present]
            if row.optional and all(v is None for v in values):
                continue
            cells = [fmt(v, row.digits) for v in values]
            if row.column in agg.columns and f"{row.column}_min" in agg.columns:
                cells = [
                    _with_range(agg, label, concurrency, row, cell) for label, cell in zip(present, cells)
                ]
            if pair:
                cells.append(_ratio(values[0], values[1]))
            rows.append([row.title, *cells])
        if "acceptance_source" in agg.columns:
            sources = [agg.loc[(label, concurrency), "acceptance_source"] for label in present]
            sources = [MISSING if pd.isna(s) else str(s) for s in sources]
            if any(s != MISSING for s in sources):
                rows.append(["Acceptance source", *sources, *([""] if pair else [])])
        tables[concurrency] = markdown_table(header, rows)
    return tables


def ratio_table(ab: pd.DataFrame) -> str:
    """The A/B table of ab.csv: medians, ratio B/A with its bootstrap 95% interval, and whether
    the interval says the difference is within run-to-run noise."""
    order = {name: i for i, name in enumerate(METRIC_TITLES)}
    ab = ab.assign(_order=[order.get(_base(m), len(order)) for m in ab["metric"]])
    ab = ab.sort_values(["_order", "metric", "concurrency"], kind="stable")
    header = ["Metric", "Concurrency", "A median", "B median", "B/A", "95% CI", "Within noise", "B vs A"]
    rows = []
    for r in ab.itertuples(index=False):
        digits = 1 if r.metric.endswith("tokens_per_s") else 2  # tok/s to 0.1, requests to 0.01
        ci = (
            f"[{fmt(r.ci_low, 3)}, {fmt(r.ci_high, 3)}]"
            if not (math.isnan(r.ci_low) or math.isnan(r.ci_high))
            else MISSING
        )
        noise = {True: "yes", False: "no", None: MISSING}[r.within_noise]
        rows.append(
            [
                metric_title(r.metric),
                str(r.concurrency),
                fmt(r.a_median, digits),
                fmt(r.b_median, digits),
                fmt(r.ratio, 3),
                ci,
                noise,
                _verdict(r.metric, r.ratio, r.within_noise),
            ]
        )
    return markdown_table(header, rows, right=range(1, 6))


def failure_table(results: ResultSet) -> str | None:
    """Completed and failed requests per (label, concurrency) summed over repeats, with the
    distinct errors; None when no request failed."""
    summary = results.summary
    if "failed" not in summary.columns or not (summary["failed"].fillna(0) > 0).any():
        return None
    agg = aggregate_repeats(summary)
    errors = _errors(results)
    rows = []
    for (label, concurrency), row in agg.iterrows():
        if not row.get("failed", 0) > 0:
            continue
        listed = errors.get((label, concurrency), [])
        text = "; ".join(f"{e} (x{n})" if n > 1 else e for e, n in listed[:5]) or MISSING
        if len(listed) > 5:
            text += f"; and {len(listed) - 5} more"
        rows.append([label, str(concurrency), fmt(row.get("completed"), 0), fmt(row.get("failed"), 0), text])
    return markdown_table(["Label", "Concurrency", "Completed", "Failed", "Errors"], rows, right=(1, 2, 3))


def metric_title(metric: str) -> str:
    """`ttft_ms_median` -> `TTFT p50 (ms)`; unknown names are returned unchanged."""
    base = _base(metric)
    if base not in METRIC_TITLES:
        return metric
    stat = metric[len(base) :].lstrip("_")
    unit = " (ms)" if base.endswith("_ms") else " (tok/s)" if base == "output_tokens_per_s" else " (req/s)"
    return " ".join(filter(None, [METRIC_TITLES[base], STAT_TITLES.get(stat, stat)])) + unit


def _base(metric: str) -> str:
    for name in METRIC_TITLES:
        if metric == name or metric.startswith(name + "_"):
            return name
    return metric


def _verdict(metric: str, ratio: float, within_noise: bool | None) -> str:
    if within_noise is None or math.isnan(ratio):
        return MISSING
    if within_noise or ratio == 1.0:
        return "no clear change"
    higher = _base(metric) in HIGHER_IS_BETTER
    if not higher and not _base(metric).endswith("_ms"):
        return "higher" if ratio > 1 else "lower"
    return "better" if (ratio > 1) == higher else "worse"


def _value(agg: pd.DataFrame, label: str, concurrency: int, column: str) -> float | None:
    if column not in agg.columns or (label, concurrency) not in agg.index:
        return None
    value = agg.loc[(label, concurrency), column]
    return None if pd.isna(value) else float(value)


def _with_range(agg: pd.DataFrame, label: str, concurrency: int, row: Row, cell: str) -> str:
    """`102.5 (101.5-103.5)`: the median and, over more than one repeat, the min-max range."""
    low = _value(agg, label, concurrency, f"{row.column}_min")
    high = _value(agg, label, concurrency, f"{row.column}_max")
    if low is None or high is None or agg.loc[(label, concurrency), "n"] < 2:
        return cell
    return f"{cell} ({fmt(low, row.digits)}–{fmt(high, row.digits)})"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or a == 0:
        return MISSING
    return f"{b / a:.3f}"


def _errors(results: ResultSet) -> dict[tuple[str, int], list[tuple[str, int]]]:
    """Distinct errors per (label, concurrency) with counts, most frequent first: from
    requests.jsonl, else from summary.csv's `errors` column (joined with "; ", no counts)."""
    out: dict[tuple[str, int], list[tuple[str, int]]] = {}
    if results.requests is not None:
        failed = results.requests[~results.requests["success"]]
        failed = failed.assign(error=failed["error"].fillna("(no error message)").astype(str).str[:200])
        for (label, concurrency), group in failed.groupby(["label", "concurrency"]):
            counts = group["error"].value_counts()
            out[(label, int(concurrency))] = [(str(e), int(n)) for e, n in counts.items()]
    if "errors" in results.summary.columns:
        from_summary: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for r in results.summary.dropna(subset=["errors"]).itertuples(index=False):
            listed = from_summary.setdefault((r.label, int(r.concurrency)), [])
            for e in str(r.errors).split("; "):
                if e and e not in [x for x, _ in listed]:
                    listed.append((e, 1))
        out = {**from_summary, **out}
    return out


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")
