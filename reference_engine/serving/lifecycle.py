"""The server's shutdown policy on top of uvicorn (what one connection may hold:
connections.py).

- Graceful shutdown: on SIGTERM (or SIGINT) the server stops admitting: it keeps listening,
  and every new request gets 503 (`/health` says "draining"), while the requests in flight
  run for up to `grace_s`; then it ends each one that is left with an error event and
  `[DONE]` (a 503 body when not streaming), closes the listening socket and exits. It exits
  as soon as nothing is in flight. No stream is cut mid-frame: uvicorn's own cancellation is
  only a backstop after the grace period. A second signal skips what is left of the grace.

`Lifecycle` is the one home of that policy's state: the engine loop (started and stopped
with the app), whether the server is draining, what /health reports, and what the deadline
does; `GracefulServer` only decides when.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn

from .async_engine import AsyncEngine, EngineTotals
from .protocol import ProtocolError

BACKSTOP_S = 5.0  # after the grace period, how long the error events get to be written


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains instead of cutting: `on_drain` is called at the first
    signal (stop admitting), `on_deadline` when the grace period is over with requests still
    in flight (end them); `idle()` says whether any is. uvicorn's own exit (closing the
    listening socket) comes only after that."""

    def __init__(
        self,
        config: uvicorn.Config,
        grace_s: float,
        on_drain: Callable[[], None],
        on_deadline: Callable[[], None],
        idle: Callable[[], bool],
    ) -> None:
        super().__init__(config)
        self.grace_s, self.on_drain, self.on_deadline, self.idle = grace_s, on_drain, on_deadline, idle
        self.draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining:  # a second signal: no more grace
            self.on_deadline()
            super().handle_exit(sig, frame)
            return
        self.draining = True
        self.on_drain()
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain(sig, frame)))

    async def _drain(self, sig: int, frame: FrameType | None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_s
        while not self.idle() and loop.time() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
        if not self.idle():
            self.on_deadline()
        super().handle_exit(sig, frame)


class Lifecycle:
    """The server's life: the engine loop runs while the app does (`lifespan`); from the
    first signal it is draining (`admit` refuses new requests with 503, /health says so); at
    the end of the grace period the requests left end with ShuttingDown (`deadline`)."""

    def __init__(self, start_runner: Callable[[], AsyncEngine], grace_s: float) -> None:
        self.start_runner = start_runner
        self.grace_s = grace_s
        self.runner: AsyncEngine | None = None  # the engine's loop, from the app's startup
        self.draining = False

    @asynccontextmanager
    async def lifespan(self, app) -> AsyncIterator[None]:
        self.runner = self.start_runner()
        yield
        self.runner.shutdown()

    def admit(self) -> None:
        """Raise 503 for a new request once draining."""
        if self.draining:
            raise ProtocolError("the server is shutting down", None, 503, "service_unavailable")

    def health(self) -> tuple[dict, int]:
        """/health's body and status."""
        if self.draining:
            return {"status": "draining"}, 503
        if self.runner is None or not self.runner.alive:
            return {"status": "unhealthy", "reason": "the engine loop is not running"}, 503
        return {"status": "ok"}, 200

    def serve(self, config: uvicorn.Config) -> None:
        """Run uvicorn until a signal and the drain it starts are over."""
        GracefulServer(config, self.grace_s, self.drain, self.deadline, self.idle).run()

    def drain(self) -> None:
        self.draining = True

    def deadline(self) -> None:
        if self.runner is not None:
            self.runner.end_all(
                f"the server shut down before this request finished (--shutdown-grace {self.grace_s:g} s)"
            )

    def idle(self) -> bool:
        return self.runner is None or not self.runner.busy()

    def totals(self) -> EngineTotals:
        """The engine's latest totals (what /metrics shows of its gauges)."""
        return EngineTotals() if self.runner is None else self.runner.totals
