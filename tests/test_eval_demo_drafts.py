"""scripts/eval_demo_drafts.py: the acceptance of the shipped drafts on the demo target's
held-out prompts, through the recipe's own evaluation (short outputs here)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from reference_engine.demo import DEMO_DRAFT, DEMO_DRAFT2

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "eval_demo_drafts.py"


def load_script():
    spec = importlib.util.spec_from_file_location("eval_demo_drafts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_folder_that_is_no_draft_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    assert load_script().main([str(tmp_path), "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eval_demo_drafts.py: ") and err.count("\n") == 1 and str(tmp_path) in err


def test_both_shipped_drafts_are_measured_lossless_and_dflash2_accepts_more(tmp_path: Path, capsys) -> None:
    module = load_script()
    out = tmp_path / "acceptance.json"
    argv = [str(DEMO_DRAFT), str(DEMO_DRAFT2), "--block-sizes", "8", "--max-tokens", "24", "--out", str(out)]
    assert module.main(argv) == 0
    results = json.loads(out.read_text())["acceptance"]
    dflash, dflash2 = results[str(DEMO_DRAFT)]["8"], results[str(DEMO_DRAFT2)]["8"]
    assert dflash["mismatched_requests"] == dflash2["mismatched_requests"] == 0
    assert dflash2["mean_acceptance_length"] > dflash["mean_acceptance_length"] > 1.5
    assert "B=8: mean acceptance length" in capsys.readouterr().out
