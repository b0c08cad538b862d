"""Contracts of the engine beside the server's event loop and of what one request's client
reads from it: the engine loop's turns, commands and totals (serving/async_engine.py), the
engine process and its pipe to the server (serving/engine_process.py), and a request's step
outputs made into its events (serving/generation.py).

The loop runs a real tiny engine on the CPU where the engine's part matters, or the scripted
engine of test_serve_engine_loop.py where only its calls do; the pipe is a real
multiprocessing Pipe, and where the engine process itself matters it is a real one, spawned
on the CPU with a tiny checkpoint; a request's events are read by the real generation from
step outputs handed to the real asyncio side of the engine (test_serve_app.py's scripted
server)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.errors import ReferenceEngineError
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams
from reference_engine.serving import async_engine
from reference_engine.serving.args import ServeArgs
from reference_engine.serving.async_engine import (
    EngineLoop,
    EngineTotals,
    Finished,
    RequestFailed,
    ThreadEngine,
)
from reference_engine.serving.engine_process import EngineProcess, ProcessEngine
from reference_engine.serving.generation import Done, Tokens

from .test_serve_app import metrics_page, parsed_request, scripted_server, started
from .test_serve_engine_loop import ExitingProcess, ScriptedEngine, TokenAStepEngine, out
from .test_serve_metrics import value


@pytest.fixture(scope="module")
def engine_pair(tiny_pair):
    target_dir, draft_dir = tiny_pair("qwen3", block_size=4)
    target = load_target(target_dir, dtype=torch.float64)
    return target, load_draft(draft_dir, target)


def tokens(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def real_loop(engine_pair, **config) -> tuple[EngineLoop, list]:
    """An EngineLoop on a real tiny DFlash engine, and the list its deliveries (events,
    totals) are appended to."""
    target, draft = engine_pair
    engine = Engine(target, draft, EngineConfig(**{"max_num_seqs": 4, **config}))
    turns: list[tuple[list, EngineTotals | None]] = []
    return EngineLoop(engine, lambda events, totals: turns.append((events, totals)), None), turns


def turn_until_idle(loop: EngineLoop, limit: int = 200) -> None:
    for _ in range(limit):
        loop._turn()
        if not loop.engine.has_unfinished() and not loop.known:
            return
    raise AssertionError("the engine did not finish")


# ------------------------------------------------------------------ the totals
def test_the_totals_of_a_turn_carry_the_engines_reset_count_drafts_ahead_and_cache_use(engine_pair) -> None:
    """The totals delivered after a turn carry the engine's own count of statistics resets,
    its drafts queued ahead (every outcome, as `Engine.draft_ahead` names them) and the share
    of its KV cache the running requests hold, as the engine had them at that turn."""
    loop, turns = real_loop(engine_pair, max_num_seqs=2)
    engine = loop.engine
    engine.reset_stats()
    for i in range(3):
        loop.put(("add", f"r{i}", [5, 6, 7 + i], tokens(8)))
    loop._turn()
    first = turns[-1][1]
    assert first.stats_epoch == 1
    assert first.kv_cache_usage == engine.kv_cache_usage() == 1.0
    assert first.draft_ahead == engine.draft_ahead()
    assert set(first.draft_ahead) == {"queued", "used", "widened"}
    turn_until_idle(loop)
    last = turns[-1][1]
    assert last.kv_cache_usage == 0.0 and last.stats_epoch == 1
    assert last.draft_ahead == engine.draft_ahead()


def test_the_totals_say_their_phases_are_device_times_when_the_engines_timer_times_the_device() -> None:
    """`device_phases` is the engine's phase timer's own word: true for a timer that times
    the device (its phase names then begin with device_s_), after a step and when idle."""
    turns: list[EngineTotals | None] = []
    loop = EngineLoop(TokenAStepEngine(), lambda events, totals: turns.append(totals), None)
    loop.put(("add", "r", [1, 2], SamplingParams(max_tokens=1)))
    loop._turn()
    loop._turn()
    assert len(turns) == 2 and all(t.device_phases is True for t in turns)


def test_the_engine_cpu_time_is_that_of_the_thread_the_loop_turns_on() -> None:
    """`engine_cpu_s` is the CPU time of the thread that runs the loop, not of the whole
    process: another thread's work does not reach it."""
    turns: list[EngineTotals | None] = []
    loop = EngineLoop(TokenAStepEngine(), lambda events, totals: turns.append(totals), None)
    spent = time.thread_time()
    while time.thread_time() - spent < 0.3:  # this thread's CPU time, not the loop's
        pass
    loop.put(("add", "r", [1, 2], SamplingParams(max_tokens=1)))
    turning = threading.Thread(target=loop._turn)
    turning.start()
    turning.join(10)
    assert len(turns) == 1
    assert turns[0].engine_cpu_s < 0.2 < time.process_time()


