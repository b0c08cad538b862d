"""Contracts of the way a request's work travels back to its client: a step's small inputs on
their way to a device (runtime/transfer.py), a request's sequence and its step records
(runtime/sequence.py), a turn's message across the engine process's pipe
(serving/engine_process.py), the engine loop's events and totals (serving/async_engine.py), and
the replies made from a request's events (serving/generation.py, serving/replies.py).

The loop runs a real tiny engine on the CPU where the engine's part matters; the pipe is a real
multiprocessing Pipe; the replies are made by the real generators from step outputs handed to
the real asyncio side of the engine."""

from __future__ import annotations

import asyncio
import copy
import copyreg
import multiprocessing
import pickle
from types import SimpleNamespace

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.errors import RequestError
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.outputs import StepOutput
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.sequence import Sequence, StepRecord
from reference_engine.runtime.transfer import to_device, to_pinned
from reference_engine.serving.async_engine import (
    EngineLoop,
    EngineTotals,
    Finished,
    RequestFailed,
    ShuttingDown,
    ThreadEngine,
)
from reference_engine.serving.engine_process import ProcessEngine, turn_bytes, turn_events
from reference_engine.serving.protocol import ProtocolError
from reference_engine.serving.replies import respond

from .poison import POISON, poisoned
from .test_serve_app import (
    VOCAB,
    answered,
    metrics_page,
    parsed_request,
    scripted_server,
)
from .test_serve_engine_loop import ExitingProcess
from .test_serve_metrics import value


# ------------------------------------------------------------------ a step's inputs
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_a_step_input_lands_on_the_device_asked_for_off_cuda(dtype: torch.dtype) -> None:
    """Off CUDA, `to_device` gives a tensor on the device it was asked for (here PyTorch's
    `meta` device), by the int64 fast way and by `torch.tensor` alike, with the shape and
    dtype asked for."""
    t = to_device([[1, 2, 3], [4, 5, 6]], "meta", dtype)
    assert t.device.type == "meta" and t.dtype == dtype and t.shape == (2, 3)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float32, torch.bool])
def test_a_host_buffer_has_the_dtype_asked_for(dtype: torch.dtype) -> None:
    """`to_pinned` (the host buffer a captured graph's inputs are copied from) gives the
    values in the dtype asked for, as `torch.tensor` does, not the int64 of its fast way."""
    values = [[1, 0], [3, 4]]
    got = to_pinned(values, dtype)
    want = torch.tensor(values, dtype=dtype)
    assert got.dtype == dtype and got.shape == want.shape and torch.equal(got, want)


# ------------------------------------------------------------------ a sequence
def sequence(request_id: str = "r", steps: tuple = ((3, 1, 2, [5, 6, 4]),), max_tokens: int = 16) -> Sequence:
    """A speculative sequence with the given step records (proposed, accepted, committed,
    drafted), each step's committed tokens appended."""
    seq = Sequence(request_id, [1, 2], SamplingParams(max_tokens=max_tokens), frozenset(), 0.5, True)
    for proposed, accepted, committed, drafted in steps:
        seq.record_step(proposed, accepted, committed, drafted)
        seq.append(list(drafted[:accepted]) + [0] * (committed - accepted))
    return seq


def test_a_step_record_keeps_its_drafted_tokens_when_the_engine_reuses_its_list() -> None:
    """`record_step` keeps the drafted tokens as they were when the step was recorded (a
    tuple of their own): the engine's list changed afterwards does not reach the record."""
    seq = Sequence("r", [1], SamplingParams(max_tokens=8), frozenset(), 0.0, True)
    drafted = [5, 6, 7]
    seq.record_step(3, 1, 2, drafted)
    drafted[:] = [9, 9, 9]
    drafted.append(9)
    assert seq.steps == [StepRecord(3, 1, 2, (5, 6, 7))]
    assert type(seq.steps[0].drafted) is tuple


def test_pickling_a_sequence_leaves_the_sequence_itself_as_it_was() -> None:
    """Pickling a sequence (what crossing to another process does) changes nothing in it: its
    step records stay StepRecords, read by name, and its counters count them afterwards."""
    seq = sequence(steps=((3, 1, 2, [5, 6, 4]), (3, 3, 4, [7, 8, 9])))
    before = list(seq.steps)
    pickle.dumps(seq)
    assert seq.steps == before and all(type(r) is StepRecord for r in seq.steps)
    assert [r.accepted for r in seq.steps] == [1, 3]
    spec = seq.spec
    assert (spec.steps, spec.proposed, spec.accepted) == (2, 6, 4)


