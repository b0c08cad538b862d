"""The files of `harness compare`, its one-line verdict and its exit status.

`compare.jsonl` gets one row per comparison (prompt x concurrency level) the moment it is
made, flushed, so an interrupted run keeps what it compared; `--resume` keeps every row
without an error and compares the rest (a torn last line is dropped). Each row carries the
prompt (text, token ids or chat messages) and its source (`FILE:LINE`, `builtin:SET#INDEX`).
`compare_run.json` holds what the rows were compared against (`run_identity`: both servers
and the settings that shape a row); `--resume` refuses a folder whose rows were made against
anything else (`ResumeConflict`), since a row of another candidate proves nothing about this
one. At the end: `compare_summary.json` (the summary), `compare_summary.csv` (one row
overall, one per level, one per context bucket) and `compare.md`.
"""

from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import asdict, fields
from pathlib import Path

from .answer import ERRORS, error_class
from .client import Endpoint
from .compare import ComparePolicy, PromptResult
from .divergence import Divergence
from .resume import check_saved_identity, read_request_rows

ROWS = "compare.jsonl"
RUN = "compare_run.json"
_FIELDS = {f.name for f in fields(PromptResult)}


def run_identity(baseline: Endpoint, candidate: Endpoint, policy: ComparePolicy, stream: bool) -> dict:
    """What the rows of one run were compared against: each server (its URL, the model it is
    sent, the extensions and id reporting of its kind, the tokenizer) and the settings that
    change a row (streamed or whole candidate answers, the tie threshold, the divergences
    followed per prompt). The prompt, max_tokens and level are each row's own key; the
    policy and --max-tie-rate only judge the rows, so a resumed run may change them."""

    def side(endpoint: Endpoint) -> dict:
        kind = endpoint.accepts.as_dict()
        kind.pop("evidence")  # how the kind was decided, not what it is
        return {
            "url": endpoint.base_url.rstrip("/"),
            "model": endpoint.model,
            **kind,
            "return_token_ids": endpoint.accepts.return_token_ids,
            "tokenizer": endpoint.tokenizer.path if endpoint.tokenizer is not None else None,
        }

    return {
        "baseline": side(baseline),
        "candidate": side(candidate),
        "stream": stream,
        "tie_threshold": policy.tie_threshold,
        "max_divergences": policy.max_divergences,
    }


def check_resumable(out: Path, identity: dict) -> None:
    """ResumeConflict unless every row in `out` was made against `identity`."""
    rows, dropped = read_request_rows(out / ROWS)
    if not rows and not dropped:
        return  # nothing to keep
    check_saved_identity(
        out / RUN,
        identity,
        f"{out / ROWS} has {len(rows)} rows",
        f"the {len(rows)} rows in {out / ROWS} were compared against another run",
        "compared against",
        "compare afresh without --resume (or into another --out)",
    )


def result_from_row(row: dict) -> PromptResult | None:
    """A comparison read back from compare.jsonl (None: not a row of ours)."""
    try:
        divergences = [Divergence(**d) for d in row.get("divergences") or []]
        return PromptResult(**{**{k: v for k, v in row.items() if k in _FIELDS}, "divergences": divergences})
    except TypeError:
        return None


class RowLog:
    """compare.jsonl, appended and flushed one comparison at a time, and compare_run.json, the
    identity its rows were made against. With `resume` the rows of an earlier run are kept,
    after ResumeConflict unless that run's identity is `identity`."""

    def __init__(self, out: Path, resume: bool, identity: dict) -> None:
        if resume:
            check_resumable(out, identity)
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / ROWS
        self.kept: dict[str, PromptResult] = {}  # by key: comparisons an earlier run made
        self.dropped = 0  # torn or unreadable lines, and rows with an error (compared again)
        tmp = out / (RUN + ".tmp")
        tmp.write_text(json.dumps(identity, indent=2) + "\n")
        os.replace(tmp, out / RUN)
        if resume and self.path.exists():
            rows, self.dropped = read_request_rows(self.path)
            for row in rows:
                result = result_from_row(row)
                if result is None or result.error:
                    self.dropped += 1
                    continue
                self.kept[result.key] = result  # the last copy of a key wins
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(asdict(r)) + "\n" for r in self.kept.values()))
            os.replace(tmp, self.path)
        else:
            self.path.write_text("")
        self.written = 0
        self._file = self.path.open("a")

    def append(self, result: PromptResult) -> None:
        self._file.write(json.dumps(asdict(result)) + "\n")
        self._file.flush()
        self.written += 1

    def close(self) -> None:
        self._file.close()