def test_a_delivery_without_totals_leaves_the_last_totals_in_place() -> None:
    """The loop's last delivery, when it stops, carries no totals: the request's end still
    reaches its stream, while `totals` (what /metrics' gauges show) and `on_step` keep the
    turn before."""

    async def scenario() -> None:
        engine = ScriptedEngine()
        seen: list[int] = []
        engine.on_step = lambda totals: seen.append(totals.steps)
        submitted = asyncio.create_task(engine.submit("r", [1], SamplingParams()))
        await asyncio.sleep(0)
        engine.receive([("added", "r", None), out("r", [4])], EngineTotals(steps=2, running=1))
        stream = await asyncio.wait_for(submitted, 5)
        engine.receive([("end", "r", None, None)], None)
        assert stream.get_nowait().new_token_ids == [4]
        assert isinstance(stream.get_nowait(), Finished)
        assert engine.totals.steps == 2 and engine.totals.running == 1
        assert seen == [2]

    asyncio.run(scenario())


# ------------------------------------------------------------------ the loop
def test_a_step_that_raises_is_answered_in_a_delivery_of_its_own_and_the_loop_goes_on(engine_pair) -> None:
    """The requests a raising step failed get their ends in a delivery made right after the
    step, before any command posted meanwhile is applied; a request posted during that
    step is then taken and runs to its own end."""
    loop, turns = real_loop(engine_pair)
    step = loop.engine.step
    calls = 0

    def failing_once():
        nonlocal calls
        calls += 1
        if calls == 1:
            loop.put(("add", "c", [9, 8], tokens(2)))
            raise RuntimeError("broken step")
        return step()

    def deliver(events: list, totals: EngineTotals | None) -> None:
        turns.append((events, totals))
        if ("end", "c") in [e[:2] for e in events]:
            loop.put(("stop",))

    loop.engine.step = failing_once
    loop.deliver = deliver
    loop.put(("add", "a", [5, 6], tokens(4)))
    loop.put(("add", "b", [7, 8], tokens(4)))
    loop.run()
    failed = [events for events, _ in turns if any(e[0] == "end" and e[1] in "ab" for e in events)]
    assert len(failed) == 1
    named = [(e[0], e[1].request_id if e[0] == "out" else e[1]) for e in failed[0]]
    assert named[:2] == [("added", "a"), ("added", "b")]
    assert sorted(named[2:]) == [("end", "a"), ("end", "b")]
    ends = [e for events, _ in turns for e in events if e[0] == "end"]
    assert [e[1] for e in ends[2:]] == ["c"] and len(ends) == 3
    assert ends[2][3] is None and len(ends[2][2].output_ids) == 2


def test_an_idle_loop_sleeps_until_a_command_wakes_it(monkeypatch) -> None:
    """An idle loop waits for its next command without turning, however long its idle wait;
    a command posted to it wakes it at once, and it answers the request and ends it; then it
    waits again."""
    monkeypatch.setattr(async_engine, "IDLE_WAIT_S", 30.0)
    engine = TokenAStepEngine()
    looks: list[int] = []
    has_unfinished = engine.has_unfinished

    def counted() -> bool:
        looks.append(1)
        return has_unfinished()

    engine.has_unfinished = counted
    delivered: queue.Queue = queue.Queue()
    loop = EngineLoop(engine, lambda events, totals: delivered.put(events), None)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        time.sleep(0.1)  # the loop is waiting
        loop.put(("add", "r", [1, 2], SamplingParams(max_tokens=1)))
        events = delivered.get(timeout=5)
        assert [e[0] for e in events] == ["added", "out", "end"]
        assert delivered.get(timeout=5) == []  # the step's totals again, waited for
        time.sleep(0.1)
        before = len(looks)
        time.sleep(0.3)
        assert len(looks) - before <= 1
    finally:
        loop.put(("stop",))
        thread.join(5)
    assert not thread.is_alive()


def test_a_thread_engine_is_not_alive_once_its_loop_has_taken_its_stop() -> None:
    """Once the loop has taken its `stop` the engine is no longer alive, even while its
    thread is still handing over its last delivery, and a request submitted then fails at
    once rather than waiting for a loop that will not take it."""
    runner = ThreadEngine(TokenAStepEngine(length=10**9))  # runs until stopped
    handing_over, release = threading.Event(), threading.Event()
    deliver = runner.engine_loop.deliver

    def slow_last(events: list, totals: EngineTotals | None) -> None:
        if totals is None:  # the loop's last delivery
            handing_over.set()
            release.wait(10)
        deliver(events, totals)

    runner.engine_loop.deliver = slow_last

    async def scenario() -> None:
        stream = await asyncio.wait_for(runner.submit("r", [1], SamplingParams(max_tokens=10**9)), 5)
        await asyncio.wait_for(stream.get(), 5)
        runner.engine_loop.put(("stop",))
        assert await asyncio.to_thread(handing_over.wait, 5)
        try:
            assert runner.thread.is_alive() and not runner.alive
            with pytest.raises(RequestFailed):
                await asyncio.wait_for(runner.submit("late", [1], SamplingParams(max_tokens=1)), 2)
        finally:
            release.set()

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        runner.shutdown()
    assert not runner.thread.is_alive()