# ------------------------------------------------------------------ a turn across the pipe
def crossed(*turns: tuple[list, EngineTotals | None]) -> list[tuple[list, EngineTotals | None]]:
    """Each turn (events, totals) as the server reads it from a real pipe: sent by the engine
    process's `turn_bytes`, read by `Connection.recv`, its events given back by `turn_events`."""
    server_end, engine_end = multiprocessing.Pipe()
    got = []
    try:
        for events, totals in turns:
            engine_end.send_bytes(turn_bytes(events, totals))
        for _ in turns:
            kind, events, totals = server_end.recv()
            assert kind == "turn"
            got.append((turn_events(events), totals))
    finally:
        server_end.close()
        engine_end.close()
    return got


def test_sequences_that_cross_the_pipe_each_count_their_own_steps() -> None:
    """Every sequence that arrives on the server's side gets counters of its own, counted from
    its own step records: two requests that end in one turn, and a third in the next, have
    the counters the engine's sequences have, whichever is read first."""
    a = sequence("a", ((3, 1, 2, [5, 6, 4]),))
    b = sequence("b", ((3, 3, 4, [7, 8, 9]), (3, 0, 1, [1, 1, 1])))
    c = sequence("c", ((2, 2, 3, [4, 4]),))
    turns = crossed(([("end", "a", a, None), ("end", "b", b, None)], None), ([("end", "c", c, None)], None))
    arrived = {event[1]: event[2] for events, _ in turns for event in events}
    for name in ("b", "a", "c", "b", "a"):
        assert arrived[name].spec.as_dict() == {"a": a, "b": b, "c": c}[name].spec.as_dict(), name
    assert len({id(s.spec) for s in arrived.values()}) == 3
    assert len({id(s.recent) for s in arrived.values()}) == 3


class Whole:
    """Pickles a sequence as a plain description of itself (a reduction registered with
    copyreg by some other code in the engine's process)."""

    @staticmethod
    def reduce(seq: Sequence) -> tuple:
        return (str, (f"sequence {seq.request_id}",))


def test_a_sequence_crosses_its_own_way_even_where_copyreg_has_a_reduction_for_it() -> None:
    """The turn's own way for a sequence (without the engine's generator and oracle, its step
    records named on arrival) comes before any reduction registered with copyreg for the same
    type; other types keep copyreg's."""
    seq = sequence("r")
    seq.generator = torch.Generator().manual_seed(1)
    copyreg.pickle(Sequence, Whole.reduce)
    try:
        [(events, _)] = crossed(([("end", "r", seq, None)], None))
    finally:
        copyreg.dispatch_table.pop(Sequence, None)
    got = events[0][2]
    assert type(got) is Sequence and got.generator is None and got.output_ids == seq.output_ids
    assert all(type(r) is StepRecord for r in got.steps)


def test_the_server_reads_every_turn_waiting_in_the_pipe_when_it_wakes() -> None:
    """When the pipe becomes readable the server hands on every turn waiting in it, in order
    (each turn's totals to `on_step`, its events to the requests), before it gives the event
    loop back."""

    async def scenario() -> None:
        server_end, engine_end = multiprocessing.Pipe()
        seen: list[int] = []
        engine = ProcessEngine(
            SimpleNamespace(conn=server_end, process=ExitingProcess()),
            lambda totals: seen.append(totals.steps),
        )
        try:
            submitted = asyncio.create_task(engine.submit("r", [1, 2], SamplingParams(max_tokens=4)))
            await asyncio.sleep(0)
            assert engine_end.recv()[:2] == ("add", "r")
            turns = [
                [("added", "r", None), ("out", StepOutput("r", [5], False, None, 1.0))],
                [("out", StepOutput("r", [6], False, None, 2.0))],
                [("out", StepOutput("r", [7], True, "length", 3.0)), ("end", "r", None, None)],
            ]
            for steps, events in enumerate(turns, 1):
                engine_end.send_bytes(turn_bytes(events, EngineTotals(steps=steps)))
            while not server_end.poll():
                pass
            engine._readable()
            assert seen == [1, 2, 3] and not engine.busy()
            stream = await asyncio.wait_for(submitted, 5)
            got = [stream.get_nowait() for _ in range(4)]
            assert [o.new_token_ids for o in got[:3]] == [[5], [6], [7]] and isinstance(got[3], Finished)
        finally:
            engine.shutdown(timeout=0.1)
            engine_end.close()

    asyncio.run(scenario())


