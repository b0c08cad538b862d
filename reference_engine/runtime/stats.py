"""Engine statistics: speculative counters per request and engine-wide, and a phase timer.

Definitions (docs/design.md): a step proposes the draft tokens it verifies (B-1, fewer in a
short final block or under a narrower verify width);
`accepted` counts draft tokens equal to the target's choices; the acceptance length of a
step is the tokens it committed, accepted + bonus, so mean acceptance length includes the
bonus token. accepted_per_position[k] counts steps whose draft token k+1 was accepted.
"""

from __future__ import annotations

import time
from collections import Counter, _count_elements  # Counter.update's counting loop (C)
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import ClassVar

import torch

from ..models.layers import Phase
from .profiling import NvtxRanges

PHASES = (
    "prefill",
    "draft",
    "verify",
    "accept",
    "commit",
    "sample",
    "schedule",
    "decode",
    "conv",
    "selector",
)
# phase -> the phases it runs inside. A step runs every other phase one after another, none
# inside another, so its time is theirs plus what runs outside every phase; a nested phase's
# time is already in its parent's. `conv` and `selector` are a DFlash2 draft's (eager only).
NESTED = {"sample": ("prefill", "decode"), "conv": ("draft",), "selector": ("draft",)}


@dataclass
class SpecCounters:
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    acceptance_lengths: Counter = field(default_factory=Counter)  # length -> steps
    accepted_per_position: Counter = field(default_factory=Counter)  # 1-based position -> steps
    # 1-based position -> steps that verified draft token k after accepting 1..k-1: the
    # denominators of the conditional acceptance rates the verify width reads (verify_width.py)
    verified_per_position: Counter = field(default_factory=Counter)
    scale: ClassVar[float] = 1.0  # every step's counts weigh 1 (RecentAcceptance's are scaled)

    def record(self, proposed: int, accepted: int, acceptance_length: int) -> None:
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted
        # dict.get rather than Counter's += : a key not counted yet would go through
        # Counter.__missing__ (Python code); the positions 1..k in one C loop, the one
        # Counter.update runs after its own Python checks (the engine counts every row of every
        # step here: at 16 rows, 0.6 of the time through update on the 2-core CPU)
        lengths = self.acceptance_lengths
        lengths[acceptance_length] = lengths.get(acceptance_length, 0) + 1
        _count_elements(self.accepted_per_position, _positions(accepted))
        _count_elements(self.verified_per_position, _positions(min(proposed, accepted + 1)))

    @property
    def mean_acceptance_length(self) -> float:
        """Committed tokens per step, bonus included (0 before any step)."""
        if not self.steps:
            return 0.0
        return sum(k * v for k, v in self.acceptance_lengths.items()) / self.steps

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_length_histogram": dict(sorted(self.acceptance_lengths.items())),
            "accepted_per_position": dict(sorted(self.accepted_per_position.items())),
        }


@cache
def _positions(k: int) -> range:
    """Positions 1..k (made once per k)."""
    return range(1, k + 1)


class RecentAcceptance:
    """A request's acceptance counts per position with its recent steps weighing more: each
    drafted step multiplies the counts before it by DECAY (kept as one growing scale that its
    own counts are added at, so a step touches only the positions it verified). What the verify
    width reads (verify_width.prefix_rates): a continuation's acceptance moves along it (on the
    demo pair a request's first 5 drafted steps commit 1.9 tokens a step and its 10th to 30th
    4.2-4.6), and counts of every step alike lag it; `SpecCounters` keep the plain counts."""

    DECAY = 0.6  # the weight of a step's counts, a step later
    RESCALE = 1e150  # counts and scale divided back to a scale of 1 past this

    __slots__ = ("accepted_per_position", "verified_per_position", "scale", "steps")

    def __init__(self) -> None:
        self.accepted_per_position: dict[int, float] = {}  # scaled weights, 1-based positions
        self.verified_per_position: dict[int, float] = {}
        self.scale = 1.0  # the weight of the latest step: counts / scale are the decayed counts
        self.steps = 0

    def record(self, proposed: int, accepted: int) -> None:
        self.steps += 1
        self.scale /= self.DECAY
        if self.scale > self.RESCALE:
            for counts in (self.accepted_per_position, self.verified_per_position):
                for k in counts:
                    counts[k] /= self.scale
            self.scale = 1.0
        s, accepted_at, verified_at = self.scale, self.accepted_per_position, self.verified_per_position
        for k in range(1, accepted + 1):
            accepted_at[k] = accepted_at.get(k, 0.0) + s
        for k in range(1, min(proposed, accepted + 1) + 1):
            verified_at[k] = verified_at.get(k, 0.0) + s

    def counts(self) -> tuple[dict[int, float], dict[int, float]]:
        """(accepted, verified) per position, decayed: a step's counts weigh DECAY^age."""
        return (
            {k: v / self.scale for k, v in self.accepted_per_position.items()},
            {k: v / self.scale for k, v in self.verified_per_position.items()},
        )


