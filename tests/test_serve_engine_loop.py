"""The engine beside the event loop (serving/async_engine.py, engine_process.py), in process
and without a model: the asyncio side (`AsyncEngine`) with the loop's turns handed to it by
the test, the loop (`EngineLoop`) turned by the test around a scripted engine, and the server's
end of the engine process's pipe. A client that leaves before its request is taken does not
break the turn that takes it; a request waiting to be taken keeps the server busy; a step's
totals are delivered again, waited for, once the engine is idle; a stop ends every request in
flight; a closed pipe fails the streams and refuses new requests; a request's sequence
crosses the pipe without the engine's generator and oracle."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import multiprocessing
import pickle
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from reference_engine.errors import RequestError
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.outputs import StepOutput
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.sequence import Sequence, StepRecord
from reference_engine.runtime.stats import SpecCounters
from reference_engine.serving.async_engine import (
    AsyncEngine,
    EngineLoop,
    EngineTotals,
    Finished,
    RequestFailed,
)
from reference_engine.serving.engine_process import ProcessEngine, turn_bytes, turn_events


class ScriptedEngine(AsyncEngine):
    """The asyncio side of an engine loop whose turns the test hands to `receive`; the
    commands posted to it are kept in `sent`."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple] = []
        self.running = True

    def _send(self, command: tuple) -> None:
        self.sent.append(command)

    @property
    def alive(self) -> bool:
        return self.running


def out(
    request_id: str, ids: list[int], finish_reason: str | None = None, time_s: float = 0.0, logprobs=None
):
    """A turn's ("out", StepOutput) event: `ids` committed at `time_s`, the last when
    `finish_reason` is given."""
    return ("out", StepOutput(request_id, ids, finish_reason is not None, finish_reason, time_s, logprobs))


# ------------------------------------------------------------------ the asyncio side
def test_a_request_whose_client_left_before_the_engine_took_it_is_aborted_and_the_turn_goes_on() -> None:
    """A client gone while its request waited to be queued (its submit cancelled): when the
    engine takes it, it is aborted at once, and the other events of that turn still reach
    their requests; a refused one alike."""

    async def scenario() -> None:
        engine = ScriptedEngine()
        params = SamplingParams()
        gone, refused_gone, kept = (
            asyncio.create_task(engine.submit(rid, [1], params)) for rid in ("gone", "refused", "kept")
        )
        await asyncio.sleep(0)
        gone.cancel()
        refused_gone.cancel()
        await asyncio.sleep(0)
        engine.receive(
            [("added", "gone", None), ("added", "refused", RequestError("no")), ("added", "kept", None)],
            EngineTotals(),
        )
        queue = await asyncio.wait_for(kept, 1)
        engine.receive([out("kept", [0, 1], "length"), ("end", "kept", None, None)], EngineTotals())
        assert queue.get_nowait().new_token_ids == [0, 1]
        assert isinstance(queue.get_nowait(), Finished)
        assert ("abort", "gone") in engine.sent and ("abort", "refused") not in engine.sent
        assert gone.cancelled() and refused_gone.cancelled()

    asyncio.run(scenario())


def test_a_request_waiting_to_be_taken_keeps_the_engine_busy_until_it_fails_with_the_loop() -> None:
    """`busy` (what a draining server waits on) counts a request posted but not yet taken as
    well as one streaming; when the loop is gone both fail, and nothing is left in flight."""

    async def scenario() -> None:
        engine = ScriptedEngine()
        streaming = asyncio.create_task(engine.submit("streaming", [1], SamplingParams()))
        await asyncio.sleep(0)
        engine.receive([("added", "streaming", None)], EngineTotals())
        queue = await streaming
        waiting = asyncio.create_task(engine.submit("waiting", [1], SamplingParams()))
        await asyncio.sleep(0)
        engine.receive([("end", "streaming", None, None)], EngineTotals())
        assert isinstance(queue.get_nowait(), Finished)
        assert engine.busy()  # only the request not yet taken is in flight
        engine.fail_everything("gone")
        with pytest.raises(RequestFailed, match="gone"):
            await waiting
        assert not engine.busy()

    asyncio.run(scenario())


