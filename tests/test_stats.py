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


class _FakeEvent:
    """A CUDA event's part that PhaseTimer.flush uses: done or not, and elapsed times that
    only a completed pair may give."""

    def __init__(self, t: float, done: bool) -> None:
        self.t, self.done, self.queries, self.waits = t, done, 0, 0

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.done and end.done, "a time read from an event that has not completed"
        return end.t - self.t


def _pending_phases(timer: PhaseTimer, done: int, streams: set[int]) -> list[_FakeEvent]:
    """Five phases a, b, c, d, e of 1, 2, 3, 4, 5 ms pending, the first `done` completed."""
    events = []
    for i, name in enumerate("abcde"):
        start, end = _FakeEvent(0.0, i < done), _FakeEvent(float(i + 1), i < done)
        timer._pending.append((name, start, end))
        events.append(end)
    timer._streams = set(streams)
    return events


def test_the_phase_timer_collects_the_completed_phases_of_one_stream_from_the_end() -> None:
    """runtime/stats.PhaseTimer.flush: with every pending event on one stream, the completed
    phases are a prefix, found by querying from the end; they are collected in order and the
    rest stay pending, with no wait. Across streams each phase is queried in turn and the first
    not completed stops it. With `wait`, each is waited for."""
    timer = PhaseTimer(torch.device("cpu"))
    ends = _pending_phases(timer, 3, {7})
    timer.flush()
    assert dict(timer.device_s) == {"a": 0.001, "b": 0.002, "c": 0.003}
    assert [name for name, _, _ in timer._pending] == ["d", "e"]
    assert sum(e.queries for e in ends) == 3 and not any(e.waits for e in ends)  # e, d, c
    assert timer._streams == {7}  # still pending on it

    ends[3].done = ends[4].done = True
    for _, start, _ in timer._pending:
        start.done = True
    timer.flush()
    assert timer.device_s["e"] == 0.005 and not timer._pending and not timer._streams

    timer = PhaseTimer(torch.device("cpu"))
    ends = _pending_phases(timer, 5, {7, 8})
    ends[1].done = False  # on another stream, b has not completed though c has
    for _, start, _ in timer._pending:
        start.done = True
    timer.flush()
    assert dict(timer.device_s) == {"a": 0.001} and len(timer._pending) == 4

    timer = PhaseTimer(torch.device("cpu"))
    ends = _pending_phases(timer, 0, {7})
    for _, start, _ in timer._pending:
        start.done = True
    timer.flush(wait=True)
    assert len(timer.device_s) == 5 and all(e.waits == 1 for e in ends) and not timer._pending


def test_nothing_is_collected_while_no_phase_of_the_one_stream_has_completed() -> None:
    """With every pending event on one stream and none completed, flush collects no phase
    (the first one included) and waits for none; once they complete, the next flush
    collects them all."""
    timer = PhaseTimer(torch.device("cpu"))
    ends = _pending_phases(timer, 0, {7})
    timer.flush()
    assert not timer.device_s and len(timer._pending) == 5 and not any(e.waits for e in ends)
    for _, start, end in timer._pending:
        start.done = end.done = True
    timer.flush()
    assert dict(timer.device_s) == {"a": 0.001, "b": 0.002, "c": 0.003, "d": 0.004, "e": 0.005}
    assert not timer._pending and not timer._streams


def test_the_totals_wait_for_pending_phases_unless_told_not_to() -> None:
    """PhaseTimer.as_dict: with wait=False (a reader after every step) it reports the device
    times of the phases that have completed and leaves the rest pending; by default it waits
    for every pending phase and reports all of them."""
    timer = PhaseTimer(torch.device("cpu"))
    ends = _pending_phases(timer, 2, {7})
    for _, start, _ in timer._pending:
        start.done = True
    assert timer.as_dict(wait=False) == {"device_s_a": 0.001, "device_s_b": 0.002}
    assert [name for name, _, _ in timer._pending] == ["c", "d", "e"]
    totals = timer.as_dict()
    assert totals == {f"device_s_{name}": (i + 1) / 1000 for i, name in enumerate("abcde")}
    assert [e.waits for e in ends] == [0, 0, 1, 1, 1] and not timer._pending


def test_a_timer_told_not_to_time_the_device_times_a_cuda_engines_phases_on_the_host_alone() -> None:
    """PhaseTimer(device_times=False) on a CUDA device (the server's default): no CUDA event is
    made or read (none could be on this machine), each phase's host time and calls are kept,
    and the totals hold host seconds only."""
    timer = PhaseTimer(torch.device("cuda"), device_times=False)
    for _ in range(2):
        with timer.phase("verify"):
            sum(range(1000))
        timer.flush()
    assert not timer.cuda and timer.calls == {"verify": 2} and timer.host_s["verify"] > 0
    assert list(timer.as_dict()) == ["host_s_verify"] and not timer._pending
