"""The report opens with its verdict (reports/verdict.py): which side is which, the speed-up
per concurrency with its interval in a sentence, whether A and B produced the same tokens
(from requests.jsonl), acceptance, and the warnings: client saturation, closed-loop TTFT,
prompt sets that differ between concurrencies, repeats that disagree, a busy machine."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from reports.markdown import build_report

from .test_reports import write_results


def set_token_ids(directory: Path, ids_of) -> None:
    """Give every request row token ids: ids_of(row) -> list[int]."""
    path = directory / "requests.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "token_ids": ids_of(r)}) + "\n" for r in rows))


def name_sides(directory: Path, a: str = "plain", b: str = "dflash") -> None:
    meta = json.loads((directory / "meta.json").read_text())
    (directory / "meta.json").write_text(json.dumps({**meta, "labels": {"A": a, "B": b}}))


def verdict(text: str) -> str:
    return text.split("## Verdict")[1].split("\n## ")[0]


def test_the_verdict_comes_first_and_names_the_sides_with_the_speedup(tmp_path) -> None:
    directory = write_results(tmp_path / "run")
    name_sides(directory)
    set_token_ids(directory, lambda r: [r["index"], 7, 8])
    text = build_report(directory).read_text()
    assert text.index("## Verdict") < text.index("## Run") < text.index("## Results by concurrency")
    part = verdict(text)
    assert "A is **plain**, B is **dflash**." in part
    assert (
        "Concurrency 1: dflash delivers 2.24x the output throughput of plain "
        "(95% interval 2.21–2.28): dflash is faster."
    ) in part
    assert "Concurrency 4: dflash delivers 2.12x" in part
    # B 4 repeat 1 request 0 failed: 2 concurrencies x 2 repeats x 3 requests - 1 = 11 pairs
    assert "Outputs identical: 11/11 requests" in part
    assert "Mean acceptance length of dflash (bonus token included): 3.62 at c=1, 3.62 at c=4." in part
    assert "| Metric | A = plain (n=2) | B = dflash (n=2) | B/A |" in text


def test_mismatched_outputs_are_counted_and_listed(tmp_path) -> None:
    directory = write_results(tmp_path / "run")
    set_token_ids(
        directory,
        lambda r: [1, 2, 3] if (r["label"], r["concurrency"], r["index"]) != ("B", 1, 2) else [1, 9, 3],
    )
    part = verdict(build_report(directory).read_text())
    assert "**Outputs differ**: 2 of 11 requests" in part
    assert "c=1 repeat 0 request 2 (first difference at output token 1)" in part
    assert "A and B are not named" in part


def edit_summary(directory: Path, change, name: str = "summary.csv") -> None:
    """Rewrite summary.csv (or another CSV of the folder) with change(row) applied to every row."""
    path = directory / name
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    changed = [change(dict(r)) or r for r in rows]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in changed for k in r)))
        writer.writeheader()
        writer.writerows(changed)


def sent(completed: int):
    def change(row: dict) -> dict:
        # the fixture's one failed request is part of the 8 sent, as the harness counts
        row["completed"] = str(completed - int(row["failed"]))
        return row

    return change


def test_prompt_sets_that_differ_between_concurrencies_are_flagged(tmp_path) -> None:
    same = write_results(tmp_path / "same")
    edit_summary(same, sent(8))
    part = verdict(build_report(same).read_text())
    assert "Prompts: 8 requests at every concurrency" in part
    assert "Prompt sets differ" not in part
    differ = write_results(tmp_path / "differ")
    edit_summary(differ, lambda row: sent(8 if row["concurrency"] == "1" else 16)(row))
    part = verdict(build_report(differ).read_text())
    assert "**Prompt sets differ between concurrencies** (c=1: 8, c=4: 16 requests)" in part


def test_a_starved_client_is_warned_about(tmp_path) -> None:
    directory = write_results(tmp_path / "run")
    calm = verdict(build_report(directory).read_text())
    assert "saturated" not in calm
    path = directory / "requests.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:  # chunks read in bursts: many gaps of 0.1 ms
        if r["label"] == "B" and r["concurrency"] == 4:
            r["chunk_times_s"] = [0.05 + 0.0001 * i for i in range(12)]
            r["chunk_tokens"] = [1] * 12
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    part = verdict(build_report(directory).read_text())
    assert "**Warning: the client may have been saturated.**" in part
    assert "B at concurrency 4 were under 0.5 ms" in part


def test_chunks_of_many_tokens_at_a_steady_pace_are_not_a_saturated_client(tmp_path) -> None:
    """Saturation reads the gaps between chunks as they arrived: a speculative server's chunks
    of 8 tokens 3 ms apart are a steady stream, though each token's share of a gap (0.375 ms)
    is under the 0.5 ms a burst read shows."""
    directory = write_results(tmp_path / "run")
    path = directory / "requests.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        if r["label"] == "B" and r["concurrency"] == 4:
            r["chunk_times_s"] = [0.05 + 0.003 * i for i in range(12)]
            r["chunk_tokens"] = [8] * 12
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "saturated" not in verdict(build_report(directory).read_text())


def test_a_lower_ttft_at_high_concurrency_carries_the_closed_loop_note(tmp_path) -> None:
    # the fixture's B has half A's TTFT at every concurrency
    part = verdict(build_report(write_results(tmp_path / "run")).read_text())
    assert "**Note on TTFT at concurrency 4:**" in part and "closed loop" in part


def test_repeats_that_disagree_by_more_than_a_tenth_are_warned_about(tmp_path) -> None:
    directory = write_results(tmp_path / "run")
    assert "repeats disagree" not in verdict(build_report(directory).read_text())

    def spread(row: dict) -> dict:  # A's two repeats at c=1: 100 and 140 tokens/s
        if (row["label"], row["concurrency"]) == ("A", "1"):
            row["output_tokens_per_s"] = "100" if row["repeat"] == "0" else "140"
        return row

    edit_summary(directory, spread)
    part = verdict(build_report(directory).read_text())
    assert "**Warning: repeats disagree.**" in part and "A at c=1: 33%" in part
    assert "B at c=" not in part.split("repeats disagree")[1].split("\n")[0]


def set_machine_load(directory: Path, loads: list[float], cpus: int = 2) -> None:
    meta = json.loads((directory / "meta.json").read_text())
    meta["machine_load"] = [
        {
            "label": "AB"[i % 2],
            "concurrency": 1,
            "repeat": i // 2,
            "before": {"load": [load, load, load], "cpus": cpus},
            "after": {"load": [load, load, load], "cpus": cpus},
        }
        for i, load in enumerate(loads)
    ]
    (directory / "meta.json").write_text(json.dumps(meta))


def test_a_machine_busy_with_other_work_is_warned_about(tmp_path) -> None:
    directory = write_results(tmp_path / "run")
    set_machine_load(directory, [0.4, 1.9, 1.2, 2.0])  # the benchmark's own client and server
    assert "machine was busy" not in verdict(build_report(directory).read_text())
    set_machine_load(directory, [0.4, 5.5, 3.1, 2.0])
    part = verdict(build_report(directory).read_text())
    assert "**Warning: the machine was busy.** Before 2 of 4 runs" in part
    assert "above the 2 CPUs (highest 5.5, before B c=1 repeat 0)" in part


def test_an_output_cut_short_on_one_side_is_a_mismatch(tmp_path) -> None:
    """A side whose output is a prefix of the other's (a truncated stream, a stop too early)
    did not produce the same tokens: the comparison covers the whole of both."""
    directory = write_results(tmp_path / "run")
    set_token_ids(
        directory,
        lambda r: [1, 2] if (r["label"], r["concurrency"], r["index"]) == ("B", 1, 2) else [1, 2, 3],
    )
    part = verdict(build_report(directory).read_text())
    assert "**Outputs differ**: 2 of 11 requests" in part
    assert "c=1 repeat 0 request 2 (first difference at output token 2)" in part


def test_a_ratio_whose_interval_holds_one_is_no_clear_difference(tmp_path) -> None:
    """The verdict reads `ab.csv`'s interval: a ratio above 1 whose 95% interval holds 1 is
    within noise, not "faster"."""
    directory = write_results(tmp_path / "run")
    name_sides(directory)

    def within_noise(row: dict) -> dict:
        if row["metric"] == "output_tokens_per_s":
            row.update(ratio="1.03", ci_low="0.97", ci_high="1.09", within_noise="True")
        return row

    edit_summary(directory, within_noise, "ab.csv")
    part = verdict(build_report(directory).read_text())
    assert (
        "Concurrency 1: dflash delivers 1.03x the output throughput of plain "
        "(95% interval 0.97–1.09): no clear difference, within run-to-run noise."
    ) in part
    assert "dflash is faster" not in part


def test_a_client_busy_near_a_full_core_is_warned_about(tmp_path) -> None:
    directory = write_results(tmp_path / "run")
    calm = verdict(build_report(directory).read_text())
    assert "client was busy" not in calm  # a summary without the column says nothing

    def busy(row: dict) -> dict:
        high = row["label"] == "B" and row["concurrency"] == "4"
        return {**row, "client_cpu": "0.93" if high else "0.4", "client_processes": "2" if high else "1"}

    edit_summary(directory, busy)
    part = verdict(build_report(directory).read_text())
    assert "**Warning: the client was busy 93% of a run** (B at concurrency 4 (2 client processes))" in part
    edit_summary(directory, lambda row: {**row, "client_cpu": "0.8"})
    assert "client was busy" not in verdict(build_report(directory).read_text())


def test_a_server_thread_near_a_full_core_is_noted(tmp_path) -> None:
    directory = write_results(tmp_path / "run")
    assert "host side" not in verdict(build_report(directory).read_text())

    def busy(row: dict) -> dict:
        high = row["concurrency"] == "4"
        server = "0.93" if high and row["label"] == "A" else "0.5"
        engine = "0.97" if high and row["label"] == "B" else "0.6"
        return {**row, "server_cpu": server, "engine_cpu": engine}

    edit_summary(directory, busy)
    part = verdict(build_report(directory).read_text())
    assert "**Note: the servers' host side was near a full core**" in part
    assert "A's server process 93% (concurrency 4)" in part and "B's engine loop 97% (concurrency 4)" in part


def test_acceptance_counters_that_contradict_the_tokens_are_warned_about(tmp_path) -> None:
    directory = write_results(tmp_path / "run")
    assert "contradict" not in verdict(build_report(directory).read_text())

    def lying(row: dict) -> dict:
        high = row["concurrency"] == "4" and row["label"] == "B"
        return {**row, "acceptance_check": "57 accepted tokens of 56 drafted" if high else ""}

    edit_summary(directory, lying)
    part = verdict(build_report(directory).read_text())
    assert "**Warning: a server's acceptance counters contradict what they count**" in part
    assert "B in 2 of 4 runs (first at concurrency 4, repeat 0: 57 accepted tokens of 56 drafted)" in part


def test_without_ab_csv_the_speed_up_is_b_over_a_from_the_medians(tmp_path) -> None:
    directory = write_results(tmp_path / "run", ab=False)
    name_sides(directory)
    part = verdict(build_report(directory).read_text())
    # medians 102.5 (A) and 230.0 (B) tok/s at concurrency 1
    assert (
        "Concurrency 1: dflash delivers 2.24x the output throughput of plain "
        "(no interval: `ab.csv` absent): dflash is faster."
    ) in part


def test_an_unreadable_ratio_in_ab_csv_falls_back_to_the_medians(tmp_path) -> None:
    """A ratio cell that does not read as a number (a damaged or hand-edited `ab.csv`) is not
    printed as "n/ax ... slower": the verdict takes B over A from the medians, and says why
    there is no interval."""
    directory = write_results(tmp_path / "run")
    name_sides(directory)

    def garbled(row: dict) -> dict:
        if row["metric"] == "output_tokens_per_s" and row["concurrency"] == "1":
            row["ratio"] = "garbled"
        return row

    edit_summary(directory, garbled, "ab.csv")
    part = verdict(build_report(directory).read_text())
    assert "n/ax" not in part
    assert (
        "Concurrency 1: dflash delivers 2.24x the output throughput of plain "
        "(no interval: the ratio in `ab.csv` is unreadable): dflash is faster."
    ) in part
    assert "Concurrency 4: dflash delivers 2.12x" in part and "(95% interval" in part


def test_requests_without_token_ids_are_not_claimed_identical(tmp_path) -> None:
    """A server that reports no ids (plain OpenAI) leaves nothing to compare: the verdict says
    so, and no request without ids on either side counts as identical."""
    directory = write_results(tmp_path / "run")
    set_token_ids(directory, lambda r: None)
    part = verdict(build_report(directory).read_text())
    assert "Outputs not compared: the servers reported no token ids" in part
    assert "Outputs identical" not in part
    set_token_ids(directory, lambda r: None if r["label"] == "B" and r["index"] == 0 else [1, 2, 3])
    part = verdict(build_report(directory).read_text())
    # B's request 0 of each (concurrency, repeat) has no ids (one of them failed anyway)
    assert "Outputs identical: 8/8 requests" in part