# ------------------------------------------------------------------ the loop
class StepTimer:
    """A phase timer whose device time of the last step is known only when waited for."""

    cuda = True  # it times the device

    def as_dict(self, wait: bool = True) -> dict:
        return {"host_s_step": 1.0, "device_s_step": 2.0 if wait else 1.5}


class TokenAStepEngine:
    """Just what EngineLoop and EngineTotals read of an Engine: each request gets one token a
    step and finishes with its `length`-th."""

    def __init__(self, length: int = 1) -> None:
        self.length = length
        self.scheduler = SimpleNamespace(known={}, active=[], waiting=[], fallbacks={})
        self.stats_epoch, self.steps, self.verify_widths = 0, 0, Counter()
        self.spec_totals = SpecCounters()
        self.timer = StepTimer()
        self.device = SimpleNamespace(type="cuda")

    def add_request(self, request_id, prompt_ids, params, oracle=None) -> None:
        self.scheduler.known[request_id] = SimpleNamespace(request_id=request_id, output_ids=[])

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.known)

    def step(self) -> list[StepOutput]:
        self.steps += 1
        outputs = []
        for rid, seq in self.scheduler.known.items():
            seq.output_ids.append(7)
            done = len(seq.output_ids) == self.length
            outputs.append(StepOutput(rid, [7], done, "length" if done else None, 0.0))
        return outputs

    def collect(self, request_id: str):
        return self.scheduler.known.pop(request_id)

    def abort(self, request_id: str) -> None:
        self.scheduler.known.pop(request_id)

    def draft_ahead(self) -> dict[str, int]:
        return {}

    def kv_cache_usage(self) -> float:
        return 0.0


def test_an_idle_turn_after_a_step_delivers_the_totals_with_the_device_times_waited_for() -> None:
    """After a step the loop delivers the totals without waiting for the device (its last
    phases may still run); the next turn, with nothing left to run, delivers them again
    waited for, so the metrics get the step's whole device time, and an idle loop then
    delivers nothing more."""
    turns: list[tuple[list, EngineTotals | None]] = []
    loop = EngineLoop(TokenAStepEngine(), lambda events, totals: turns.append((events, totals)), None)
    loop.put(("add", "r", [1, 2], SamplingParams(max_tokens=1)))
    loop._turn()  # takes the request and steps it to its end
    assert [e[0] for e in turns[-1][0]] == ["added", "out", "end"]
    assert turns[-1][1].phases["device_s_step"] == 1.5
    loop._turn()  # idle
    assert len(turns) == 2 and turns[-1][0] == []
    assert turns[-1][1].phases["device_s_step"] == 2.0
    assert turns[-1][1].steps == 1
    loop.wake.set()
    loop._turn()
    assert len(turns) == 2


def test_a_stop_ends_every_request_in_flight_with_its_sequence() -> None:
    """`stop` (the server shutting down its engine) aborts the requests the engine still
    runs and ends each one's stream with its sequence, in the loop's last delivery."""
    turns: list[tuple[list, EngineTotals | None]] = []
    engine = TokenAStepEngine(length=100)
    loop = EngineLoop(engine, lambda events, totals: turns.append((events, totals)), None)
    for rid in ("a", "b"):
        loop.put(("add", rid, [1], SamplingParams(max_tokens=100)))
    loop._turn()
    sequences = dict(engine.scheduler.known)
    loop.put(("stop",))
    loop.run()
    events, totals = turns[-1]
    assert sorted(events, key=lambda e: e[1]) == [("end", rid, sequences[rid], None) for rid in ("a", "b")]
    assert totals is None and not engine.scheduler.known and not loop.running


# ------------------------------------------------------------------ the engine process's pipe
class ExitingProcess:
    """An engine process that has closed its pipe but has not exited yet."""

    exitcode = None

    def is_alive(self) -> bool:
        return True

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        pass