def test_an_engine_thread_goes_on_after_the_event_loop_that_started_it_closed(engine_pair) -> None:
    """The event loop that submitted a request closes while the request runs: the engine's
    thread drops the turns it can no longer hand over and goes on stepping the request, and
    a shutdown then stops it."""
    target, _ = engine_pair
    engine = Engine(target, None, EngineConfig(max_num_seqs=2))

    async def start() -> ThreadEngine:
        runner = ThreadEngine(engine)
        stream = await asyncio.wait_for(runner.submit("r", [5, 6, 7], tokens(3000)), 30)
        await asyncio.wait_for(stream.get(), 30)
        return runner

    runner = asyncio.run(start())
    try:
        steps = engine.steps
        deadline = time.monotonic() + 20
        while engine.steps < steps + 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.steps >= steps + 5
        assert runner.thread.is_alive() and runner.engine_loop.running and engine.has_unfinished()
    finally:
        runner.shutdown()
    assert not runner.thread.is_alive() and not engine.has_unfinished()


# ------------------------------------------------------------------ the engine process's pipe
def test_a_pipe_reset_by_the_engine_process_fails_the_request_without_an_error_in_the_event_loop() -> None:
    """The engine process ends with a command of the server's still unread (the server's read
    is reset by its peer rather than finding the pipe's end): the request waiting to be taken
    fails, the engine is not alive, and nothing reaches the event loop's exception
    handler."""

    async def scenario() -> None:
        errors: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))
        server_end, engine_end = multiprocessing.Pipe()
        engine = ProcessEngine(SimpleNamespace(conn=server_end, process=ExitingProcess()))
        try:
            submitted = asyncio.create_task(engine.submit("r", [1], tokens(4)))
            await asyncio.sleep(0)
            engine_end.close()
            with pytest.raises(RequestFailed):
                await asyncio.wait_for(submitted, 5)
            for _ in range(3):
                await asyncio.sleep(0)
            assert not engine.alive and not engine.busy()
            assert errors == []
        finally:
            engine.shutdown(timeout=0.1)

    asyncio.run(scenario())


def test_a_command_the_broken_pipe_refuses_marks_the_engine_lost_at_once() -> None:
    """A command the server cannot write (the engine process's end is closed) marks the
    engine lost in that same call: /health's `alive` is false before the event loop reads
    the pipe's end, and a request submitted then fails."""

    async def scenario() -> None:
        server_end, engine_end = multiprocessing.Pipe()
        engine = ProcessEngine(SimpleNamespace(conn=server_end, process=ExitingProcess()))
        try:
            engine_end.close()
            engine.abort("r")
            assert not engine.alive
            with pytest.raises(RequestFailed):
                await asyncio.wait_for(engine.submit("s", [1], tokens(4)), 5)
        finally:
            engine.shutdown(timeout=0.1)

    asyncio.run(scenario())


class DeadProcess(ExitingProcess):
    """An engine process that has died; the server has not read its pipe's end yet."""

    exitcode = -9

    def is_alive(self) -> bool:
        return False


def test_an_engine_process_that_died_is_not_alive_before_its_pipe_is_read() -> None:
    """/health's `alive` asks the engine process itself: one that died is not alive though
    the server has not yet read the end of its pipe, and a new request fails at once."""

    async def scenario() -> None:
        server_end, engine_end = multiprocessing.Pipe()
        engine = ProcessEngine(SimpleNamespace(conn=server_end, process=DeadProcess()))
        try:
            assert not engine.alive
            with pytest.raises(RequestFailed):
                await asyncio.wait_for(engine.submit("r", [1], tokens(4)), 5)
        finally:
            engine.shutdown(timeout=0.1)
            engine_end.close()

    asyncio.run(scenario())


# ------------------------------------------------------------------ the engine process itself
def process_args(tiny_checkpoint, *more: str) -> ServeArgs:
    return ServeArgs.parse(
        ["--model", str(tiny_checkpoint("qwen3")), "--device", "cpu", "--dtype", "float32"]
        + ["--engine-loop", "process", *more]
    )


