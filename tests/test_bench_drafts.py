"""bench/drafts.py: `--draft-arch dflash,dflash2` measures both drafts of one random-shape
target interleaved in one run, sets the DFlash2 step against the DFlash step and reports the
share of the DFlash2 draft phase its convolution and selector take; a replayed draft says
they were not timed; argument errors exit with code 2."""

from __future__ import annotations

import contextlib
import csv
import io
from pathlib import Path

import pytest

from reference_engine import bench
from reference_engine.bench.drafts import draft_comparison, draft_parts, print_drafts


@pytest.fixture(scope="module")
def both_drafts(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, list[dict]]:
    """The smallest real shape with a draft of each architecture, one repeat on the CPU:
    (exit code, stdout, CSV rows)."""
    out = tmp_path_factory.mktemp("bench-drafts") / "bench.csv"
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = bench.main(
            [
                "--random-shape",
                "qwen3-small",
                "--draft-arch",
                "dflash,dflash2",
                "--oracle-acceptance",
                "3",
                "--concurrency",
                "1",
                "--repeats",
                "1",
                "--input-len",
                "8",
                "--output-len",
                "6",
                "--block-size",
                "4",
                "--device",
                "cpu",
                "--out",
                str(out),
            ]
        )
    with Path(out).open(newline="") as f:
        return code, buffer.getvalue(), list(csv.DictReader(f))


def test_both_drafts_run_in_one_benchmark_beside_plain(both_drafts) -> None:
    code, _, rows = both_drafts
    assert code == 0
    measured = [(r["mode"], r["draft"]) for r in rows]
    assert measured == [("plain", ""), ("dflash", "dflash"), ("dflash", "dflash2")]
    for row in rows[1:]:
        assert float(row["mean_acceptance_length"]) > 1
        assert float(row["ms_draft"]) > 0


def test_only_the_eager_dflash2_draft_times_its_convolution_and_selector(both_drafts) -> None:
    _, _, rows = both_drafts
    plain, dflash, dflash2 = rows
    for row in (plain, dflash):
        assert int(row["n_conv"]) == int(row["n_selector"]) == 0
    assert int(dflash2["n_conv"]) == int(dflash2["n_selector"]) == int(dflash2["n_draft"]) > 0
    assert 0 < float(dflash2["ms_conv"]) + float(dflash2["ms_selector"]) < float(dflash2["ms_draft"])


def test_the_dflash2_step_is_set_against_the_dflash_step_and_its_parts_printed(both_drafts) -> None:
    _, stdout, _ = both_drafts
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if "DFlash2 step / DFlash step" in line)
    numerics, concurrency, dflash_ms, dflash2_ms, step_ratio, draft_ratio = lines[header + 1].split(" | ")
    assert concurrency == "1"
    assert float(step_ratio) == pytest.approx(float(dflash2_ms) / float(dflash_ms), abs=0.01)
    assert float(draft_ratio) > 0
    header = next(i for i, line in enumerate(lines) if "selector % of draft" in line)
    cells = lines[header + 1].split(" | ")
    assert 0 < float(cells[2]) + float(cells[4]) < 100


def row(draft: str, ms_step: float, ms_draft: float, conv: float, selector: float, calls: int) -> dict:
    return {
        "mode": "dflash",
        "draft": draft,
        "numerics": "exact",
        "concurrency": 4,
        "ms_per_decode_step": ms_step,
        "ms_draft": ms_draft,
        "n_draft": 10,
        "ms_conv": conv,
        "n_conv": calls,
        "ms_selector": selector,
        "n_selector": calls,
    }


def test_the_comparison_divides_per_decode_step_and_per_draft_forward() -> None:
    rows = [row("dflash", 2.0, 10.0, 0.0, 0.0, 0), row("dflash2", 3.0, 15.0, 3.0, 6.0, 10)]
    (compared,) = draft_comparison(rows)
    assert (compared["step_ratio"], compared["draft_ratio"]) == (1.5, 1.5)
    (parts,) = draft_parts(rows)
    assert parts["timed"]
    assert (parts["conv_share"], parts["selector_share"]) == (0.2, 0.4)
    assert (parts["conv_ms"], parts["selector_ms"]) == (0.3, 0.6)


def test_a_replayed_dflash2_draft_has_its_parts_not_timed_and_no_comparison_without_dflash() -> None:
    rows = [row("dflash2", 3.0, 15.0, 0.0, 0.0, 0)]
    assert draft_comparison(rows) == []
    (parts,) = draft_parts(rows)
    assert not parts["timed"] and parts["conv_share"] is None and parts["selector_ms"] is None
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        print_drafts(rows)
    assert "not timed: the draft forward replayed as one CUDA graph" in buffer.getvalue()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--random-shape", "qwen3-small", "--draft-arch", "dflash,eagle"], "must be distinct values"),
        (["--random-shape", "qwen3-small", "--draft-arch", "dflash2,dflash2"], "must be distinct values"),
        (["--draft-arch", "dflash2"], "--draft-arch needs --random-shape"),
    ],
)
def test_draft_arch_errors_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_floor_tables_name_a_speculative_row_by_its_draft(capsys: pytest.CaptureFixture) -> None:
    """With both drafts in one run, the floor tables tell the DFlash2 row from the DFlash row."""
    from reference_engine.bench import print_floor

    base = {
        "numerics": "exact",
        "concurrency": 1,
        "ms_per_decode_step": 5.0,
        "floor_ms": 4.0,
        "floor_ms_min": 4.0,
        "floor_ms_max": 4.0,
        "over_floor": 1.25,
        "floor_cache_bytes": 10**6,
        "ms_prefill": 3.0,
        "floor_prefill_ms": 1.0,
        "prefill_over_floor": 3.0,
    }
    rows = [
        {**base, "mode": "plain", "draft": None},
        {**base, "mode": "dflash", "draft": "dflash"},
        {**base, "mode": "dflash", "draft": "dflash2"},
    ]
    print_floor(rows)
    labels = [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines() if "| exact |" in line]
    assert labels == ["plain", "dflash", "dflash2"] * 2