def test_an_engine_process_whose_pipe_closed_fails_its_streams_and_refuses_new_requests() -> None:
    """The pipe to the engine process closes (the process crashed, and may take a while to
    exit): the stream in flight ends with an error after what it already got, /health's
    `alive` is false at once, and a new request fails rather than waiting on a pipe that
    nobody reads."""

    async def scenario() -> None:
        server_end, engine_end = multiprocessing.Pipe()
        engine = ProcessEngine(SimpleNamespace(conn=server_end, process=ExitingProcess()))
        try:
            params = SamplingParams(max_tokens=8)
            submitted = asyncio.create_task(engine.submit("r", [1, 2], params))
            await asyncio.sleep(0)
            assert engine_end.recv() == ("add", "r", [1, 2], params)
            engine_end.send_bytes(turn_bytes([("added", "r", None), out("r", [5, 6])], EngineTotals(steps=1)))
            queue = await asyncio.wait_for(submitted, 5)
            engine_end.close()
            assert (await asyncio.wait_for(queue.get(), 5)).new_token_ids == [5, 6]
            last = await asyncio.wait_for(queue.get(), 5)
            assert isinstance(last, Finished) and isinstance(last.error, RequestFailed)
            assert engine.totals.steps == 1
            assert not engine.alive and not engine.busy()
            with pytest.raises(RequestFailed):
                await asyncio.wait_for(engine.submit("late", [1], params), 5)
        finally:
            engine.shutdown(timeout=0.1)

    asyncio.run(scenario())


def crossed(events: list, totals=None) -> tuple[list, object]:
    """`events` and `totals` as the server reads them from the engine process's pipe."""
    server_end, engine_end = multiprocessing.Pipe()
    try:
        engine_end.send_bytes(turn_bytes(events, totals))
        kind, got, got_totals = server_end.recv()
    finally:
        server_end.close()
        engine_end.close()
    assert kind == "turn"
    return turn_events(got), got_totals


def test_a_sequence_crosses_to_the_server_without_what_only_the_engine_reads() -> None:
    """A request's end carries its sequence from the engine process to the server: without
    the engine's own generator (a CUDA generator unpickled on the server side would start a
    CUDA context there), oracle and verify-width counts, with everything the replies and
    statistics read (its counters counted from its step records); the engine's sequence keeps
    all of it, and the other events cross as they are."""
    params = SamplingParams(max_tokens=8, seed=3)
    seq = Sequence("r", [1, 2], params, frozenset({7}), 0.5, True)
    seq.record_step(3, 1, 2, [5, 6, 4])
    seq.append([5, 6])
    seq.finish_reason, seq.fallback_reason, seq.first_token_s = "length", "low_acceptance", 1.0
    seq.generator = torch.Generator().manual_seed(3)
    seq.oracle = OracleProposer.for_mean_acceptance([5, 6], 2.0, 4, 10)
    assert seq.spec.steps == 1  # the engine's cache of the counters, filled
    added, end = ("added", "r", None), ("end", "r", seq, None)
    (got_added, got_end), _ = crossed([added, end])
    assert got_added == added
    assert got_end[:2] == ("end", "r") and got_end[3] is None
    got = got_end[2]
    assert got is not seq and got.generator is None and got.oracle is None
    assert got.recent.steps == 0 and not got.recent.accepted_per_position
    left = ("generator", "oracle", "recent", "_spec")
    kept = [f.name for f in dataclasses.fields(Sequence) if f.name not in left]
    assert all(getattr(got, name) == getattr(seq, name) for name in kept)
    assert all(type(r) is StepRecord for r in got.steps)
    assert got.spec.as_dict() == seq.spec.as_dict() and got.spec.steps == 1
    assert seq.generator is not None and seq.oracle is not None and seq.recent.steps == 1


def test_a_step_output_crosses_as_it_was_made() -> None:
    """A step output crosses the pipe as a tuple of its fields and is read back as the same
    StepOutput, every field (logprobs and an error included) in place."""
    outputs = [
        StepOutput("a", [5, 6], False, None, 12.5),
        StepOutput("b", [7], True, "stop", 13.0, [{7: -0.25, 3: -1.5}]),
        StepOutput("c", [], True, "error", 14.0, error="numerical failure"),
    ]
    events = [("out", o) for o in outputs]
    got, _ = crossed(events)
    assert got == events and all(type(e[1]) is StepOutput for e in got)