def test_an_engine_process_ignores_signals_and_stops_cleanly_with_a_full_pipe(tiny_checkpoint) -> None:
    """The engine process ignores SIGINT and SIGTERM (the server drains first, then says
    stop): after both it still takes and runs requests. A shutdown with many requests in
    flight, whose ends (each with its long prompt) are more than the pipe holds, ends the
    process by its stop, exit code 0, not by a kill."""
    spawned = EngineProcess(process_args(tiny_checkpoint, "--max-num-seqs", "1", "--max-waiting", "200"))
    process = spawned.process
    try:
        os.kill(process.pid, signal.SIGINT)
        os.kill(process.pid, signal.SIGTERM)

        async def scenario() -> None:
            runner = ProcessEngine(spawned)
            try:
                stream = await asyncio.wait_for(runner.submit("short", [5, 6, 7], tokens(3)), 30)
                got = []
                while not isinstance(item := await asyncio.wait_for(stream.get(), 30), Finished):
                    got += item.new_token_ids
                assert item.error is None and item.sequence.output_ids == got and len(got) == 3
                prompt = [(11 * i) % 500 + 1 for i in range(2000)]
                await asyncio.wait_for(
                    asyncio.gather(*(runner.submit(f"long{i}", prompt, tokens(64)) for i in range(120))), 60
                )
                assert runner.alive
            finally:
                started_s = time.monotonic()
                runner.shutdown(timeout=15)
                assert time.monotonic() - started_s < 15

        asyncio.run(scenario())
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
        process.join(5)


def test_an_engine_process_whose_server_went_away_stops_by_itself(tiny_checkpoint) -> None:
    """The server's end of the pipe closes without a stop (the server died): the engine
    process stops on its own, exit code 0."""
    spawned = EngineProcess(process_args(tiny_checkpoint))
    process = spawned.process
    try:
        spawned.conn.close()
        process.join(15)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
        process.join(5)


def test_an_engine_process_killed_before_its_engine_is_built_fails_the_start(tiny_checkpoint) -> None:
    """An engine process that dies before it says ready (killed while it builds its engine)
    fails the server's start with ReferenceEngineError naming its exit code, rather than
    leaving the start waiting."""
    args = process_args(tiny_checkpoint)
    before = set(multiprocessing.active_children())
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            EngineProcess(args)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome.append(exc)

    starting = threading.Thread(target=start, daemon=True)
    starting.start()
    deadline = time.monotonic() + 10
    killed = []
    while not killed and time.monotonic() < deadline:
        killed = [p for p in multiprocessing.active_children() if p not in before and p.name == "engine"]
        time.sleep(0.01)
    assert killed
    for p in killed:
        p.kill()
    starting.join(30)
    try:
        assert outcome and isinstance(outcome[0], ReferenceEngineError), outcome
        assert "exit code -9" in str(outcome[0])
    finally:
        for p in killed:
            p.join(5)


# ------------------------------------------------------------------ a request's events
def test_a_requests_first_token_time_counts_from_its_arrival() -> None:
    """A request's time to first token and its end-to-end latency count from the arrival
    time it was started with, to the engine's commit times of its tokens."""

    async def scenario(server, engine) -> None:
        generation = await started(server, engine, parsed_request(), arrival_s=10.0)
        rid = generation.request_id
        engine.receive(
            [out(rid, [0, 1], None, 12.5), out(rid, [2], "length", 13.0), ("end", rid, None, None)],
            EngineTotals(),
        )
        events = [e async for e in generation.events()]
        generation.close()
        assert isinstance(events[-1], Done)

    engine = ScriptedEngine()
    server = scripted_server(engine)
    asyncio.run(scenario(server, engine))
    page = metrics_page(server)
    assert value(page, "dflash:time_to_first_token_seconds_sum") == 2.5
    assert value(page, "dflash:e2e_request_latency_seconds_sum") == 3.0


def test_every_step_output_waiting_when_the_stream_reads_makes_one_event() -> None:
    """The stream reads every step output waiting in the request's queue into one `Tokens`,
    the last included, though the request's end has not come yet; outputs that come later
    make the next one, and the end then `Done`."""

    async def scenario() -> None:
        engine = ScriptedEngine()
        server = scripted_server(engine)
        generation = await started(server, engine, parsed_request())
        rid = generation.request_id
        engine.receive(
            [out(rid, [0, 1], None, 1.0), out(rid, [2], None, 2.0), out(rid, [3], None, 3.0)], None
        )
        events = generation.events()
        first = await asyncio.wait_for(anext(events), 5)
        assert isinstance(first, Tokens) and first.ids == [0, 1, 2, 3] and first.finish_reason is None
        engine.receive([out(rid, [4], "length", 4.0), ("end", rid, None, None)], None)
        second = await asyncio.wait_for(anext(events), 5)
        assert isinstance(second, Tokens) and second.ids == [4] and second.finish_reason == "length"
        assert isinstance(await asyncio.wait_for(anext(events), 5), Done)
        generation.close()

    asyncio.run(scenario())
