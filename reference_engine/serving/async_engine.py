"""The engine beside the event loop, for the server: the asyncio side submits and aborts
requests and reads each request's step outputs from an asyncio queue.

Two halves. `EngineLoop` runs the engine: it drains the commands posted to it (add, abort,
end all, stop) between steps, steps, and hands each turn's events (a request taken or refused,
its step outputs, its end) and the engine's totals after the turn to a `deliver` function in
one batch. `AsyncEngine` is the asyncio side: it posts the commands and turns each delivered
batch into the requests' queues, after handing the totals to `on_step` (the metrics), so a
client that has its tokens finds their step in the counters.

Where the loop runs is the runner's: `ThreadEngine` runs it on a thread of this process
(the Engine is not thread-safe, so every call into it happens on that thread), and
engine_process.py's `ProcessEngine` in a process of its own, where the engine does not share
the interpreter lock with the event loop. Both deliver the same events, in the same order.

Every request ends with one `Finished` on its queue, carrying its sequence whenever the
engine still had it: finished by the engine, or aborted by the server (a stop string cut, a
client gone), so the per-request statistics cover every step the request took.

The loop never dies of one request: a request the engine fails (see runtime/engine.py) ends
with an error on its own queue and the loop goes on; anything unexpected in a whole step fails
the requests in flight, not the loop. `alive` is what /health reports.

Under tensor parallelism the engine is rank 0's `LeadingEngine` (followers.py), on a thread:
the loop also tells the follower ranks when it is idle and, at its end, to stop; a broken group
ends it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..errors import ReferenceEngineError
from ..runtime.engine import Engine
from ..runtime.outputs import StepOutput
from ..runtime.request import SamplingParams
from ..runtime.sequence import Sequence
from ..runtime.stats import SpecCounters
from .followers import FollowersLost, LeadingEngine

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long an idle loop sleeps before it looks at its commands again


class RequestFailed(RuntimeError):
    """The engine failed this request (the others went on)."""


class ShuttingDown(RequestFailed):
    """The server stopped before this request finished (its shutdown grace period ran out)."""


@dataclass
class Finished:
    """The last item on a request's queue: the whole sequence (for usage and statistics)."""

    sequence: Sequence | None
    error: Exception | None = None


@dataclass
class EngineTotals:
    """What the server's metrics read of the engine after a turn: its running totals and its
    gauges, copied (they travel between processes, and the engine goes on changing its own)."""

    stats_epoch: int = 0  # Engine.reset_stats calls so far
    spec_totals: SpecCounters = field(default_factory=SpecCounters)
    verify_widths: dict[int, int] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # the phase timer's totals
    steps: int = 0  # engine steps that ran
    draft_ahead: dict[str, int] = field(default_factory=dict)  # Engine.draft_ahead()
    device_phases: bool = False  # whether `phases` holds device times (PhaseTimer.cuda)
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    engine_cpu_s: float = 0.0  # CPU seconds of the thread that runs the engine loop, so far

    @classmethod
    def of(cls, engine: Engine, settled: bool = True) -> EngineTotals:
        """The engine's totals now; without `settled`, device times of phases still running
        are left for a later call (after a step: the host does not wait for the device)."""
        spec = engine.spec_totals
        # the counts per length and position copied as plain dicts: they are only read (items,
        # get), and a Counter unpickles through Python code, every turn in the server's process
        return cls(
            engine.stats_epoch,
            replace(
                spec,
                acceptance_lengths=dict(spec.acceptance_lengths),
                accepted_per_position=dict(spec.accepted_per_position),
                verified_per_position=dict(spec.verified_per_position),
            ),
            dict(engine.verify_widths),
            dict(engine.scheduler.fallbacks),
            engine.timer.as_dict(wait=settled),
            engine.steps,
            engine.draft_ahead(),
            engine.timer.cuda,
            len(engine.scheduler.active),
            len(engine.scheduler.waiting),
            engine.kv_cache_usage(),
            time.thread_time(),  # called on the loop's thread (EngineLoop._flush)
        )


# A turn's events, in order: ("added", request_id, error or None), ("out", StepOutput),
# ("end", request_id, sequence or None, error or None).
Event = tuple
Deliver = Callable[[list[Event], EngineTotals | None], None]  # None: the engine is gone
MakeOracle = Callable[[SamplingParams], object | None]


