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
    # every finished request asked for 8 to 24 tokens and ignores EOS: its output is that long
    assert 8 * result["finished"] <= result["output_tokens"] <= 24 * result["finished"]
    assert result["output_tokens_per_s"] == result["output_tokens"] / result["seconds"]


def test_a_soak_fails_on_an_engine_that_breaks_output(tiny_pair, tmp_path: Path) -> None:
    args, out = soak_args(tiny_pair, tmp_path, "faulty")
    with planted("skip_state_rollback"):
        assert soak.main(args) == 1
    result = json.loads(out.read_text())
    assert result["mismatches"] and result["errors"] == []


def test_the_reference_decodes_each_distinct_prompt_once_for_its_longest_request(tiny_pair) -> None:
    """Requests of one prompt share one plain decode of the most tokens any of them asked
    for; each request's reference is its first n tokens, which equal a decode of n alone."""
    import torch

    from reference_engine.checkpoint import load_target
    from reference_engine.runtime.engine import Engine, EngineConfig
    from reference_engine.runtime.request import SamplingParams

    target_dir, _ = tiny_pair("qwen3_5", block_size=8)
    target = load_target(str(target_dir), dtype=torch.float64, device="cpu")
    engine = Engine(target, None, EngineConfig(max_num_seqs=4, max_model_len=64))
    added = []
    add = engine.add_request
    engine.add_request = lambda rid, *a, **k: added.append(rid) or add(rid, *a, **k)
    a, b = [5, 9, 2, 7], [3, 3, 8]
    finished = {"short": (a, 5, []), "long": (a, 12, []), "other": (b, 7, []), "again": (b, 7, [])}
    with torch.inference_mode():
        reference = soak.plain_reference(engine, finished)
        assert len(added) == 2
        alone = Engine(target, None, EngineConfig(max_num_seqs=1, max_model_len=64))
        alone.add_request("x", a, SamplingParams(max_tokens=5, ignore_eos=True))
        while alone.has_unfinished():
            alone.step()
    assert reference["short"] == reference["long"][:5] == alone.collect("x").output_ids
    assert len(reference["long"]) == 12 and reference["other"] == reference["again"]
