"""The server under tensor parallelism: rank 0 serves HTTP and drives its engine as at one
rank; every other rank (a follower) runs no server and repeats rank 0's engine calls.

Every rank must run the same steps on the same requests, or their collectives stop matching.
So rank 0's engine is a `LeadingEngine`: each call that changes which requests the engine
holds (a request added, one aborted) is applied at once and recorded, and before each step
the calls since the last one go to every follower in one object broadcast on the world group.
A follower (`follow`) applies them and steps too, and drops its outputs: rank 0 alone
answers. The stop marker at rank 0's shutdown ends the followers; they ignore SIGTERM and
SIGINT (torchrun passes a signal to every rank) so that rank 0 drains its requests first.

A sampled request draws from its own generator, seeded; a request without a seed gets one
drawn on rank 0 and sent with it, so every rank draws the same tokens (and every rank takes
rank 0's measured step costs when its engine is built, runtime/engine.py, so that they
choose the same verify widths).

While idle rank 0 sends a message at least every `HEARTBEAT_S`, so a follower's wait never
nears the group's timeout (10 minutes, `init_tensor_parallel`); a rank that dies closes its
connections, which fails the others' next collective (and torchrun stops the rest), and one
that hangs fails them after that timeout. A
failed broadcast ends rank 0's engine loop (`FollowersLost`): /health then says unhealthy.
"""

from __future__ import annotations

import logging
import secrets
import signal
import time
import traceback
from collections.abc import Callable

import torch.distributed as dist

from ..runtime.engine import Engine
from ..runtime.outputs import StepOutput
from ..runtime.request import SamplingParams, new_generator

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # the longest rank 0 stays silent while idle

Call = tuple  # ("add", request_id, prompt_ids, params, seed) or ("abort", request_id)
MakeOracle = Callable[[SamplingParams], object | None]


class FollowersLost(RuntimeError):
    """A broadcast to the followers failed: the group is broken and no step can run."""


class LeadingEngine:
    """Rank 0's engine: the Engine's surface, with its request calls recorded and sent to the
    followers before each step (`idle` sends a heartbeat, `close` the stop marker)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.calls: list[Call] = []
        self.sent_s = time.monotonic()

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, oracle: object | None = None
    ) -> None:
        seed = params.seed if params.seed is not None or params.greedy else secrets.randbits(63)
        _add(self.engine, request_id, prompt_ids, params, seed, oracle)
        self.calls.append(("add", request_id, list(prompt_ids), params, seed))

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self.calls.append(("abort", request_id))

    def step(self) -> list[StepOutput]:
        self._send("step")
        return self.engine.step()

    def idle(self) -> None:
        if self.calls or time.monotonic() - self.sent_s >= HEARTBEAT_S:
            self._send("idle")

    def close(self) -> None:
        self._send("stop")

    def _send(self, kind: str) -> None:
        message = [(kind, self.calls)]
        self.calls = []
        try:
            dist.broadcast_object_list(message, src=0)
        except Exception as exc:
            raise FollowersLost(f"the follower ranks are gone: {type(exc).__name__}: {exc}") from exc
        self.sent_s = time.monotonic()


def follow(engine: Engine, make_oracle: MakeOracle | None) -> None:
    """A follower's loop: rank 0's calls, then its step, until the stop marker."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # rank 0 decides when to stop, after its drain
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0)
        kind, calls = message[0]
        for call in calls:
            if call[0] == "add":
                _, request_id, prompt_ids, params, seed = call
                oracle = make_oracle(params) if make_oracle is not None else None
                _add(engine, request_id, prompt_ids, params, seed, oracle)
            elif call[1] in engine.scheduler.known:  # else it finished here already
                engine.abort(call[1])
        if kind == "stop":
            return
        if kind == "step":
            _step(engine)


def _add(
    engine: Engine,
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    seed: int | None,
    oracle: object | None,
) -> None:
    generator = None if params.greedy else new_generator(engine.device, seed)
    engine.add_request(request_id, prompt_ids, params, oracle=oracle, generator=generator)


def _step(engine: Engine) -> None:
    """One step, its finished requests forgotten. A failed step is rank 0's to handle: it
    fails the same requests and its aborts come with its next message."""
    try:
        outputs = engine.step()
    except Exception:  # noqa: BLE001 - rank 0 saw the same failure and fails the requests
        log.error("engine step failed on a follower rank:\n%s", traceback.format_exc())
        return
    for out in outputs:
        if out.finished:
            engine.collect(out.request_id)
