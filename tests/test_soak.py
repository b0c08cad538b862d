"""The soak (reference_engine/bench/soak.py): arrivals, aborts and finishes on a DFlash engine,
every finished output checked against a plain engine's; it fails on a planted fault."""

from __future__ import annotations

import json
from pathlib import Path

from gates.faults import planted
from reference_engine.bench import soak


def soak_args(tiny_pair, tmp_path: Path, name: str) -> tuple[list[str], Path]:
    target, draft = tiny_pair("qwen3_5", block_size=8)
    out = tmp_path / f"{name}.json"
    args = ["--model", str(target), "--draft", str(draft), "--device", "cpu", "--dtype", "float64"]
    args += ["--concurrency", "4", "--requests", "12", "--max-tokens", "24", "--abort-share", "0.5"]
    return args + ["--prompt-len", "40", "--out", str(out)], out


def test_a_soak_passes_with_arrivals_aborts_and_every_output_checked(tiny_pair, tmp_path: Path) -> None:
    args, out = soak_args(tiny_pair, tmp_path, "soak")
    assert soak.main(args) == 0
    result = json.loads(out.read_text())
    assert result["errors"] == [] and result["mismatches"] == {}
    assert result["finished"] > 4 and result["aborted"] > 0
    assert result["arrived"] == result["finished"] + result["aborted"]
    assert len(result["batch_sizes"]) > 2  # the batch kept changing


def test_a_soak_fails_on_an_engine_that_breaks_output(tiny_pair, tmp_path: Path) -> None:
    args, out = soak_args(tiny_pair, tmp_path, "faulty")
    with planted("skip_state_rollback"):
        assert soak.main(args) == 1
    result = json.loads(out.read_text())
    assert result["mismatches"] and result["errors"] == []
