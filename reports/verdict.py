"""The verdict that opens a report: which side is which, the speed-up per concurrency with its
interval in a plain sentence, whether both sides produced the same tokens, acceptance, and
the warnings a reader needs before trusting the tables (client saturation, closed-loop
TTFT, prompt sets that differ between concurrencies, repeats that disagree, a machine busy
with something else)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .results import ResultSet, aggregate_repeats
from .tables import fmt

# a chunk gap under this is the client reading a backlog, not the server's pace: no engine
# step is that short, so many such gaps mean the client machine was starved
SATURATED_GAP_MS = 0.5
CLIENT_BUSY = 0.85  # a client process's share of a run on a core, past which it is warned about
SATURATED_SHARE = 0.10
# repeats of one side and concurrency whose output throughput spreads wider than this share of
# their median measured a machine whose speed changed (measured: 35% on a loaded 2-core
# machine, where an idle one stays within a few percent)
REPEAT_SPREAD = 0.10
MISMATCHES_LISTED = 5


def verdict_section(results: ResultSet) -> str:
    lines = ["## Verdict", ""]
    labels = results.labels
    agg = aggregate_repeats(results.summary)
    if len(labels) == 2:
        a, b = labels
        named = isinstance(results.meta.get("labels"), dict)
        if named:
            lines.append(f"{a} is **{results.name(a)}**, {b} is **{results.name(b)}**.")
        else:
            lines.append(
                f"{a} and {b} are not named (`harness ab --a-label ... --b-label ...` "
                f"names them); ratios are {b}/{a}."
            )
        lines.append("")
        lines += [f"- {sentence}" for sentence in _speedups(results, agg, a, b)]
        lines.append(f"- {_identical(results, a, b)}")
    acceptance = _acceptance(results, agg)
    if acceptance:
        lines.append(f"- {acceptance}")
    prompts = _prompt_sets(results)
    if prompts:
        lines.append(f"- {prompts}")
    checks = (
        _busy_machine(results),
        _repeat_spread(results, agg),
        _saturation(results),
        _busy_client(results),
        _busy_server(results),
        _contradicting_counters(results),
        _closed_loop_ttft(results, agg),
    )
    warnings = [w for w in checks if w]
    if warnings:
        lines += ["", *[f"> {w}" for w in warnings]]
    return "\n".join(lines) if len(lines) > 2 else ""


def _speedups(results: ResultSet, agg: pd.DataFrame, a: str, b: str) -> list[str]:
    """One sentence per concurrency: B's output throughput as a multiple of A's."""
    ab = results.ab
    rows = {}
    if ab is not None and not ab.empty:
        for r in ab[ab["metric"] == "output_tokens_per_s"].itertuples(index=False):
            rows[int(r.concurrency)] = (r.ratio, r.ci_low, r.ci_high, r.within_noise)
    out = []
    for c in results.concurrencies:
        unreadable = c in rows and pd.isna(rows[c][0])  # a damaged or hand-edited `ab.csv`
        if c in rows and not unreadable:
            ratio, low, high, noise = rows[c]
            interval = (
                f" (95% interval {fmt(low, 2)}–{fmt(high, 2)})"
                if not (math.isnan(low) or math.isnan(high))
                else ""
            )
        else:
            va, vb = _get(agg, a, c), _get(agg, b, c)
            if va is None or vb is None or va == 0:
                continue
            why = "the ratio in `ab.csv` is unreadable" if unreadable else "`ab.csv` absent"
            ratio, interval, noise = vb / va, f" (no interval: {why})", None
        if noise or ratio == 1.0:
            reading = "no clear difference, within run-to-run noise"
        else:
            reading = f"{results.name(b)} is {'faster' if ratio > 1 else 'slower'}"
        out.append(
            f"Concurrency {c}: {results.name(b)} delivers {fmt(ratio, 2)}x the output "
            f"throughput of {results.name(a)}{interval}: {reading}."
        )
    return out


def _identical(results: ResultSet, a: str, b: str) -> str:
    """Token ids of A and B compared request by request (same concurrency, repeat, index)."""
    if not results.outputs:
        return "Outputs not compared: `requests.jsonl` is absent or holds no successful requests."
    pairs, mismatches, without_ids = 0, [], 0
    for (label, c, repeat, index), ids_a in sorted(results.outputs.items()):
        if label != a:
            continue
        key_b = (b, c, repeat, index)
        if key_b not in results.outputs:
            continue
        ids_b = results.outputs[key_b]
        if ids_a is None or ids_b is None:
            without_ids += 1
            continue
        pairs += 1
        if ids_a != ids_b:
            first = next(
                (i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b))
            )
            mismatches.append(
                f"c={c} repeat {repeat} request {index} (first difference at output token {first})"
            )
    if not pairs:
        return (
            "Outputs not compared: the servers reported no token ids"
            if without_ids
            else "Outputs not compared: no request succeeded on both sides."
        )
    if not mismatches:
        return (
            f"Outputs identical: {pairs}/{pairs} requests (the same token ids from "
            f"{results.name(a)} and {results.name(b)} for every request both completed)."
        )
    listed = "; ".join(mismatches[:MISMATCHES_LISTED])
    more = f"; and {len(mismatches) - MISMATCHES_LISTED} more" if len(mismatches) > MISMATCHES_LISTED else ""
    return (
        f"**Outputs differ**: {len(mismatches)} of {pairs} requests: {listed}{more} "
        f"(identical: {pairs - len(mismatches)}/{pairs})."
    )


def _acceptance(results: ResultSet, agg: pd.DataFrame) -> str | None:
    if "acceptance_length" not in agg.columns:
        return None
    sentences = []
    for label in results.labels:  # each side that has figures (DFlash against DFlash2: both)
        parts = []
        for c in results.concurrencies:
            value = _get(agg, label, c, "acceptance_length")
            if value is not None:
                parts.append(f"{fmt(value, 2)} at c={c}")
        if parts:
            sentences.append(
                f"Mean acceptance length of {results.name(label)} (bonus token included): "
                + ", ".join(parts)
                + "."
            )
    return " ".join(sentences) or None


def _prompt_sets(results: ResultSet) -> str | None:
    """Whether every concurrency measured the same number of requests (the harness sends the
    same prompts at every level unless --num-prompts depends on it)."""
    summary = results.summary
    if "completed" not in summary.columns or "failed" not in summary.columns:
        return None
    sent = (summary["completed"].fillna(0) + summary["failed"].fillna(0)).astype(int)
    per_level = {c: sorted(set(sent[summary["concurrency"] == c])) for c in results.concurrencies}
    counts = sorted({n for v in per_level.values() for n in v})
    if len(counts) == 1:
        return (
            f"Prompts: {counts[0]} requests at every concurrency (the harness sends the same "
            "prompts at every level when the count is the same)."
        )
    listed = ", ".join(f"c={c}: {'/'.join(map(str, v))}" for c, v in per_level.items())
    return (
        f"**Prompt sets differ between concurrencies** ({listed} requests): differences "
        "between concurrencies (acceptance above all) partly come from the different subsets."
    )


def _repeat_spread(results: ResultSet, agg: pd.DataFrame) -> str | None:
    """Repeats of one side and concurrency that disagree by more than REPEAT_SPREAD."""
    if "output_tokens_per_s_max" not in agg.columns:
        return None
    spread = (agg["output_tokens_per_s_max"] - agg["output_tokens_per_s_min"]) / agg["output_tokens_per_s"]
    wide = spread[(agg["n"] > 1) & (spread > REPEAT_SPREAD)].sort_values(ascending=False)
    if wide.empty:
        return None
    listed = ", ".join(f"{results.name(label)} at c={c}: {value:.0%}" for (label, c), value in wide.items())
    return (
        f"**Warning: repeats disagree.** The output throughput of repeats of one side and "
        f"concurrency spreads by more than {REPEAT_SPREAD:.0%} of its median ({listed}): the "
        "machine ran at different speeds during the benchmark, so its ratios are less certain "
        "than their intervals say. Measure again on an otherwise idle machine."
    )


def _load_reading(run) -> dict | None:
    """A machine_load entry's `before` reading ({"load": [1-, 5-, 15-minute], "cpus": n}),
    or None where the entry does not hold one in that shape (a hand-edited meta.json)."""
    before = run.get("before") if isinstance(run, dict) else None
    if not isinstance(before, dict):
        return None
    load, cpus = before.get("load"), before.get("cpus")
    numbers = isinstance(load, list) and load and all(isinstance(x, int | float) for x in load)
    return before if numbers and isinstance(cpus, int | float) else None


def _busy_machine(results: ResultSet) -> str | None:
    """Runs before which the 1-minute load average exceeded the CPU count (meta.json's
    `machine_load`): more runnable tasks than cores, so something, the benchmark's own
    client and server included, waited for a core."""
    busy = [
        (before["load"][0], run)
        for run in results.meta.get("machine_load") or []
        if (before := _load_reading(run)) and before["load"][0] > before["cpus"]
    ]
    if not busy:
        return None
    load, worst = max(busy, key=lambda item: item[0])
    runs = len(results.meta["machine_load"])
    named = all(k in worst for k in ("label", "concurrency", "repeat"))  # a hand-edited entry may not say
    where = (
        f", before {results.name(str(worst['label']))} c={worst['concurrency']} repeat {worst['repeat']}"
        if named
        else ""
    )
    return (
        f"**Warning: the machine was busy.** Before {len(busy)} of {runs} runs the 1-minute "
        f"load average was above the {worst['before']['cpus']} CPUs (highest {load:g}{where}): "
        "other work competed for the cores, and a busy machine can hide or invent a speed-up. "
        "Measure again on an otherwise idle machine."
    )


def _saturation(results: ResultSet) -> str | None:
    worst = None
    for (label, c), samples in sorted(results.itl.items()):
        gaps = samples.chunk_ms
        if gaps.size < 20:
            continue
        share = float(np.mean(gaps < SATURATED_GAP_MS))
        if share > SATURATED_SHARE and (worst is None or share > worst[0]):
            worst = (share, label, c)
    if worst is None:
        return None
    share, label, c = worst
    return (
        f"**Warning: the client may have been saturated.** {share:.0%} of the gaps between "
        f"token-bearing chunks of {results.display(label)} at concurrency {c} were under "
        f"{SATURATED_GAP_MS} ms: chunks queued up on the client and were read in bursts, "
        "so ITL, TTFT and E2E there measure the client as much as the server. Spread the "
        "client over more processes (--client-processes), run it on another machine, or "
        "use fewer concurrent streams."
    )


def _busy_client(results: ResultSet) -> str | None:
    """The busiest client process's share of a run spent on a core (summary's `client_cpu`,
    measured by the harness since it records it), when it was near a full core."""
    summary = results.summary
    if "client_cpu" not in summary:
        return None
    busy = pd.to_numeric(summary["client_cpu"], errors="coerce")
    if busy.isna().all() or busy.max() <= CLIENT_BUSY:
        return None
    row = summary.loc[busy.idxmax()]
    processes = row.get("client_processes")
    many = (
        ""
        if pd.isna(processes)
        else f" ({int(processes)} client process{'es' if int(processes) > 1 else ''})"
    )
    return (
        f"**Warning: the client was busy {busy.max():.0%} of a run** ({results.display(row['label'])} "
        f"at concurrency {int(row['concurrency'])}{many}): a client process near a full core "
        "adds its own queue to every TTFT and gap it times, and may set the throughput. Spread "
        "it over more processes (--client-processes) or run it on another machine."
    )


def _busy_server(results: ResultSet) -> str | None:
    """The server threads whose CPU share of a run (summary's `server_cpu`, the server's
    process, and `engine_cpu`, our engine loop's thread) passed CLIENT_BUSY: the busiest of
    each side and kind."""
    summary = results.summary
    found = []
    for column, what in (("server_cpu", "server process"), ("engine_cpu", "engine loop")):
        if column not in summary:
            continue
        busy = pd.to_numeric(summary[column], errors="coerce")
        for label in results.labels:
            mine = busy[summary["label"] == label]
            if mine.isna().all() or mine.max() <= CLIENT_BUSY:
                continue
            row = summary.loc[mine.idxmax()]
            found.append(
                f"{results.display(label)}'s {what} {mine.max():.0%} (concurrency {int(row['concurrency'])})"
            )
    if not found:
        return None
    return (
        "**Note: the servers' host side was near a full core**: "
        + "; ".join(found)
        + ". A Python thread near a core sets the pace there, not the device: the ratio compares "
        "the two servers' host work as much as their decoding."
    )


def _contradicting_counters(results: ResultSet) -> str | None:
    """Runs whose acceptance counters contradict each other or the tokens streamed (summary's
    `acceptance_check`, harness/prometheus.py): the first of each label."""
    summary = results.summary
    if "acceptance_check" not in summary:
        return None
    found = []
    for label in results.labels:
        part = summary[summary["label"] == label]
        check = part["acceptance_check"]  # text, or a float column of NaN when every cell is empty
        bad = part[check.notna() & (check.astype(str).str.len() > 0)]
        if len(bad):
            row = bad.iloc[0]
            found.append(
                f"{results.display(label)} in {len(bad)} of {len(part)} runs (first at concurrency "
                f"{int(row['concurrency'])}, repeat {int(row['repeat'])}: {row['acceptance_check']})"
            )
    if not found:
        return None
    return (
        "**Warning: a server's acceptance counters contradict what they count**: "
        + "; ".join(found)
        + ". Its acceptance figures are not what its steps did: a counter counts twice, or other "
        "traffic reached the server during the runs."
    )


def _closed_loop_ttft(results: ResultSet, agg: pd.DataFrame) -> str | None:
    if len(results.labels) != 2:
        return None
    a, b = results.labels
    levels = [
        c
        for c in results.concurrencies
        if c > 1
        and (va := _get(agg, a, c, "ttft_ms_median")) is not None
        and (vb := _get(agg, b, c, "ttft_ms_median")) is not None
        and vb < va
    ]
    if not levels:
        return None
    return (
        f"**Note on TTFT at concurrency {', '.join(map(str, levels))}:** "
        f"{results.name(b)} shows a lower median TTFT there. The load is a closed loop (a "
        "fixed number of clients, each sending its next request when the last one ends), "
        "so TTFT includes the wait for a free slot, and a server whose requests last "
        "longer admits new ones at a different rhythm. A lower TTFT under this load is "
        "not by itself a win; compare throughput and E2E latency."
    )


def _get(agg: pd.DataFrame, label: str, c: int, column: str = "output_tokens_per_s") -> float | None:
    if column not in agg.columns or (label, c) not in agg.index:
        return None
    value = agg.loc[(label, c), column]
    return None if pd.isna(value) else float(value)
