"""Whether a benchmark succeeded: a run whose failed requests exceed the allowed share, or a
benchmark in which no request completed, fails the command (exit status 1) with one line on
stderr that says which runs and why. The result files are kept either way."""

from __future__ import annotations

from .resume import failure_rate


def failed_runs(summaries: list[dict], max_failure_rate: float) -> list[dict]:
    return [s for s in summaries if failure_rate(s) > max_failure_rate]


def verdict_line(summaries: list[dict], max_failure_rate: float) -> str | None:
    """None when the benchmark succeeded; else the one-line reason."""
    if not summaries:
        return None
    completed = sum(int(float(s.get("completed") or 0)) for s in summaries)
    bad = failed_runs(summaries, max_failure_rate)
    if completed and not bad:
        return None
    first_error = next((s.get("errors") for s in bad if s.get("errors")), "")
    runs = ", ".join(
        f"{s['label']} c={s['concurrency']} r={s['repeat']} "
        f"{int(float(s.get('failed') or 0))}/"
        f"{int(float(s.get('failed') or 0)) + int(float(s.get('completed') or 0))}"
        for s in bad[:4]
    )
    more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
    head = (
        "no request completed"
        if not completed
        else f"{len(bad)} of {len(summaries)} runs failed more than --max-failure-rate "
        f"{max_failure_rate:g} of their requests"
    )
    detail = f" ({runs}{more})" if runs else ""
    error = f"; first error: {first_error[:200]}" if first_error else ""
    return f"benchmark failed: {head}{detail}{error}"