class PhaseTimer:
    """Wall time per phase with a monotonic clock; on CUDA also device time per phase from
    CUDA events (unless `device_times` is off), collected by `flush()` once they have
    completed: the timer never makes the host wait for the device (a step's last phase, the
    commit, runs on while the host prepares the next step). `as_dict()` waits for what is
    still pending. Each phase is also an NVTX range when profiling is on (profiling.NvtxRanges)."""

    def __init__(
        self, device: torch.device, ranges: NvtxRanges | None = None, device_times: bool = True
    ) -> None:
        # whether phases are timed on the device too (CUDA events); `device_times` False: on the
        # host alone, as off CUDA
        self.cuda = device.type == "cuda" and device_times
        # events record on the device's current stream, named by index: without one, each
        # record looks the current device up through CUDA availability checks (tens of us)
        self.device_index = None
        if self.cuda:
            self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.ranges = ranges or NvtxRanges()
        self.host_s: Counter = Counter()
        self.device_s: Counter = Counter()
        self.calls: Counter = Counter()
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._free: list[torch.cuda.Event] = []  # events whose times were read, for reuse
        # the stream events record on, looked up at a step's first phase and kept until the
        # step's flush: each lookup makes a new Stream object (a few us, twice a phase)
        self._stream: torch.cuda.Stream | None = None
        self._streams: set[int] = set()  # the streams the pending events were recorded on

    def phase(self, name: str, count: bool = True) -> _Phase:
        """Time the block as phase `name`; `count`: whether it counts as one more call (a
        part of a phase that runs in pieces does not, see `parts`). A plain object rather
        than a generator's context manager, and its CUDA events reused once read: a step
        enters up to eight phases, and each one's cost is host time the step waits for."""
        return _Phase(self, name, count)

    def _recorded(self) -> torch.cuda.Event:
        """An event recorded now on the current stream."""
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        if self._stream is None:
            self._stream = torch.cuda.current_stream(self.device_index)
            self._streams.add(self._stream.cuda_stream)
        event.record(self._stream)
        return event

    @contextmanager
    def parts(self) -> Iterator[Phase]:
        """Around one forward whose phases run in pieces (a DFlash2 draft's convolution runs
        around every sublayer of every layer): yields `part(name)`, a phase that does not
        count when entered, and counts each phase entered once when the forward ends, so that
        a part's calls are the forwards that ran it. Each piece is its own NVTX range."""
        ran: set[str] = set()

        def part(name: str):
            ran.add(name)
            return self.phase(name, count=False)

        try:
            yield part
        finally:
            self.calls.update(ran)

    def flush(self, wait: bool = False) -> None:
        """Collect the times of pending phases whose events have completed, in order (all of
        them, waiting, with `wait`). Called once per step; the step does not wait for it."""
        self._stream = None  # the next step looks its stream up again
        pending = self._pending
        if wait or len(self._streams) != 1:
            done = 0
            for _, _, end in pending:
                if not wait and not end.query():
                    break
                end.synchronize()
                done += 1
        else:
            # every pending event on one stream (the usual case), where they complete in
            # order: the completed ones are a prefix, found from the end in a query or two
            # (the step's last phases still run) instead of one query and one wait each
            done = len(pending)
            while done and not pending[done - 1][2].query():
                done -= 1
        for name, start, end in pending[:done]:
            self.device_s[name] += start.elapsed_time(end) / 1000.0
            self._free += (start, end)
        del pending[:done]
        if not pending:
            self._streams.clear()

    def reset(self) -> None:
        """Forget every time and count so far (phases still pending are waited for first, so
        none of them lands in the next period)."""
        self.flush(wait=True)
        self.host_s.clear()
        self.device_s.clear()
        self.calls.clear()

    def as_dict(self, wait: bool = True) -> dict:
        """The totals so far; without `wait`, device times of phases still running are left
        for a later call (what a reader does after every step: no wait for the device)."""
        self.flush(wait=wait)
        out = {f"host_s_{k}": v for k, v in sorted(self.host_s.items())}
        out.update({f"device_s_{k}": v for k, v in sorted(self.device_s.items())})
        return out


class _Phase:
    """One phase of a PhaseTimer, entered once (`PhaseTimer.phase`)."""

    __slots__ = ("timer", "name", "count", "start", "t0", "range")

    def __init__(self, timer: PhaseTimer, name: str, count: bool) -> None:
        self.timer, self.name, self.count = timer, name, count

    def __enter__(self) -> None:
        timer = self.timer
        self.start = timer._recorded() if timer.cuda else None
        self.range = timer.ranges.range(self.name)
        self.range.__enter__()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        timer, name = self.timer, self.name
        try:
            self.range.__exit__(*exc)
        finally:
            timer.host_s[name] += time.perf_counter() - self.t0
            timer.calls[name] += self.count
            if timer.cuda:
                timer._pending.append((name, self.start, timer._recorded()))
