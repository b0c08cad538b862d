"""The engine in a process of its own (`--engine-loop process`, the default on a GPU).

On a thread the engine shares the interpreter lock with the event loop: while the loop turns
a step's outputs into SSE chunks, the engine's next call into PyTorch waits for the lock, and
the step rate is the sum of the two's work rather than the larger. In its own process the
engine steps while the HTTP side works.

`EngineProcess` starts the process (spawned: a CUDA context does not survive a fork) and waits
until its engine is built: it loads the checkpoints, sizes the state and captures the graphs
there, prints what it reserved, and answers `("ready", EngineInfo)`, or `("failed", message)`
for bad input (the server then exits with that one line, as it would on a thread). The
process runs an `EngineLoop` (async_engine.py) on its main thread. A reader thread puts the
commands that arrive on the pipe (add, abort, end all, stop) on the loop's queue, and the loop
sends each turn's events and totals back in one message (`turn_bytes`). The process's
interpreter switches threads every COMMAND_SWITCH_S rather than Python's default 5 ms: the
reader, woken by a command while the loop steps, waits that long for the lock, and a new
request waits for its reader before its next turn admits it. `ProcessEngine`, on the event loop,
reads the pipe when it is readable and hands each turn to `AsyncEngine.receive`.

The process ignores SIGINT and SIGTERM: a Ctrl-C in a terminal reaches the whole process group,
and the server drains its requests first (lifecycle.py) and then sends `stop`. A server that
dies closes the pipe, which stops the engine; an engine process that dies (a crash, the
kernel's OOM killer) closes it too: every request in flight then fails with 500, /health says
unhealthy, and new requests get 500.
"""

from __future__ import annotations

import asyncio
import copyreg
import io
import logging
import multiprocessing
import pickle
import signal
import sys
import threading
import time
from collections import ChainMap
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from ..errors import ReferenceEngineError
from ..runtime.outputs import StepOutput
from ..runtime.sequence import Sequence, sequence_from_state
from ..runtime.stats import RecentAcceptance, SpecCounters
from .async_engine import AsyncEngine, EngineLoop, EngineTotals, Event
from .engine_build import EngineInfo, build_engine

if TYPE_CHECKING:
    from .args import ServeArgs

log = logging.getLogger(__name__)

STOP_WAIT_S = 10.0  # how long a stopping server waits for the engine process to end
# how long the command reader waits for the interpreter lock while the loop steps, at most
COMMAND_SWITCH_S = 0.0005


class EngineProcess:
    """The engine's process, started and built (raises ReferenceEngineError when the engine
    cannot be built as asked, or the process ends before it is)."""

    def __init__(self, args: ServeArgs) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_end = context.Pipe()
        self.process = context.Process(
            target=run_engine_process, args=(args, child_end), name="engine", daemon=True
        )
        self.process.start()
        child_end.close()  # the child's end lives in the child: a dead child reads as EOF here
        try:
            kind, detail = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(STOP_WAIT_S)
            raise ReferenceEngineError(
                f"the engine process ended (exit code {self.process.exitcode}) before its "
                "engine was built; what it printed is above"
            ) from None
        if kind == "failed":
            self.process.join(STOP_WAIT_S)
            raise ReferenceEngineError(detail)
        self.info: EngineInfo = detail


class ProcessEngine(AsyncEngine):
    """The asyncio side of the engine process; made on the running event loop (the app's
    startup)."""

    def __init__(self, spawned: EngineProcess, on_step: Callable[[EngineTotals], None] | None = None) -> None:
        super().__init__(on_step)
        self.spawned, self.conn = spawned, spawned.conn
        self.loop = asyncio.get_running_loop()
        self.open = True
        self.loop.add_reader(self.conn.fileno(), self._readable)

    @property
    def alive(self) -> bool:
        return self.open and self.spawned.process.is_alive()

    def _send(self, command: tuple) -> None:
        if not self.open:
            return
        try:
            self.conn.send(command)
        except OSError:
            self._lost()

    def _readable(self) -> None:
        try:
            while self.open and self.conn.poll():
                kind, events, totals = self.conn.recv()
                if kind == "turn":
                    self.receive(turn_events(events), totals)
        except (EOFError, OSError):
            self._lost()

    def _lost(self) -> None:
        """The pipe closed: the engine process is gone."""
        if not self.open:
            return
        self.open = False
        self.loop.remove_reader(self.conn.fileno())
        self.spawned.process.join(1.0)
        log.critical("the engine process stopped (exit code %s)", self.spawned.process.exitcode)
        self.fail_everything("the engine process stopped")

    def shutdown(self, timeout: float = STOP_WAIT_S) -> None:
        """Abort everything in flight and end the process (killed if it does not end)."""
        process = self.spawned.process
        if self.open:
            self.open = False
            self.loop.remove_reader(self.conn.fileno())
            try:
                self.conn.send(("stop",))
                deadline = time.monotonic() + timeout
                while process.is_alive() and time.monotonic() < deadline:
                    if self.conn.poll(0.05):  # read what it sends as it stops: it must not block
                        self.conn.recv()
            except (EOFError, OSError):
                pass
        process.join(timeout)
        if process.is_alive():
            log.error("the engine process did not stop within %g s: killed", timeout)
            process.kill()
            process.join(timeout)
        self.conn.close()