# ------------------------------------------------------------------ the engine loop
@pytest.fixture(scope="module")
def pair(tiny_pair):
    target_dir, draft_dir = tiny_pair("qwen3", block_size=4)
    target = load_target(target_dir, dtype=torch.float64)
    return target, load_draft(draft_dir, target)


def tokens(n: int, **options) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **options)


class Turns:
    """An EngineLoop's deliveries: each turn's events and totals, with a copy of the totals
    taken at delivery and whether the engine still had work then."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.turns: list[tuple[list, EngineTotals | None, EngineTotals | None, bool]] = []

    def __call__(self, events: list, totals: EngineTotals | None) -> None:
        self.turns.append((events, totals, copy.deepcopy(totals), self.engine.has_unfinished()))

    @property
    def events(self) -> list:
        return [event for turn in self.turns for event in turn[0]]


def engine_loop(pair, speculative: bool = True, make_oracle=None, **config) -> tuple[EngineLoop, Turns]:
    target, draft = pair
    engine = Engine(target, draft if speculative else None, EngineConfig(**{"max_num_seqs": 4, **config}))
    turns = Turns(engine)
    return EngineLoop(engine, turns, make_oracle), turns


def turn_until_idle(loop: EngineLoop, limit: int = 100) -> None:
    for _ in range(limit):
        loop._turn()
        if not loop.engine.has_unfinished() and not loop.known:
            return
    raise AssertionError("the engine did not finish")


def test_each_turns_totals_are_the_engines_then_and_stay_so(pair) -> None:
    """The totals delivered after each turn are the engine's at that turn: its requests
    running and waiting, host-timed phases on the CPU; and they stay what they were while
    the engine goes on (more steps, verify widths and fallbacks counted after them)."""
    loop, turns = engine_loop(pair, max_num_seqs=3)
    for i in range(4):
        loop.put(("add", f"r{i}", [5, 6, 7 + i], tokens(6)))
    loop._turn()
    first = turns.turns[-1][1]
    assert (first.running, first.waiting) == (3, 1)
    assert first.device_phases is False and first.steps == 1
    loop.put(("add", "logprobs", [9, 8], tokens(3, logprobs=1)))
    turn_until_idle(loop)
    last = turns.turns[-1][1]
    assert last.fallbacks == {"logprobs": 1} and sum(last.verify_widths.values()) > 1
    assert first.fallbacks == {} and sum(first.verify_widths.values()) == 1
    for _, totals, copied, _ in turns.turns:
        assert totals == copied


def test_a_request_ends_once_and_an_abort_after_its_end_harms_no_other(pair) -> None:
    """A request that finished has had its one end; the abort its client sends afterwards (a
    reply closing) ends nothing again and fails no other request: the one still running goes
    on to its own end with its sequence."""
    loop, turns = engine_loop(pair)
    loop.put(("add", "short", [5, 6], tokens(1)))
    loop.put(("add", "long", [7, 8, 9], tokens(12)))
    loop._turn()
    assert ("end", "short") in [e[:2] for e in turns.events]
    loop.put(("abort", "short"))
    turn_until_idle(loop)
    ends = [e for e in turns.events if e[0] == "end"]
    assert [e[1] for e in ends] == ["short", "long"]
    assert all(e[3] is None for e in ends) and len(ends[1][2].output_ids) == 12


def test_a_refused_request_is_answered_once_and_never_taken(pair) -> None:
    """A request the engine refuses (a token outside the vocabulary) gets one ("added", id,
    error) and nothing else: it is not among the loop's requests, and an abort of it ends
    nothing."""
    loop, turns = engine_loop(pair)
    loop.put(("add", "bad", [5, 10**6], tokens(4)))
    loop.put(("abort", "bad"))
    loop._turn()
    loop._turn()
    events = [e for e in turns.events if e[1] == "bad"]
    assert len(events) == 1 and events[0][0] == "added" and isinstance(events[0][2], RequestError)
    assert "bad" not in loop.known and not loop.engine.has_unfinished()


def test_a_request_that_cannot_be_queued_fails_alone_as_an_engine_error(pair) -> None:
    """An unexpected error while a request is queued (here its forced-acceptance schedule
    cannot be made) refuses that request with RequestFailed naming the error's type and
    message; a request queued after it runs."""

    def make_oracle(params: SamplingParams):
        if params.max_tokens == 3:
            raise ValueError("no schedule")
        return None

    loop, turns = engine_loop(pair, make_oracle=make_oracle)
    loop.put(("add", "broken", [5, 6], tokens(3)))
    loop.put(("add", "fine", [5, 6], tokens(2)))
    turn_until_idle(loop)
    added = {e[1]: e[2] for e in turns.events if e[0] == "added"}
    assert type(added["broken"]) is RequestFailed
    assert str(added["broken"]) == "engine error: ValueError: no schedule"
    assert added["fine"] is None
    assert [e[1] for e in turns.events if e[0] == "end"] == ["fine"]


def test_end_all_ends_every_request_in_flight_and_leaves_the_engine_nothing_to_run(pair) -> None:
    """`end_all` (the shutdown's grace period ran out) ends each request taken, running or
    waiting, with ShuttingDown(reason), once, and the engine runs none of them any more."""
    loop, turns = engine_loop(pair, max_num_seqs=2)
    for i in range(3):
        loop.put(("add", f"r{i}", [5, 6 + i], tokens(50)))
    loop._turn()
    loop.put(("end_all", "time is up"))
    loop._turn()
    ends = {e[1]: e for e in turns.events if e[0] == "end"}
    assert sorted(ends) == ["r0", "r1", "r2"]
    assert all(isinstance(e[3], ShuttingDown) and str(e[3]) == "time is up" for e in ends.values())
    assert not loop.engine.has_unfinished() and not loop.known
    loop._turn()
    assert len([e for e in turns.events if e[0] == "end"]) == 3


class LoopKilled(BaseException):
    """Not an Exception: nothing in the loop catches it."""


def test_a_loop_that_dies_answers_the_requests_waiting_to_be_queued(pair) -> None:
    """An engine loop taken down by something it cannot catch fails every request in flight,
    and answers each request still waiting in its commands with RequestFailed: no submitter
    waits for a loop that is gone."""
    loop, turns = engine_loop(pair)
    step = loop.engine.step

    def dying_step():
        loop.put(("add", "late", [5, 6], tokens(4)))
        raise LoopKilled()

    loop.put(("add", "running", [5, 6], tokens(4)))
    loop.engine.step = dying_step
    with pytest.raises(LoopKilled):
        loop.run()
    loop.engine.step = step
    events = turns.events
    assert [(e[0], e[1]) for e in events] == [("added", "running"), ("end", "running"), ("added", "late")]
    assert isinstance(events[1][3], RequestFailed) and isinstance(events[2][2], RequestFailed)
    assert not loop.running and turns.turns[-1][1] is None


def test_a_step_that_raises_fails_its_requests_and_leaves_the_engine_none_of_them(pair) -> None:
    """A whole step that raises fails every request in flight with the error, once, and the
    engine no longer holds them when their failure is delivered; the loop itself goes on (to
    the `stop` that comes after)."""
    loop, turns = engine_loop(pair)

    def failing_step():
        loop.put(("stop",))
        raise RuntimeError("broken step")

    loop.engine.step = failing_step
    loop.put(("add", "a", [5, 6], tokens(4)))
    loop.put(("add", "b", [7, 8], tokens(4)))
    loop.run()
    failed = [(events, left) for events, _, _, left in turns.turns if any(e[0] == "end" for e in events)]
    assert len(failed) == 1
    events, unfinished = failed[0]
    ends = [e for e in events if e[0] == "end"]
    assert sorted(e[1] for e in ends) == ["a", "b"] and not unfinished
    assert all(isinstance(e[3], RequestFailed) and "RuntimeError: broken step" in str(e[3]) for e in ends)


def test_a_request_the_engine_fails_ends_with_its_error_and_no_tokens_of_the_failure(pair) -> None:
    """A request whose distribution turns non-finite mid-stream: the loop delivers the tokens
    it committed before, no output of the failure itself, and one end carrying its sequence
    and RequestFailed with the engine's reason; the request beside it ends normally with its
    sequence."""
    with poisoned():
        loop, turns = engine_loop(pair)
        loop.put(("add", "bad", [POISON, 40, 41], tokens(10)))
        loop.put(("add", "good", [5, 6, 7], tokens(10)))
        turn_until_idle(loop)
    outs = [e[1] for e in turns.events if e[0] == "out"]
    assert all(o.error is None and o.finish_reason != "error" for o in outs)
    ends = {e[1]: e for e in turns.events if e[0] == "end"}
    bad, good = ends["bad"], ends["good"]
    assert isinstance(bad[3], RequestFailed) and "not finite" in str(bad[3])
    assert bad[2] is not None and bad[2].finish_reason == "error"
    assert [t for o in outs if o.request_id == "bad" for t in o.new_token_ids] == bad[2].output_ids
    assert good[3] is None
    assert good[2].output_ids == [t for o in outs if o.request_id == "good" for t in o.new_token_ids]
    assert len(good[2].output_ids) == 10


# ------------------------------------------------------------------ the asyncio side
def test_a_request_that_ended_leaves_the_server_idle(pair) -> None:
    """On the engine's thread with a real engine: a request read to its end (its tokens, then
    one Finished with its sequence) leaves nothing in flight, so a draining server does not
    wait on it."""
    target, draft = pair

    async def scenario() -> None:
        runner = ThreadEngine(Engine(target, draft, EngineConfig(max_num_seqs=2)))
        try:
            stream = await asyncio.wait_for(runner.submit("r", [5, 6, 7], tokens(5)), 30)
            ids = []
            while not isinstance(item := await asyncio.wait_for(stream.get(), 30), Finished):
                ids += item.new_token_ids
            assert item.error is None and item.sequence.output_ids == ids and len(ids) == 5
            assert not runner.busy() and not runner.streams
        finally:
            runner.shutdown()

    asyncio.run(scenario())


def test_a_lost_engine_process_fails_the_streams_though_a_client_left_while_queued() -> None:
    """The engine process's pipe closes while one request streams and another's client has
    already left (its submit cancelled before the engine took it): the stream ends with
    RequestFailed, nothing is left in flight, and /health's `alive` is false."""

    async def scenario() -> None:
        server_end, engine_end = multiprocessing.Pipe()
        engine = ProcessEngine(SimpleNamespace(conn=server_end, process=ExitingProcess()))
        try:
            streaming = asyncio.create_task(engine.submit("streaming", [1], tokens(4)))
            gone = asyncio.create_task(engine.submit("gone", [1], tokens(4)))
            await asyncio.sleep(0)
            engine_end.send_bytes(turn_bytes([("added", "streaming", None)], EngineTotals()))
            stream = await asyncio.wait_for(streaming, 5)
            gone.cancel()
            await asyncio.sleep(0)
            engine_end.close()
            last = await asyncio.wait_for(stream.get(), 5)
            assert isinstance(last, Finished) and isinstance(last.error, RequestFailed)
            assert not engine.busy() and not engine.alive and gone.cancelled()
        finally:
            engine.shutdown(timeout=0.1)

    asyncio.run(scenario())