def test_a_sequence_with_step_records_pickles_back_equal_with_named_records() -> None:
    """A sequence pickles its step records as plain tuples and loads them back as StepRecords:
    the same sequence, every field and record equal (the recent acceptance by its counts, the
    counters' cache by what it counts), the records' fields read by name and the request's
    counters counted from them as before; a copy is the same too."""
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=20), frozenset({9}), 1.5, True)
    for proposed, accepted, drafted in ((7, 3, [4, 5, 6, 1, 1, 1, 1]), (7, 0, [8] * 7), (2, 2, [3, 3])):
        seq.record_step(proposed, accepted, min(accepted + 1, seq.remaining), drafted)
        seq.append(drafted[:accepted] + [0])
    seq.logprobs = [{4: -0.5}]
    seq.finish_reason, seq.first_token_s = "length", 2.0
    for got in (pickle.loads(pickle.dumps(seq)), copy.deepcopy(seq), copy.copy(seq)):
        assert got is not seq and all(
            getattr(got, f.name) == getattr(seq, f.name)
            for f in dataclasses.fields(Sequence)
            if f.name not in ("recent", "_spec")
        )
        assert all(type(r) is StepRecord for r in got.steps)
        assert [(r.proposed, r.accepted, r.acceptance_length, r.drafted) for r in got.steps] == [
            tuple(r) for r in seq.steps
        ]
        assert got.spec.as_dict() == seq.spec.as_dict() and got.spec.steps == 3
        assert got.recent.counts() == seq.recent.counts() and got.generated == seq.generated


def test_a_turn_crosses_the_pipe_as_the_server_reads_it() -> None:
    """`turn_bytes` (the engine process's message of a turn) is read by the server's end of
    the pipe as ("turn", events, totals), and `turn_events` gives the events back as the loop
    made them: a sequence's step records named, and the totals whole."""
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=8), frozenset(), 0.0, True)
    seq.record_step(3, 1, 2, [5, 6, 7])
    seq.append([5, 0])
    seq.generator = torch.Generator().manual_seed(3)
    totals = EngineTotals(steps=4, spec_totals=SpecCounters(steps=1, proposed=3, accepted=1))
    events = [("added", "q", None), out("r", [5, 0], "length"), ("end", "r", seq, None)]
    got, got_totals = crossed(events, totals)
    assert got_totals == totals and got[:2] == events[:2]
    ended = got[2][2]
    assert got[2][:2] == ("end", "r") and ended.generator is None and ended.output_ids == [5, 0]
    assert ended.steps == seq.steps and ended.steps[0].acceptance_length == 2


def test_the_totals_copy_the_engines_counts_as_they_were() -> None:
    """EngineTotals.of copies the engine's counts per length and position (as plain dicts,
    equal to the engine's Counters): a step counted after the copy does not reach it."""
    engine = TokenAStepEngine()
    engine.spec_totals.record(7, 2, 3)
    totals = EngineTotals.of(engine)
    engine.spec_totals.record(7, 5, 6)
    spec = totals.spec_totals
    assert spec.acceptance_lengths == {3: 1} and spec.accepted_per_position == {1: 1, 2: 1}
    assert spec.verified_per_position == {1: 1, 2: 1, 3: 1} and spec.mean_acceptance_length == 3.0
    assert pickle.loads(pickle.dumps(totals)) == totals


class Registered:
    """A value whose pickling copyreg decides."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_a_turn_pickles_what_copyreg_registers_as_registered() -> None:
    """A type registered with copyreg crosses the pipe through its registered reduction (the
    turn's own table comes first, copyreg's after it), as any other pickle would send it."""
    import copyreg

    copyreg.pickle(Registered, lambda r: (Registered, (r.value + 1,)))
    try:
        got, _ = crossed([("added", "r", Registered(3))])
    finally:
        copyreg.dispatch_table.pop(Registered, None)
    assert type(got[0][2]) is Registered and got[0][2].value == 4
