"""One request as its client sees it: submitted to the engine loop, then read as one
stream of events (`Generation.events`) from which both replies are made (replies.py), so a
streamed and a non-streamed reply to the same request cannot disagree.

The events, in order:
- `Tokens`: output text and ids that are settled (stop_strings.py), with their logprobs: one
  for the engine's step outputs that wait when the stream reads (one a step while the stream
  keeps up). The one that a stop string cuts carries finish_reason "stop" and aborts the
  request; the engine's tokens after it are dropped until the abort lands.
- then exactly one `Done` (the engine's sequence: usage and spec_decode) or `Failed` (the
  engine failed the request: 500; the server shut down before it finished: 503). A reply that
  a stop string ended gets `Done` whatever ends the request after it.

The request's metrics (metrics.py `RequestMetrics`) are fed here as each event is made: only
here is it known how the request ended for its client (a stop string cut, a client gone), and
each request ends exactly once. `close` ends it however its reply ended: a reply cut short
(the client went away) leaves it unfinished, so it is aborted and counted as "abort".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ReferenceEngineError
from ..runtime.engine import EngineFullError, StepOutput
from .async_engine import Finished, RequestFailed, ShuttingDown
from .metrics import FAILED, RequestMetrics
from .protocol import ParsedRequest, ProtocolError
from .stop_strings import StopStringText

if TYPE_CHECKING:
    from ..runtime.sequence import Sequence
    from .service import Server


@dataclass(frozen=True)
class Tokens:
    """Output the client gets now."""

    text: str
    ids: list[int]
    logprobs: list[dict[int, float]]  # one entry per id; empty when none were asked for
    finish_reason: str | None  # on the last: "stop" (a stop token or string) or "length"


@dataclass(frozen=True)
class Done:
    """The request ended without error: its sequence, whenever the engine still had it."""

    sequence: Sequence | None


@dataclass(frozen=True)
class Failed:
    """The request ended with an error, which is what the client gets (status 500 or 503)."""

    error: ProtocolError


Event = Tokens | Done | Failed


class Generation:
    """One request, from its submission (`start`) to its end; made by `start` only."""

    def __init__(
        self,
        server: Server,
        request_id: str,
        parsed: ParsedRequest,
        queue: asyncio.Queue,
        counted: RequestMetrics,
    ) -> None:
        self.server, self.request_id, self.parsed = server, request_id, parsed
        self.queue = queue  # from the engine loop: StepOutputs, then one Finished
        self.counted = counted
        self.text = StopStringText(server.detokenize, parsed.stop, server.skipped_ids)

    @classmethod
    async def start(cls, server: Server, parsed: ParsedRequest, arrival_s: float) -> Generation:
        """Submit the request that arrived at `arrival_s` (time.monotonic()); ProtocolError
        when the engine does not take it (429: the queue is full; 400: the engine refuses
        it; 500: the engine loop is down)."""
        request_id = server.new_request_id(parsed.chat)
        counted = server.metrics.request(len(parsed.prompt_ids), arrival_s)
        try:
            queue = await server.lifecycle.runner.submit(request_id, parsed.prompt_ids, parsed.params)
        except EngineFullError as exc:
            raise ProtocolError(str(exc), None, 429, "rate_limit_error") from None
        except ReferenceEngineError as exc:
            raise ProtocolError(str(exc)) from None
        except RequestFailed as exc:
            counted.finish(FAILED)
            raise ProtocolError(str(exc), None, 500, "server_error") from None
        return cls(server, request_id, parsed, queue, counted)

    async def events(self) -> AsyncIterator[Event]:
        """The request's events until its end (read once). The step outputs waiting when the
        stream reads its queue make one `Tokens` (a stream that fell behind the engine, its
        event loop busy with other requests, catches up in one chunk rather than one a step;
        the text and ids are those of one chunk a step, stop_strings.py)."""
        queue = self.queue
        while True:
            item = await queue.get()
            outs: list[StepOutput] = []
            while not isinstance(item, Finished):
                outs.append(item)
                if queue.empty():
                    break
                item = queue.get_nowait()
            if outs and not self.text.stopped:  # stopped: drop what comes until the abort lands
                yield self._tokens(outs)
            if isinstance(item, Finished):
                self.counted.finish(_ended(item))
                # a reply a stop string ended is whole: an error that reached the request
                # before its abort landed (the engine failing it, a shutdown) is not its client's
                yield Done(item.sequence) if self.text.stopped else _last(item)
                return

    def close(self) -> None:
        """Called however the reply ended; a client gone leaves the request unfinished."""
        if not self.counted.finished:
            self.server.lifecycle.runner.abort(self.request_id)
            self.counted.finish("abort")

    def _tokens(self, outs: list[StepOutput]) -> Tokens:
        """The `Tokens` of consecutive step outputs (only the last can be the request's
        final one); each step's tokens are counted as delivered at its own time."""
        last = outs[-1]
        new_ids = last.new_token_ids if len(outs) == 1 else [t for out in outs for t in out.new_token_ids]
        # a request the engine stopped ends in its stop token, whose text the client does not get
        text, ids = self.text.push(new_ids, last.finished, last.finish_reason == "stop")
        left = len(ids)  # fewer than new_ids where a stop string cut them
        for out in outs:
            count = min(len(out.new_token_ids), left)
            self.counted.delivered(count, out.time_s)
            left -= count
        logprobs = [entry for out in outs for entry in out.new_logprobs or ()][: len(ids)]
        finish = last.finish_reason
        if self.text.stopped:
            finish = "stop"
            self.counted.finish(finish)
            self.server.lifecycle.runner.abort(self.request_id)
        elif last.finished:
            self.counted.finish(finish)
        return Tokens(text, ids, logprobs, finish)


def _ended(item: Finished) -> str:
    """How a request ended that its events had not seen end (an error, or an abort: the
    server shut down)."""
    if item.error is not None and not isinstance(item.error, ShuttingDown):
        return FAILED
    return "abort"


def _last(item: Finished) -> Done | Failed:
    if isinstance(item.error, ShuttingDown):
        return Failed(ProtocolError(str(item.error), None, 503, "service_unavailable"))
    if item.error is not None:
        # the engine loop's reason is the client's message as it stands: the engine's own
        # failures say "engine error: ..." (runtime/outputs.py, async_engine.py), the loop's
        # end says what ended it ("the engine process stopped")
        return Failed(ProtocolError(str(item.error), None, 500, "server_error"))
    return Done(item.sequence)