def test_a_request_submitted_as_the_pipe_breaks_fails_at_once() -> None:
    """A request submitted while the engine process's pipe is broken (the process is dying
    and the server has not read the pipe's end yet) fails with RequestFailed at its submit
    rather than waiting for an answer that cannot come."""

    async def scenario() -> None:
        server_end, engine_end = multiprocessing.Pipe()
        engine = ProcessEngine(SimpleNamespace(conn=server_end, process=ExitingProcess()))
        try:
            engine_end.close()
            with pytest.raises(RequestFailed):
                await engine.submit("r", [1], tokens(4))
            assert not engine.busy() and not engine.alive
        finally:
            engine.shutdown(timeout=0.1)

    asyncio.run(asyncio.wait_for(scenario(), 10))


# ------------------------------------------------------------------ the replies
def streamed_choices(reply: list) -> list[dict]:
    return [e["choices"][0] for e in reply[:-1] if "choices" in e and e["choices"]]


def top2(ids: list[int]) -> list[dict[int, float]]:
    return [{t: -0.25, (t + 1) % len(VOCAB): -2.0} for t in ids]


THREE_TURNS = [
    [([0, 1], None, 1.0, top2([0, 1]))],
    [([2], None, 2.0, top2([2]))],
    [([3, 4], "length", 3.0, top2([3, 4]))],
]


