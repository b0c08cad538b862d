"""End to end on the CPU: the A/B harness against two real reference servers (plain and
DFlash with forced acceptance), the same code as `make bench` with smaller settings."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from .server_process import REPO


@pytest.fixture(scope="module")
def ab_run(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair("qwen3_5", block_size=8)
    out = tmp_path_factory.mktemp("ab_out")
    serve = f"{sys.executable} -m reference_engine.serve --model {target}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            "ab",
            "--a-cmd",
            f"{serve} --port {{port}}",
            "--b-cmd",
            f"{serve} --dflash-draft-model-path {draft} --oracle-acceptance 3.5 --port {{port}}",
            "--concurrency",
            "1,3",
            "--num-prompts",
            "6",
            "--output-len",
            "12",
            "--repeats",
            "2",
            "--builtin",
            "math",
            "--notes",
            "test run",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return out, done.stdout


def test_all_result_files_are_written(ab_run) -> None:
    out, stdout = ab_run
    for name in ("requests.jsonl", "summary.csv", "summary.json", "ab.csv", "meta.json", "report.md"):
        assert (out / name).is_file(), name
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert len(rows) == 2 * 2 * 2  # labels x concurrencies x repeats
    assert all(int(r["completed"]) == 6 and int(r["failed"]) == 0 for r in rows)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["notes"] == "test run"
    # what each server said of itself (GET /info): on the CPU the engine steps on a thread
    assert {side["engine_loop"] for side in meta["servers"].values()} == {"thread"}
    ratios = list(csv.DictReader((out / "ab.csv").open()))
    assert {r["metric"] for r in ratios} >= {"output_tokens_per_s", "ttft_ms_median"}
    assert "label | concurrency" in stdout


def test_meta_records_the_machine_load_before_and_after_every_run(ab_run) -> None:
    out, _ = ab_run
    loads = json.loads((out / "meta.json").read_text())["machine_load"]
    assert sorted((r["label"], r["concurrency"], r["repeat"]) for r in loads) == sorted(
        (label, c, repeat) for label in "AB" for c in (1, 3) for repeat in range(2)
    )
    for run in loads:
        for when in ("before", "after"):
            assert len(run[when]["load"]) == 3 and run[when]["cpus"] >= 1
    assert (out / "server-A.log").is_file() and (out / "server-B.log").is_file()


def test_acceptance_from_prometheus_equals_the_servers_own_statistics(ab_run) -> None:
    out, _ = ab_run
    requests = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    for row in csv.DictReader((out / "summary.csv").open()):
        if row["label"] != "B":
            assert row["acceptance_length"] == ""
            continue
        assert row["acceptance_source"] == "prometheus"
        mine = [
            r["spec_decode"]
            for r in requests
            if r["label"] == "B"
            and r["concurrency"] == int(row["concurrency"])
            and r["repeat"] == int(row["repeat"])
            and r["spec_decode"]
        ]
        steps = sum(s["steps"] for s in mine)
        accepted = sum(s["accepted"] for s in mine)
        # the counters were differenced around exactly these requests (warm-up excluded)
        assert float(row["acceptance_length"]) == pytest.approx(1 + accepted / steps)
        assert float(row["acceptance_rate"]) == pytest.approx(accepted / sum(s["proposed"] for s in mine))
        hist = json.loads(row["acceptance_histogram"])
        assert sum(hist.values()) == steps
        assert row["acceptance_check"] == ""  # our server's counters agree with what it streamed


def test_resume_refuses_a_folder_measured_with_other_servers_and_leaves_it_as_it_was(ab_run) -> None:
    """The A/B folder resumed by `bench` against another URL: its rows were measured with
    other servers, so nothing is measured, nothing is sent (the URL is dead on purpose) and
    no file changes; the saved identity names the servers by the commands that started them."""
    out, _ = ab_run
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}
    saved = json.loads((out / "bench_run.json").read_text())
    assert saved["command"] == "ab" and "--port {port}" in saved["a_cmd"] and saved["a_url"] is None
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            "bench",
            "--base-url",
            "http://127.0.0.1:9",
            "--label",
            "A",
            "--concurrency",
            "1,3",
            "--num-prompts",
            "6",
            "--repeats",
            "2",
            "--resume",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: resume_conflict: ") and "command was 'ab', now 'bench'" in last
    assert "Traceback" not in done.stderr
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}
    assert after == before


def test_the_ratio_is_b_over_a_with_an_interval_around_it_and_noise_read_from_it(tmp_path) -> None:
    """bootstrap_ratio: B's median over A's, and a 95% interval of resampled repeats that
    holds it; ratios(): `within_noise` when that interval holds 1, so a clear 2x gap is not
    noise and equal sides are."""
    from harness.ab import RATIO_METRICS, bootstrap_ratio, ratios

    point, low, high = bootstrap_ratio([100.0, 101.0, 99.0], [200.0, 202.0, 198.0])
    assert point == pytest.approx(2.0) and low <= point <= high and 1.9 < low and high < 2.1
    summaries = [
        {"label": label, "concurrency": c, **dict.fromkeys(RATIO_METRICS, value)}
        for c, (a, b) in {1: ((100, 101, 99), (200, 202, 198)), 4: ((100, 120, 80), (110, 90, 100))}.items()
        for label, values in (("A", a), ("B", b))
        for value in values
    ]
    rows = {
        r["concurrency"]: r
        for r in ratios(summaries, tmp_path / "ab.csv")
        if r["metric"] == "output_tokens_per_s"
    }
    assert rows[1]["ratio"] == pytest.approx(2.0) and rows[1]["within_noise"] is False
    assert rows[4]["ratio"] == pytest.approx(1.0) and rows[4]["within_noise"] is True
    assert (tmp_path / "ab.csv").is_file()


def test_the_ratio_interval_resamples_both_sides() -> None:
    """Either side's spread widens the interval alike: A noisy and B steady gives the mirror of
    B noisy and A steady, and neither is a point (an interval that resamples one side only
    claims a precision the other side's repeats do not have)."""
    from harness.ab import bootstrap_ratio

    noisy, steady = [80.0, 100.0, 120.0, 90.0, 110.0], [100.0] * 5
    _, low_a, high_a = bootstrap_ratio(noisy, steady, seed=3)
    _, low_b, high_b = bootstrap_ratio(steady, noisy, seed=3)
    assert low_a < 1.0 < high_a and low_b < 1.0 < high_b
    assert low_a == pytest.approx(1 / high_b) and high_a == pytest.approx(1 / low_b)


def test_a_repeat_without_a_figure_is_left_out_of_either_sides_median(tmp_path) -> None:
    """A repeat with no value of a metric (NaN: e.g. no TPOT when every request failed or
    produced one token) is left out of that metric's ratio on whichever side it is, not
    carried into the median."""
    from harness.ab import RATIO_METRICS, ratios

    nan = float("nan")
    values = {"A": (100.0, nan, 102.0, 101.0), "B": (nan, 200.0, 204.0, 202.0)}
    summaries = [
        {"label": label, "concurrency": 8, **dict.fromkeys(RATIO_METRICS, value)}
        for label, repeats in values.items()
        for value in repeats
    ]
    rows = [r for r in ratios(summaries, tmp_path / "ab.csv") if r["metric"] == "output_tokens_per_s"]
    assert len(rows) == 1
    assert rows[0]["a_median"] == 101.0 and rows[0]["b_median"] == 202.0
    assert rows[0]["ratio"] == pytest.approx(2.0)


def test_sides_whose_repeats_are_all_equal_are_within_noise(tmp_path) -> None:
    """Repeats that give one figure on both sides (a count, or a deterministic run) make an
    interval of exactly [1, 1]: it holds 1, so the sides do not differ, and no direction is
    read into a ratio of exactly 1."""
    from harness.ab import RATIO_METRICS, bootstrap_ratio, ratios

    assert bootstrap_ratio([50.0] * 3, [50.0] * 3) == (1.0, 1.0, 1.0)
    summaries = [
        {"label": label, "concurrency": 2, **dict.fromkeys(RATIO_METRICS, 50.0)}
        for label in ("A", "B")
        for _ in range(3)
    ]
    rows = ratios(summaries, tmp_path / "ab.csv")
    assert len(rows) == len(RATIO_METRICS)
    assert all(r["ratio"] == 1.0 and r["within_noise"] is True for r in rows), rows