def run_engine_process(args: ServeArgs, conn: Connection) -> None:
    """The engine process's body: build the engine, say so, run its loop until `stop`."""
    sys.setswitchinterval(COMMAND_SWITCH_S)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains first, then says stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        stream=sys.stderr, level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        engine, _, make_oracle = build_engine(args)
    except ReferenceEngineError as exc:
        conn.send(("failed", str(exc)))
        return
    conn.send(("ready", EngineInfo.of(engine)))
    engine_loop: EngineLoop

    def deliver(events: list[Event], totals: EngineTotals | None) -> None:
        try:
            conn.send_bytes(turn_bytes(events, totals))
        except OSError:  # the server is gone
            engine_loop.put(("stop",))

    engine_loop = EngineLoop(engine, deliver, make_oracle)

    def read() -> None:
        while True:
            try:
                command = conn.recv()
            except (EOFError, OSError):  # the server is gone
                command = ("stop",)
            engine_loop.put(command)
            if command[0] == "stop":
                return

    threading.Thread(target=read, name="commands", daemon=True).start()
    engine_loop.run()
    conn.close()


def turn_bytes(events: list[Event], totals: EngineTotals | None) -> bytes:
    """A turn's message as the server's `Connection.recv` reads it (`turn_events` gives its
    events back), pickled by `pickle` itself: `Connection.send` pickles through
    multiprocessing's ForkingPickler, which copies its table of reducers (torch adds about
    eighty) for every message, and a turn carries no tensor, pipe or file that needs them.
    A step output crosses as a plain tuple of its fields (a dataclass pickles and loads
    through Python calls: at 16 rows a turn's outputs took 22 us to pickle as objects and 4
    as tuples on the 2-core CPU), and a sequence as `_sequence_state` keeps it."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _ACROSS
    pickler.dump(("turn", [_portable(event) for event in events], totals))
    return buffer.getvalue()


def turn_events(events: list[Event]) -> list[Event]:
    """A turn's events as the engine loop made them, from what `turn_bytes` sent."""
    return [("out", StepOutput(*event[1:])) if event[0] == "out" else event for event in events]


def _portable(event: Event) -> Event:
    """An event as it crosses to the server: a step output's fields as a tuple."""
    if event[0] == "out":
        out = event[1]
        return (
            "out",
            out.request_id,
            out.new_token_ids,
            out.finished,
            out.finish_reason,
            out.time_s,
            out.new_logprobs,
            out.error,
        )
    return event


def _sequence_state(seq: Sequence) -> tuple:
    """How a request's sequence crosses to the server (at its end): without the engine's own
    generator (a CUDA generator unpickled on the server side would start a CUDA context there)
    and oracle, and without what only the engine reads: the verify width's recent counts and
    the cache of `spec`, which counts the step records again when read (counters pickle and
    load through Python calls). The engine's sequence keeps all of them."""
    _, (state,) = seq.__reduce__()  # a copy of its fields, its step records as tuples
    state.update(oracle=None, generator=None, recent=None, _spec=None)
    return (_arrived, (state,))


def _arrived(state: dict) -> Sequence:
    """A sequence sent by `_sequence_state`, with fresh counts where it left them behind."""
    state["recent"], state["_spec"] = RecentAcceptance(), SpecCounters()
    return sequence_from_state(state)


# what crosses differently, before copyreg's own table (a pickler given a table reads no other)
_ACROSS = ChainMap({Sequence: _sequence_state}, copyreg.dispatch_table)