def write_outputs(out: Path, results: list[PromptResult], summary: dict) -> None:
    """The summary files and compare.md (compare.jsonl is the RowLog's)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    columns = [
        "scope",
        "concurrency",
        "context",
        "prompts",
        "exact",
        "ties",
        "mismatches",
        "errors",
        "unchecked",
        "match_rate",
        "tie_rate",
        "verdict",
        "reason",
    ]
    rows = [{"scope": "all", "concurrency": "all", "context": "all", **summary}]
    rows += [
        {"scope": "concurrency", "concurrency": c, "context": "all", **counts}
        for c, counts in summary["by_concurrency"].items()
    ]
    rows += [
        {"scope": "context", "concurrency": "all", "context": b, **counts}
        for b, counts in summary["by_context"].items()
    ]
    with (out / "compare_summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (out / "compare.md").write_text(markdown(results, summary))


def exit_status(summary: dict) -> int:
    """0 pass, 1 a difference or output never compared (mismatch, ties, unchecked, unsent), else
    the error class's status (answer.py)."""
    if summary["error"]:
        return ERRORS[error_class(summary["error"])][0]
    return 0 if summary["verdict"] == "pass" else 1


def verdict_line(results: list[PromptResult], summary: dict) -> str:
    """The one line for stderr: `pass: ...`, `fail: mismatch: ...` or `error: NAME: ...`."""
    n, levels = summary["prompts"], ", ".join(str(c) for c in summary["levels"]) or "none"
    if summary["error"]:
        failed = next((r for r in results if r.error), None)
        where = (
            f" (prompt {failed.source} at c={failed.concurrency}; {summary['errors']} of "
            f"{n} comparisons failed)"
            if failed
            else ""
        )
        return f"error: {summary['error']}: {summary['error_message']}{where}"
    if summary["verdict"] == "pass":
        return (
            f"pass: {summary['exact']} of {n} comparisons exact, {summary['ties']} ties "
            f"(concurrency {levels}; policy {summary['policy']})"
        )
    if summary["reason"] == "unchecked":
        r = next(r for r in results if r.unchecked and not r.error)
        return (
            f"fail: unchecked: {summary['unchecked']} of {n} comparisons not compared in full "
            f"at a tie (first: prompt {r.source} at c={r.concurrency}, {r.unchecked})"
        )
    if summary["reason"] == "unsent":
        return (
            f"fail: unsent: {summary['unsent']} prompts never sent, so never compared; the "
            f"{n} comparisons made do not cover the prompt set (first: {summary['unsent_reasons'][0]})"
        )
    if summary["reason"] == "ties":
        worst = max(summary["by_concurrency"].items(), key=lambda kv: kv[1]["tie_rate"])
        return (
            f"fail: ties: {summary['ties']} ties; tie rate {worst[1]['tie_rate']:.3f} at "
            f"c={worst[0]} (policy {summary['policy']}, --max-tie-rate "
            f"{summary['max_tie_rate']})"
        )
    r, d = next((r, d) for r in results for d in r.divergences if d.kind == "mismatch")
    differ = sum(1 for r in results if any(d.kind == "mismatch" for d in r.divergences))
    return (
        f"fail: mismatch: {differ} of {n} comparisons differ (first: prompt {r.source} "
        f"at c={r.concurrency}, {d.what} at position {d.position}: baseline "
        f"{d.baseline_text!r}, candidate {d.candidate_text!r})"
    )


