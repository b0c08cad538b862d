"""report.md: the title and notes, the verdict (verdict.py: which side is which, speed-up,
identical outputs, acceptance, warnings), the run metadata and missing inputs, the metric
definitions stated once, the tables, the plots (relative links) and, when present, the HTTP
equivalence report.

The report depends on the result files alone (no clock, no host), so rebuilding it from
the same files gives the same bytes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .plots import PLOTS_DIR, Plot, write_plots
from .results import AB, COMPARE_MD, COMPARE_SUMMARY, META, REQUESTS, SUMMARY, ResultSet, load_results
from .tables import failure_table, markdown_table, ratio_table, results_tables
from .verdict import verdict_section

REPORT = "report.md"

# docs/design.md, "Metric definitions" and "Vocabulary": what every number in a report means
METRIC_DEFINITIONS = """\
- **TTFT**: request sent -> first chunk that carries a token.
- **E2E latency**: request sent -> last chunk that carries a token.
- **TPOT** per request = (E2E - TTFT) / (output_tokens - 1); requests with one token are
  left out of TPOT. Reported as mean and percentiles across requests.
- **ITL, per token**: each gap between token-bearing chunks is divided evenly among the
  tokens that chunk carries (counts from the server's token ids or usage; only for a server
  that reports neither, from the model's tokenizer applied to the streamed text, as the
  Token counts section says). **Chunk ITL** is the raw gap between token-bearing chunks, reported
  separately. Under speculative decoding one chunk carries several tokens, so the two
  differ a lot; both are shown.
- **Output throughput** = all output tokens / wall time of the measured phase (warm-up
  excluded). Request throughput likewise.
- **Acceptance** from Prometheus counters: snapshot after warm-up and after the run, take
  differences: acceptance length = 1 + d(accepted) / d(drafts); acceptance rate =
  d(accepted) / d(draft_tokens); per-position[k] = d(accepted_per_pos{position=k}) / d(drafts).
  Acceptance length counts committed tokens per step, the bonus token included (as z-lab,
  vLLM and lmdeploy define it). Counters seen in the field:
  `vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_draft_tokens_total`,
  `vllm:spec_decode_num_accepted_tokens_total`,
  `vllm:spec_decode_num_accepted_tokens_per_pos_total{position=...}`; lmdeploy the same with
  prefix `lmdeploy:`; SGLang exposes gauges `sglang:spec_accept_length`,
  `sglang:spec_accept_rate` and per-request `meta_info.spec_verify_ct`, `spec_accept_length`.
  The acceptance source row says where a run's figures came from.
- **Repeats**: every figure in the tables is the median over the n repeats of one
  (label, concurrency); a percentile (e.g. TTFT p99) is the median of the per-repeat
  percentiles. A/B ratios are B/A of medians with a bootstrap 95% interval over repeats;
  "within noise" is `ab.csv`'s flag that the difference cannot be told apart from
  run-to-run variation.