class EngineLoop:
    """The engine's side: commands in (`put`), one batch of events and the totals out after
    each turn that did anything (`deliver`). `run` returns after a `stop` command."""

    def __init__(
        self, engine: Engine | LeadingEngine, deliver: Deliver, make_oracle: MakeOracle | None
    ) -> None:
        self.engine = engine
        self.leading = isinstance(engine, LeadingEngine)
        self.deliver = deliver
        self.make_oracle = make_oracle  # benchmarks only: forced acceptance per request
        self.commands: queue.Queue = queue.Queue()
        self.wake = threading.Event()
        self.running = True
        self.known: set[str] = set()  # requests taken and not yet ended
        self.events: list[Event] = []
        self.unsettled = False  # a step ran since the totals last waited for the device

    def put(self, command: tuple) -> None:
        self.commands.put(command)
        self.wake.set()

    def _end(self, request_id: str, sequence: Sequence | None, error: Exception | None = None) -> None:
        if request_id in self.known:
            self.known.discard(request_id)
            self.events.append(("end", request_id, sequence, error))

    def _fail(self, request_id: str, sequence: Sequence | None, reason: str) -> None:
        log.error("request %s failed: %s", request_id, reason)
        self._end(request_id, sequence, RequestFailed(reason))

    def _flush(self, settled: bool = True) -> None:
        events, self.events = self.events, []
        self.unsettled = not settled
        self.deliver(events, EngineTotals.of(self.engine, settled))

    def _drain_commands(self) -> bool:
        """Apply the commands waiting; whether there were any."""
        drained = False
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return drained
            drained = True
            kind = command[0]
            if kind == "add":
                _, request_id, prompt_ids, params = command
                try:
                    oracle = self.make_oracle(params) if self.make_oracle is not None else None
                    self.engine.add_request(request_id, prompt_ids, params, oracle=oracle)
                except ReferenceEngineError as exc:
                    self.events.append(("added", request_id, exc))
                    continue
                except Exception as exc:  # noqa: BLE001 - one request's, not the loop's
                    log.error("request %s could not be queued:\n%s", request_id, traceback.format_exc())
                    error = RequestFailed(f"engine error: {type(exc).__name__}: {exc}")
                    self.events.append(("added", request_id, error))
                    continue
                self.known.add(request_id)
                self.events.append(("added", request_id, None))
            elif kind == "abort":
                request_id = command[1]
                sequence = self.engine.scheduler.known.get(request_id)
                if sequence is not None:  # else it finished already, and its end is out
                    self.engine.abort(request_id)
                self._end(request_id, sequence)
            elif kind == "end_all":
                for request_id in list(self.engine.scheduler.known):
                    self.engine.abort(request_id)
                for request_id in list(self.known):
                    self._end(request_id, None, ShuttingDown(command[1]))
            elif kind == "stop":
                for request_id, sequence in list(self.engine.scheduler.known.items()):
                    self.engine.abort(request_id)
                    self._end(request_id, sequence)
                self.running = False

    def run(self) -> None:
        try:
            while self.running:
                try:
                    self._turn()
                except FollowersLost:
                    raise  # no rank can step without the others
                except Exception as exc:  # noqa: BLE001 - an engine bug outside any one request
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
                    self._flush()
            if self.leading:
                self.engine.close()
        finally:
            if self.running:  # not a stop: the loop is dying; no stream may hang on it
                self.running = False
                log.critical("the engine loop stopped:\n%s", traceback.format_exc())
                self._fail_all("the engine loop stopped")
                while not self.commands.empty():  # requests still waiting to be queued
                    command = self.commands.get_nowait()
                    if command[0] == "add":
                        self.events.append(("added", command[1], RequestFailed("the engine loop stopped")))
            if self.events:
                self.deliver(self.events, None)

    def _fail_all(self, reason: str) -> None:
        for request_id in list(self.engine.scheduler.known):
            try:
                self.engine.abort(request_id)
            except ReferenceEngineError:
                pass
        for request_id in list(self.known):
            self._fail(request_id, None, reason)

    def _turn(self) -> None:
        """Commands, then one engine step and its outputs, delivered together."""
        drained = self._drain_commands()
        if not self.running:
            return
        if not self.engine.has_unfinished():
            if drained or self.events or self.unsettled:
                self._flush()
            self.wake.wait(IDLE_WAIT_S)
            self.wake.clear()
            if self.leading:
                self.engine.idle()
            return
        outputs = self.engine.step()
        for out in outputs:
            if out.error is None and out.request_id in self.known:
                self.events.append(("out", out))
            if out.finished:
                sequence = self.engine.collect(out.request_id)
                if out.error is not None:
                    self._fail(out.request_id, sequence, out.error)
                else:
                    self._end(out.request_id, sequence)
        self._flush(settled=False)