def md_quote(text: str) -> str:
    """`text` as one inline code span that cannot break a markdown table or line: control
    characters written as escapes (repr), pipes escaped, a fence longer than any backtick run."""
    body = repr(text)[1:-1].replace("|", "\\|")
    if not body:
        return "(empty)"
    fence = "`" * (max((len(run) for run in re.findall("`+", body)), default=0) + 1)
    pad = " " if body.startswith("`") or body.endswith("`") else ""
    return f"{fence}{pad}{body}{pad}{fence}"


COMPARED = {"ids": "token ids", "text": "text (a server reported no ids)", "none": "nothing (error)"}


def prompt_name(r: PromptResult) -> str:
    """A prompt as a reader finds it: its source (`FILE:LINE`, `builtin:SET#INDEX`), not its place
    in the run's seeded order; `#N` for a prompt given without one."""
    return md_quote(r.source or f"#{r.index}")


def _group_table(title: str, groups: dict[str, dict]) -> list[str]:
    lines = [f"| {title} | prompts | exact | ties | mismatches | errors |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {name} | {c['prompts']} | {c['exact']} | {c['ties']} | {c['mismatches']} | {c['errors']} |"
        for name, c in groups.items()
    ]
    return lines + [""]


def markdown(results: list[PromptResult], summary: dict, shown: int = 5) -> str:
    compared = summary["prompts"] - summary["errors"]
    why = f", {summary['reason']}" if summary.get("reason") else ""
    lines = [
        "## HTTP equivalence",
        "",
        f"Verdict: **{summary['verdict']}**{why} (policy `{summary['policy']}`, tie "
        f"threshold {summary['tie_threshold']} logprob). Prompts {summary['prompts']}: "
        f"compared {compared} ({summary['compared_ids']} by token ids, "
        f"{summary['compared_text']} by text), errors {summary['errors']} (not comparisons); "
        f"exact {summary['exact']} ({100 * summary['match_rate']:.1f}%), ties "
        f"{summary['ties']}, mismatches {summary['mismatches']}, unchecked after a tie "
        f"{summary['unchecked']}. Compared: **{summary['compared']}**.",
        "",
    ]
    if summary.get("error"):
        lines += [f"Error `{summary['error']}`: {md_quote(summary['error_message'] or '')}", ""]
    if summary.get("unusable"):
        lines += [
            f"Unusable prompts: {summary['unusable']} (first: {md_quote(summary['unusable_reasons'][0])}).",
            "",
        ]
    if summary.get("unsent"):
        lines += [
            f"Prompts not sent (a server would not take them), never compared: {summary['unsent']} "
            f"(first: {md_quote(summary['unsent_reasons'][0])}).",
            "",
        ]
    if len(summary.get("by_concurrency", {})) > 1 or len(summary.get("by_context", {})) > 1:
        lines += _group_table("concurrency", summary["by_concurrency"])
        lines += _group_table("context", summary["by_context"])
    divergent = [(r, d) for r in results for d in r.divergences]
    if divergent:
        lines += [
            "| prompt | c | compared | what | position | baseline | candidate | margin | kind |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r, d in divergent[:shown]:
            margin = "n/a" if d.margin is None else f"{d.margin:.4f}"
            position = f"character {d.char_position}" if d.position is None else str(d.position)
            lines.append(
                f"| {prompt_name(r)} | {r.concurrency} | {r.compared} | {d.what} | {position} "
                f"| {d.baseline_token} {md_quote(d.baseline_text)} | "
                f"{d.candidate_token} {md_quote(d.candidate_text)} | {margin} | "
                f"{d.kind} |"
            )
        lines.append("")
    lines += [
        "Per prompt:",
        "",
        "| prompt | c | context | compared | result |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        outcome = (
            (f"error {r.error_name or ''}: " + md_quote(r.error[:200]))
            if r.error
            else "exact"
            if r.exact
            else f"{len(r.divergences)} divergence(s)"
            + (f", the rest unchecked ({md_quote(r.unchecked)})" if r.unchecked else "")
        )
        lines.append(
            f"| {prompt_name(r)} | {r.concurrency} | {r.context} "
            f"| {COMPARED[r.compared if not r.error else 'none']} | {outcome} |"
        )
    return "\n".join(lines) + "\n"
