"""runtime/stats.py's phase timer: a phase run in pieces counts once per forward, and an
eager DFlash2 draft's convolution and selector are phases of their own, nested in `draft`
and counted once per draft forward (a DFlash draft has neither)."""

from __future__ import annotations

import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.stats import NESTED, PHASES, PhaseTimer


def run(tiny_pair, draft_arch: str) -> Engine:
    """Two greedy requests to completion on a tiny dense pair, eagerly (the CPU)."""
    target_dir, draft_dir = tiny_pair("qwen3", block_size=4, draft_arch=draft_arch)
    target = load_target(target_dir, dtype=torch.float64)
    engine = Engine(target, load_draft(draft_dir, target), EngineConfig(max_num_seqs=2))
    for name, prompt in (("a", [5, 6, 7]), ("b", [9, 10])):
        engine.add_request(name, prompt, SamplingParams(max_tokens=9, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return engine


def test_a_phase_run_in_pieces_counts_once_per_forward_and_sums_every_piece() -> None:
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(3):
        with timer.parts() as part:
            for _ in range(4):
                with part("conv"):
                    pass
            with part("selector"):
                pass
        with timer.parts():  # a forward that ran no part counts none
            pass
    assert timer.calls == {"conv": 3, "selector": 3}
    assert timer.host_s["conv"] > 0 and timer.host_s["selector"] > 0


def test_the_nested_phases_are_phases_and_run_inside_phases() -> None:
    assert set(NESTED) <= set(PHASES)
    assert all(set(parents) <= set(PHASES) - set(NESTED) for parents in NESTED.values())


def test_an_eager_dflash2_draft_times_conv_and_selector_once_per_draft_forward(tiny_pair) -> None:
    engine = run(tiny_pair, "dflash2")
    calls, phases = engine.timer.calls, engine.stats()["phases"]
    assert calls["draft"] >= 2  # 8 tokens after each prompt's first, at most 4 a step
    assert calls["conv"] == calls["selector"] == calls["draft"]
    nested = phases["host_s_conv"] + phases["host_s_selector"]
    assert 0 < nested < phases["host_s_draft"]


def test_a_dflash_draft_has_no_conv_or_selector_phase(tiny_pair) -> None:
    engine = run(tiny_pair, "dflash")
    assert engine.timer.calls["draft"] > 0
    assert engine.timer.calls["conv"] == engine.timer.calls["selector"] == 0