def test_streamed_completions_logprobs_continue_the_text_offsets_of_the_chunks_before() -> None:
    """A streamed completion's logprobs count each token's text_offset over the whole
    completion, chunk after chunk, as the whole reply counts them."""
    for stream in (True, False):
        parsed = parsed_request(stream=stream, logprobs=1, params=SamplingParams(max_tokens=5))
        reply, _, _ = asyncio.run(answered(parsed, THREE_TURNS))
        if stream:
            offsets = [o for c in streamed_choices(reply) for o in c["logprobs"]["text_offset"]]
        else:
            offsets = reply["choices"][0]["logprobs"]["text_offset"]
        assert offsets == [0, 3, 5, 8, 11], stream


def test_a_whole_reply_has_the_logprobs_of_every_chunk() -> None:
    """The whole reply gathers the logprobs of every chunk the engine sent, one entry per
    token, in order, as the streamed reply sends them."""
    parsed = parsed_request(logprobs=1, params=SamplingParams(max_tokens=5))
    whole, _, _ = asyncio.run(answered(parsed, THREE_TURNS))
    lp = whole["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Hel", "lo", " wo", "rld", "!"] and lp["token_logprobs"] == [-0.25] * 5
    assert whole["choices"][0]["token_ids"] == [0, 1, 2, 3, 4]
    streamed, _, _ = asyncio.run(answered(parsed_request(stream=True, logprobs=1), THREE_TURNS))
    top = [t for c in streamed_choices(streamed) for t in c["logprobs"]["top_logprobs"]]
    assert top == lp["top_logprobs"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_without_top_logprobs_give_each_tokens_own_logprob(stream: bool) -> None:
    """A chat request with `logprobs: true` and no `top_logprobs` (logprobs 0) gets each
    token's own logprob and no alternatives, streamed or whole."""
    parsed = parsed_request(chat=True, stream=stream, logprobs=0, params=SamplingParams(max_tokens=5))
    reply, _, _ = asyncio.run(answered(parsed, THREE_TURNS))
    if stream:
        content = [entry for c in streamed_choices(reply) for entry in c["logprobs"]["content"]]
    else:
        content = reply["choices"][0]["logprobs"]["content"]
    assert [e["token_id"] for e in content] == [0, 1, 2, 3, 4]
    assert all(e["logprob"] == -0.25 and e["top_logprobs"] == [] for e in content)


def speculative_sequence() -> Sequence:
    seq = sequence("r", ((3, 1, 2, [0, 1, 4]), (3, 2, 3, [2, 3, 4])), max_tokens=5)
    seq.fallback_reason = "low_acceptance"
    return seq


def test_both_replies_carry_the_requests_spec_decode_summary() -> None:
    """A speculative request's whole reply and its streamed usage chunk both carry the same
    `spec_decode` summary of its step records (steps, proposed, accepted, each step's
    acceptance length, the fallback reason); a plain request's carry none."""
    turns = [[([0, 1], None, 1.0)], [([2, 3, 4], "length", 2.0)]]
    want = {
        "steps": 2,
        "proposed": 6,
        "accepted": 3,
        "acceptance_lengths": [2, 3],
        "fallback_reason": "low_acceptance",
    }
    whole, _, _ = asyncio.run(answered(parsed_request(), turns, sequence=speculative_sequence()))
    assert whole["spec_decode"] == want
    streamed, _, _ = asyncio.run(
        answered(parsed_request(stream=True, include_usage=True), turns, sequence=speculative_sequence())
    )
    assert streamed[-2]["choices"] == [] and streamed[-2]["spec_decode"] == want
    plain = Sequence("r", [0, 1], SamplingParams(max_tokens=5), frozenset(), 0.0, False)
    for seq in (plain, None):
        whole, _, _ = asyncio.run(answered(parsed_request(), turns, sequence=seq))
        streamed, _, _ = asyncio.run(
            answered(parsed_request(stream=True, include_usage=True), turns, sequence=seq)
        )
        assert "spec_decode" not in whole and "spec_decode" not in streamed[-2]
        assert streamed[-2]["usage"]["completion_tokens"] == 5


def test_a_whole_completion_names_its_prompts_token_ids() -> None:
    """The whole completions reply's choice carries the prompt's token ids."""
    parsed = parsed_request(prompt_ids=[4, 2, 7])
    whole, _, _ = asyncio.run(answered(parsed, [[([0], "length", 1.0)]]))
    assert whole["choices"][0]["prompt_token_ids"] == [4, 2, 7]
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_failure_reaches_the_client_as_an_engine_error(stream: bool) -> None:
    """A request the engine failed gets a 500 whose message is the engine loop's reason as
    it stands (the engine's own "engine error: ..."; what ended the loop), whole or as the
    stream's error event before [DONE]."""
    for reason in ("engine error: FloatingPointError: numerical failure", "the engine process stopped"):
        reply, _, _ = asyncio.run(
            answered(parsed_request(stream=stream), [[([0, 1], None, 1.0)]], error=RequestFailed(reason))
        )
        if stream:
            error = reply[-2]["error"]
            assert reply[-1] == "[DONE]" and (error["code"], error["type"]) == (500, "server_error")
            assert error["message"] == reason
        else:
            assert isinstance(reply, ProtocolError) and reply.status == 500
            assert str(reply) == reason


@pytest.mark.parametrize("stream", [False, True])
def test_the_last_output_releases_the_text_held_back_for_a_stop_string(stream: bool) -> None:
    """Text that could begin a stop string is held back while the request runs, and released
    with its last output when no stop string came: the reply ends with it, whole or
    streamed."""
    parsed = parsed_request(stream=stream, stop=("!!",), params=SamplingParams(max_tokens=3))
    reply, _, _ = asyncio.run(answered(parsed, [[([0], None, 1.0)], [([1, 4], "length", 2.0)]]))
    if stream:
        choices = streamed_choices(reply)
        text, finish = "".join(c["text"] for c in choices), choices[-1]["finish_reason"]
    else:
        text, finish = reply["choices"][0]["text"], reply["choices"][0]["finish_reason"]
    assert (text, finish) == ("Hello!", "length")


def test_a_step_that_raises_reaches_the_client_as_one_engine_error(pair) -> None:
    """A request failed by a whole step that raised (a real engine on the engine's thread)
    gets a 500 whose message names the engine error once, with the exception's type and
    message."""
    target, draft = pair
    engine = Engine(target, draft, EngineConfig(max_num_seqs=2))

    def broken_step():
        raise RuntimeError("broken step")

    engine.step = broken_step

    async def scenario() -> ProtocolError:
        runner = ThreadEngine(engine)
        server = scripted_server(runner)
        try:
            with pytest.raises(ProtocolError) as caught:
                await asyncio.wait_for(respond(server, parsed_request(), 0.0), 30)
            return caught.value
        finally:
            runner.shutdown()

    error = asyncio.run(scenario())
    assert error.status == 500
    assert str(error) == "engine error: RuntimeError: broken step"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "error",
    [RequestFailed("numerical failure"), ShuttingDown("the grace period ran out")],
    ids=["engine failure", "shut down"],
)
def test_a_reply_a_stop_string_ended_stays_complete_whatever_ends_the_request_after(
    stream: bool, error: Exception
) -> None:
    """A stop string ended the reply (its text, finish_reason "stop", counted as a success and
    the request aborted); an error on the request's end that comes before the abort lands (the
    engine failing it, or the shutdown's deadline) does not turn that reply into an error."""
    parsed = parsed_request(stream=stream, stop=("o w",), params=SamplingParams(max_tokens=16))
    reply, engine, server = asyncio.run(answered(parsed, [[([0, 1, 2, 3], None, 1.0)]], error=error))
    assert engine.sent[-1] == ("abort", "cmpl-1")
    page = metrics_page(server)
    assert value(page, "dflash:request_success_total", finish_reason="stop") == 1
    if stream:
        assert reply[-1] == "[DONE]" and not any("error" in e for e in reply[:-1])
        assert streamed_choices(reply)[-1]["finish_reason"] == "stop"
    else:
        assert not isinstance(reply, ProtocolError)
        assert (reply["choices"][0]["text"], reply["choices"][0]["finish_reason"]) == ("Hell", "stop")