class AsyncEngine:
    """The asyncio side of an EngineLoop wherever it runs (a subclass says where: `_send`
    posts a command, `alive` says whether the loop runs)."""

    def __init__(self, on_step: Callable[[EngineTotals], None] | None = None) -> None:
        self.on_step = on_step  # called on the event loop with each turn's totals (metrics)
        self.streams: dict[str, asyncio.Queue] = {}
        self.pending: dict[str, asyncio.Future] = {}
        self.totals = EngineTotals()  # the last delivered: what /metrics' gauges show

    def _send(self, command: tuple) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        """The engine loop is running (what /health reports)."""
        raise NotImplementedError

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        """Queue a request; raises its RequestError/EngineFullError here, in the caller."""
        if not self.alive:
            raise RequestFailed("the engine loop is not running")
        taken: asyncio.Future = asyncio.get_running_loop().create_future()
        self.pending[request_id] = taken
        self._send(("add", request_id, prompt_ids, params))
        return await taken  # the request's queue; raises the engine's error, if any

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def end_all(self, reason: str) -> None:
        """End every request in flight with ShuttingDown(reason) (graceful shutdown's deadline)."""
        self._send(("end_all", reason))

    def busy(self) -> bool:
        """Requests are in flight (taken or waiting to be)."""
        return bool(self.streams or self.pending)

    def receive(self, events: list[Event], totals: EngineTotals | None) -> None:
        """One turn of the loop, on the event loop: the totals first, then the events."""
        if totals is not None:
            self.totals = totals
            if self.on_step is not None:
                self.on_step(totals)
        for event in events:
            kind = event[0]
            if kind == "out":
                out: StepOutput = event[1]
                stream = self.streams.get(out.request_id)
                if stream is not None:
                    stream.put_nowait(out)
            elif kind == "end":
                stream = self.streams.pop(event[1], None)
                if stream is not None:
                    stream.put_nowait(Finished(event[2], event[3]))
            elif kind == "added":
                _, request_id, error = event
                taken = self.pending.pop(request_id, None)
                if error is None:
                    # the queue may hold the request's whole output and end before the
                    # submitter resumes: the submitter gets the queue itself
                    stream = self.streams[request_id] = asyncio.Queue()
                    if taken is None or taken.done():  # its client left while it was queued
                        self._send(("abort", request_id))
                    else:
                        taken.set_result(stream)
                elif taken is not None and not taken.done():
                    taken.set_exception(error)

    def fail_everything(self, reason: str) -> None:
        """The loop is gone: every request in flight or waiting to be taken fails."""
        for taken in self.pending.values():
            if not taken.done():
                taken.set_exception(RequestFailed(reason))
        self.pending.clear()
        for stream in self.streams.values():
            stream.put_nowait(Finished(None, RequestFailed(reason)))
        self.streams.clear()


class ThreadEngine(AsyncEngine):
    """The EngineLoop on a thread of this process (tensor parallelism's rank 0, the CPU)."""

    def __init__(
        self,
        engine: Engine | LeadingEngine,
        on_step: Callable[[EngineTotals], None] | None = None,
        make_oracle: MakeOracle | None = None,
    ) -> None:
        super().__init__(on_step)
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop of the first submit
        self.engine_loop = EngineLoop(engine, self._deliver, make_oracle)
        self.thread = threading.Thread(target=self.engine_loop.run, name="engine", daemon=True)
        self.thread.start()

    def _deliver(self, events: list[Event], totals: EngineTotals | None) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.receive, events, totals)

    def _send(self, command: tuple) -> None:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        self.engine_loop.put(command)

    @property
    def alive(self) -> bool:
        return self.engine_loop.running and self.thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the thread."""
        self.engine_loop.put(("stop",))
        self.thread.join(timeout)
