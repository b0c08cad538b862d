"""The engine on its own thread, for the server: the asyncio side submits and aborts
requests and reads each request's step outputs from an asyncio queue.

The Engine is not thread-safe, so every call into it happens on the engine thread: the
event loop posts commands to a queue that the thread drains between steps, and the thread
posts outputs back with `loop.call_soon_threadsafe`.

Every request ends with one `Finished` on its queue, carrying its sequence whenever the
engine still had it: finished by the engine, or aborted by the server (a stop string cut, a
client gone), so the per-request statistics cover every step the request took. `on_step`
runs after each step and before its outputs are posted, so a client that has its tokens
finds the step in the engine's counters.

The thread never dies of one request: a request the engine fails (see runtime/engine.py)
ends with an error on its own queue and the loop goes on; anything unexpected in a whole
step fails the requests in flight, not the thread. `alive` is what /health reports.

Under tensor parallelism the engine is rank 0's `LeadingEngine` (followers.py): the loop also
tells the follower ranks when it is idle and, at its end, to stop; a broken group ends it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ReferenceEngineError
from ..runtime.engine import Engine
from ..runtime.request import SamplingParams
from ..runtime.sequence import Sequence
from .followers import FollowersLost, LeadingEngine

log = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    """The engine failed this request (the others went on)."""


class ShuttingDown(RequestFailed):
    """The server stopped before this request finished (its shutdown grace period ran out)."""


@dataclass
class Finished:
    """The last item on a request's queue: the whole sequence (for usage and statistics)."""

    sequence: Sequence | None
    error: Exception | None = None


class AsyncEngine:
    def __init__(
        self,
        engine: Engine | LeadingEngine,
        on_step: Callable[[Engine], None] | None = None,
        make_oracle: Callable[[SamplingParams], object | None] | None = None,
    ) -> None:
        self.engine = engine
        self.leading = isinstance(engine, LeadingEngine)
        self.make_oracle = make_oracle  # benchmarks only: forced acceptance per request
        self.on_step = on_step  # called on the engine thread after every step (metrics)
        self.commands: queue.Queue = queue.Queue()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.running = True
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ asyncio side
    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        """Queue a request; raises its RequestError/EngineFullError here, in the caller."""
        if not self.alive:
            raise RequestFailed("the engine loop is not running")
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        done: asyncio.Future = loop.create_future()
        self.commands.put(("add", request_id, prompt_ids, params, loop, out, done))
        self.wake.set()
        await done  # raises the engine's error, if any
        return out

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))
        self.wake.set()

    @property
    def alive(self) -> bool:
        """The engine loop is running (what /health reports)."""
        return self.running and self.thread.is_alive()

    def end_all(self, reason: str) -> None:
        """End every request in flight with ShuttingDown(reason) (graceful shutdown's deadline)."""
        self.commands.put(("end_all", reason))
        self.wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the thread."""
        self.commands.put(("stop",))
        self.wake.set()
        self.thread.join(timeout)

    # ------------------------------------------------------------------ engine thread
    def _post(self, request_id: str, item: object) -> None:
        target = self.streams.get(request_id)
        if target is not None:
            loop, out = target
            loop.call_soon_threadsafe(out.put_nowait, item)

    def _finish(self, request_id: str, sequence: Sequence | None, error=None) -> None:
        self._post(request_id, Finished(sequence, error))
        self.streams.pop(request_id, None)

    def _fail(self, request_id: str, sequence: Sequence | None, reason: str) -> None:
        log.error("request %s failed: %s", request_id, reason)
        self._finish(request_id, sequence, RequestFailed(reason))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                _, request_id, prompt_ids, params, loop, out, done = command
                try:
                    oracle = self.make_oracle(params) if self.make_oracle is not None else None
                    self.engine.add_request(request_id, prompt_ids, params, oracle=oracle)
                except ReferenceEngineError as exc:
                    loop.call_soon_threadsafe(_set_exception, done, exc)
                    continue
                except Exception as exc:  # noqa: BLE001 - one request's, not the thread's
                    log.error("request %s could not be queued:\n%s", request_id, traceback.format_exc())
                    loop.call_soon_threadsafe(
                        _set_exception, done, RequestFailed(f"engine error: {type(exc).__name__}: {exc}")
                    )
                    continue
                self.streams[request_id] = (loop, out)
                loop.call_soon_threadsafe(_set_result, done, None)
            elif kind == "abort":
                request_id = command[1]
                sequence = self.engine.scheduler.known.get(request_id)
                if sequence is not None:  # else it finished already, and its Finished is out
                    self.engine.abort(request_id)
                self._finish(request_id, sequence)
            elif kind == "end_all":
                for request_id in list(self.engine.scheduler.known):
                    self.engine.abort(request_id)
                for request_id in list(self.streams):
                    self._finish(request_id, None, ShuttingDown(command[1]))
            elif kind == "stop":
                for request_id, sequence in list(self.engine.scheduler.known.items()):
                    self.engine.abort(request_id)
                    self._finish(request_id, sequence)
                self.running = False

    def _loop(self) -> None:
        try:
            while self.running:
                try:
                    self._turn()
                except FollowersLost:
                    raise  # no rank can step without the others
                except Exception as exc:  # noqa: BLE001 - an engine bug outside any one request
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
            if self.leading:
                self.engine.close()
        finally:
            if self.running:  # not a shutdown: the thread is dying; no stream may hang on it
                self.running = False
                log.critical("the engine loop stopped:\n%s", traceback.format_exc())
                self._fail_all("the engine loop stopped")
                while not self.commands.empty():  # requests still waiting to be queued
                    command = self.commands.get_nowait()
                    if command[0] == "add":
                        loop, done = command[4], command[6]
                        loop.call_soon_threadsafe(
                            _set_exception, done, RequestFailed("the engine loop stopped")
                        )

    def _fail_all(self, reason: str) -> None:
        for request_id in list(self.engine.scheduler.known):
            try:
                self.engine.abort(request_id)
            except ReferenceEngineError:
                pass
        for request_id in list(self.streams):
            self._fail(request_id, None, reason)

    def _turn(self) -> None:
        """Commands, then one engine step and its outputs."""
        self._drain_commands()
        if not self.running:
            return
        if not self.engine.has_unfinished():
            self.wake.wait(0.05)
            self.wake.clear()
            if self.leading:
                self.engine.idle()
            return
        outputs = self.engine.step()
        if self.on_step is not None:
            self.on_step(self.engine)
        for out in outputs:
            if out.error is None:
                self._post(out.request_id, out)
            if out.finished:
                sequence = self.engine.collect(out.request_id)
                if out.error is not None:
                    self._fail(out.request_id, sequence, out.error)
                else:
                    self._finish(out.request_id, sequence)


def _set_result(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: Exception) -> None:
    if not future.done():
        future.set_exception(exc)
