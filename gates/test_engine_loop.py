"""The engine beside the server's event loop (serving/async_engine.py, engine_process.py), on
a thread and in a process of its own: a request's outputs, its end and its sequence arrive
the same either way; the engine's totals of a step reach the metrics before the step's tokens
reach the request; an abort reaches the engine; an engine process that dies fails what was in
flight; an engine that cannot be built stops the server at start with one line."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.errors import ReferenceEngineError
from reference_engine.runtime.engine import Engine, EngineConfig, StepOutput
from reference_engine.runtime.request import SamplingParams
from reference_engine.serving.args import ServeArgs
from reference_engine.serving.async_engine import (
    AsyncEngine,
    EngineTotals,
    Finished,
    RequestFailed,
    ThreadEngine,
)
from reference_engine.serving.engine_build import engine_loop_mode
from reference_engine.serving.engine_process import EngineProcess, ProcessEngine
from tests.server_process import REPO

from .faults import planted

LONG = SamplingParams(max_tokens=4000, ignore_eos=True)

# the faults this module's tests plant and see caught (gates/test_planted_faults.py)
CATCHES = ("totals_a_turn_late", "dead_engine_leaves_streams")


@pytest.fixture(scope="module")
def pair_dirs(tiny_pair):
    return tiny_pair("qwen3", block_size=4)


def serve_args(pair_dirs, *more: str) -> ServeArgs:
    target, draft = pair_dirs
    return ServeArgs.parse(
        ["--model", str(target), "--dflash-draft-model-path", str(draft), "--dtype", "float64"]
        + ["--device", "cpu", *more]
    )


def runner_for(mode: str, pair_dirs, on_step) -> AsyncEngine:
    """A runner of `mode`, made on the running event loop (as the app's startup makes it)."""
    if mode == "process":
        return ProcessEngine(EngineProcess(serve_args(pair_dirs, "--engine-loop", "process")), on_step)
    target = load_target(pair_dirs[0], dtype=torch.float64)
    return ThreadEngine(Engine(target, load_draft(pair_dirs[1], target), EngineConfig()), on_step)


async def ended(stream: asyncio.Queue, timeout: float = 30.0) -> Finished:
    """The request's Finished (what comes before it is dropped); TimeoutError if none comes."""
    async with asyncio.timeout(timeout):
        while not isinstance(item := await stream.get(), Finished):
            pass
    return item


def aborted_mid_stream(mode: str, pair_dirs) -> tuple[list[StepOutput], list[int], Finished, EngineTotals]:
    """A request read for three outputs, then aborted: its outputs, the speculative steps the
    metrics had been given once each of its outputs was delivered (taken as each turn is
    received: the loop may run turns ahead of the reader), its end, and the engine's last
    totals."""
    seen: list[int] = []
    counted: list[int] = []

    async def run():
        runner = runner_for(mode, pair_dirs, lambda totals: seen.append(totals.spec_totals.steps))
        receive = runner.receive

        def counting(events, totals) -> None:
            receive(events, totals)
            for event in events:
                if event[0] == "out" and event[1].request_id == "a":
                    counted.append(seen[-1] if seen else -1)

        runner.receive = counting
        try:
            stream = await runner.submit("a", [5, 6, 7], LONG)
            outputs = [await stream.get() for _ in range(3)]  # the first token, then two steps
            runner.abort("a")  # what the server does when a stop string ends the output
            return outputs, await ended(stream), runner.totals
        finally:
            runner.shutdown()

    outputs, finished, totals = asyncio.run(run())
    return outputs, counted, finished, totals


def counted_before_their_tokens(counted: list[int], finished: Finished) -> bool:
    """Each output came with its step already in the metrics: output i (the prompt's token,
    then one a speculative step) found at least i steps counted, the last all of them."""
    steps = finished.sequence.spec.steps
    return len(counted) == steps + 1 and all(c >= i for i, c in enumerate(counted)) and counted[-1] == steps


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_an_aborted_request_ends_with_its_sequence_and_each_step_is_counted_before_its_tokens(
    pair_dirs, mode: str
) -> None:
    outputs, counted, finished, totals = aborted_mid_stream(mode, pair_dirs)
    sequence = finished.sequence
    assert finished.error is None and sequence is not None and sequence.request_id == "a"
    assert counted_before_their_tokens(counted, finished), (counted, sequence.spec.steps)
    assert sequence.spec.steps >= 2 and sequence.spec.steps == totals.spec_totals.steps
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert sequence.output_ids[: len(tokens)] == tokens and len(tokens) == 1 + sum(
        r.acceptance_length for r in sequence.steps[:2]
    )


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_totals_applied_a_turn_late_fail_the_count_before_the_tokens(pair_dirs, mode: str) -> None:
    """The planted fault: each turn's totals reach the metrics with the next turn."""
    with planted("totals_a_turn_late"):
        _, counted, finished, _ = aborted_mid_stream(mode, pair_dirs)
    assert not counted_before_their_tokens(counted, finished), counted


def died_in_flight(pair_dirs) -> tuple[Finished | None, bool, Exception | None]:
    """A request in flight when its engine process is killed: its end (None when none came
    within 20 s), whether the runner still says alive, and what a new request raised."""

    async def run():
        runner = runner_for("process", pair_dirs, None)
        try:
            stream = await runner.submit("a", [5, 6, 7], LONG)
            await stream.get()
            runner.spawned.process.kill()
            try:
                finished = await ended(stream, 20.0)
            except TimeoutError:
                finished = None
            try:
                await runner.submit("b", [5], SamplingParams(max_tokens=2))
                refused = None
            except RequestFailed as exc:
                refused = exc
            return finished, runner.alive, refused
        finally:
            runner.shutdown()

    return asyncio.run(run())


def test_an_engine_process_that_dies_fails_what_was_in_flight_and_what_comes_after(pair_dirs) -> None:
    finished, alive, refused = died_in_flight(pair_dirs)
    assert finished is not None and isinstance(finished.error, RequestFailed), finished
    assert "engine process stopped" in str(finished.error)
    assert not alive and refused is not None


def test_a_dead_engine_that_leaves_its_streams_is_caught(pair_dirs) -> None:
    with planted("dead_engine_leaves_streams"):
        finished, alive, _ = died_in_flight(pair_dirs)
    assert finished is None and not alive


def test_an_engine_that_cannot_be_built_stops_the_server_at_start_with_one_line(pair_dirs) -> None:
    target = str(pair_dirs[0])
    with pytest.raises(ReferenceEngineError, match="--block-size needs --dflash-draft-model-path"):
        EngineProcess(ServeArgs.parse(["--model", target, "--block-size", "4", "--engine-loop", "process"]))
    run = subprocess.run(
        [sys.executable, "-m", "reference_engine.serve", "--model", target, "--engine-loop", "process"]
        + ["--device", "cpu", "--block-size", "4"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and run.stderr.startswith("error: "), (
        run.stderr
    )


def test_the_engine_loop_follows_the_device_and_the_ranks() -> None:
    def mode(*more: str) -> str:
        return engine_loop_mode(ServeArgs.parse(["--model", "m", "--device", "cpu", *more]))

    assert mode() == "thread" and mode("--engine-loop", "process") == "process"
    assert mode("--engine-loop", "thread") == "thread"
    with pytest.raises(ReferenceEngineError, match="--engine-loop thread"):
        mode("--engine-loop", "process", "--tensor-parallel-size", "2")