"""

# what a reader loses when an optional file is absent
MISSING_MEANS = {
    AB: "no A/B ratio table with intervals",
    REQUESTS: "no per-request error details or ITL distribution",
    META: "no run metadata",
    COMPARE_MD: "no HTTP equivalence section",
    COMPARE_SUMMARY: "no HTTP equivalence summary",
}
LONG_VALUE = 100  # metadata values longer than this are shown as code blocks, not table cells


def build_report(directory: Path) -> Path:
    """Rebuild `directory/report.md` and `directory/plots/*.png` from the result files there."""
    results = load_results(directory)
    plots = write_plots(results, results.directory / PLOTS_DIR)
    path = results.directory / REPORT
    path.write_text(render_report(results, plots))
    return path


def render_report(results: ResultSet, plots: list[Plot]) -> str:
    sections = [
        _title(results),
        verdict_section(results),
        _header(results),
        "## Metric definitions\n\n" + METRIC_DEFINITIONS,
        _ratios(results),
        _results(results),
        _token_counts(results),
        _failures(results),
        _plots(plots),
        _equivalence(results),
    ]
    return "\n\n".join(s.strip("\n") for s in sections if s) + "\n"


def _title(results: ResultSet) -> str:
    meta = results.meta
    title = meta.get("title") or f"Benchmark report: {results.directory.name}"
    lines = [f"# {title}"]
    notes = meta.get("notes", meta.get("note"))
    if notes:
        notes = notes if isinstance(notes, list) else [notes]
        lines += ["", *[f"> **Note:** {note}" for note in notes]]
    return "\n".join(lines)


def _header(results: ResultSet) -> str:
    meta = results.meta
    summary = results.summary
    repeats = summary.groupby(["label", "concurrency"]).size()
    lines = [
        f"Labels: {', '.join(map(results.display, results.labels))}; concurrency: "
        f"{', '.join(map(str, results.concurrencies))}; repeats per point: "
        f"{_span(repeats.min(), repeats.max())} ({len(summary)} rows in `{SUMMARY}`)."
    ]
    # a single-server run has no A/B file to miss
    missing = [name for name in results.missing if not (name == AB and len(results.labels) == 1)]
    if missing:
        lines += ["", "Missing inputs:", ""]
        lines += [f"- `{name}`: {MISSING_MEANS[name]}" for name in missing]
    if results.problems:
        lines += ["", "Input problems (the report shows what could be read):", ""]
        lines += [f"- {problem}" for problem in results.problems]
    shown = {k: v for k, v in meta.items() if k not in ("title", "notes", "note")}
    if shown:
        lines += ["", "## Run", "", _metadata(shown)]
    return "\n".join(lines)


def _metadata(meta: dict[str, Any]) -> str:
    """Short scalar fields as a table; commands and other long values as code blocks."""
    short, long = [], []
    for key, value in _flatten(meta):
        text = value if isinstance(value, str) else "n/a" if value is None else json.dumps(value)
        is_command = "command" in key.lower() or "cmd" in key.lower()
        (long if is_command or len(text) > LONG_VALUE or "\n" in text else short).append((key, text))
    out = []
    if short:
        out.append(
            markdown_table(
                ["Field", "Value"], [[k, f"`{v}`" if k.endswith("commit") else v] for k, v in short], right=()
            )
        )
    for key, text in long:
        out.append(f"`{key}`:\n\n```\n{text}\n```")
    return "\n\n".join(out)


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [item for k, v in value.items() for item in _flatten(v, f"{prefix}{k}.")]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value) and "command" in prefix:
        return [(prefix.rstrip("."), " ".join(value))]  # an argv list reads best as one line
    if isinstance(value, list) and all(isinstance(v, (str, int, float, bool)) or v is None for v in value):
        return [(prefix.rstrip("."), ", ".join(map(str, value)))]
    return [(prefix.rstrip("."), value)]


def _ratios(results: ResultSet) -> str:
    title = "## A/B ratios (B/A)\n\n"
    if results.ab is not None and not results.ab.empty:
        return (
            title + "Medians over repeats; B/A with a bootstrap 95% interval. For latencies "
            "a ratio below 1 is better, for throughput above 1.\n\n" + ratio_table(results.ab)
        )
    if len(results.labels) == 1:
        return ""  # a single-server run has nothing to compare
    return (
        title + f"`{AB}` is absent or unreadable: no intervals. The ratio column of the "
        "tables below is a plain ratio of medians."
    )


def _results(results: ResultSet) -> str:
    parts = [
        "## Results by concurrency",
        "Median over the n repeats of each label. Throughput "
        "shows the min–max range over repeats in parentheses.",
    ]
    for concurrency, table in results_tables(results).items():
        parts += [f"### Concurrency {concurrency}", table]
    acceptance = results.summary.get("acceptance_length")
    if acceptance is None or acceptance.isna().all():
        parts.append(
            "No acceptance metrics in `summary.csv`: the servers expose no speculative "
            "decoding counters or per-request statistics."
        )
    return "\n\n".join(parts)


def _token_counts(results: ResultSet) -> str:
    """Where each label's token counts came from: the server's ids or usage, or the model's
    tokenizer (or an estimate) for servers that report neither; and streams without [DONE]."""
    summary = results.summary
    if "count_source" not in summary.columns:
        return ""
    rows = []
    for label in results.labels:
        part = summary[summary["label"] == label]
        sources = sorted({str(s) for s in part["count_source"].dropna()})
        kinds = sorted({str(s) for s in part.get("server_kind", []) if isinstance(s, str)})
        no_done = part.get("streams_without_done")
        rows.append(
            [
                label,
                ", ".join(kinds) or "–",
                ", ".join(sources) or "–",
                "–" if no_done is None else str(int(no_done.fillna(0).sum())),
            ]
        )
    table = markdown_table(
        ["label", "server kind", "token counts from", "streams without [DONE]"], rows, right=()
    )
    return (
        "## Token counts\n\n`server_ids`, `usage` and `meta_info` are the server's own counts; "
        "`tokenizer` tokenises the streamed text with the model's tokenizer (`--tokenizer`); "
        "`estimated` counts one token per text chunk.\n\n" + table
    )


def _failures(results: ResultSet) -> str:
    table = failure_table(results)
    if "failed" not in results.summary.columns:
        return f"## Failures\n\n`{SUMMARY}` has no `failed` column."
    if table is None:
        completed = results.summary.get("completed")
        total = "" if completed is None else f" ({int(completed.fillna(0).sum()):,} completed)"
        return f"## Failures\n\nNo failed requests{total}."
    return "## Failures\n\nSummed over repeats; distinct errors with their counts.\n\n" + table


def _plots(plots: list[Plot]) -> str:
    parts = ["## Plots"]
    for plot in plots:
        if plot.drawn:
            link = f"![{plot.title}]({PLOTS_DIR}/{plot.filename})"
            parts.append(f"### {plot.title}\n\n{link}\n\n{plot.caption}")
        else:
            parts.append(f"### {plot.title}\n\nNot drawn: {plot.caption}.")
    return "\n\n".join(parts)


def _equivalence(results: ResultSet) -> str:
    if results.compare_md is not None:
        return "## HTTP equivalence\n\n" + _demote_headings(results.compare_md.strip(), levels=2)
    if results.compare_summary:
        rows = [[k, v if isinstance(v, str) else json.dumps(v)] for k, v in _flatten(results.compare_summary)]
        return (
            f"## HTTP equivalence\n\nFrom `{COMPARE_SUMMARY}` (`{COMPARE_MD}` absent).\n\n"
            + markdown_table(["Field", "Value"], rows, right=())
        )
    return ""


def _demote_headings(text: str, levels: int) -> str:
    """Nest an included document's headings under ours; lines inside code fences stay as they are."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        heading = None if fenced else re.match(r"(#{1,6}) ", line)
        if heading:
            line = "#" * min(6, len(heading.group(1)) + levels) + line[len(heading.group(1)) :]
        out.append(line)
    return "\n".join(out)


def _span(low: int, high: int) -> str:
    return str(low) if low == high else f"{low}–{high}"
