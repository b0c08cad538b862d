"""The server's inner parts where the existing tests leave room:
- the command line (serving/args.py): --threads takes 1 and refuses 0, and an infinite timeout
  or body limit is refused like a non-positive one; a --max-body-mb the parser takes is one
  the server starts with;
- the chat template's environment (serving/chat_template.py) is transformers': blocks
  trimmed, `{% break %}`, `add_generation_prompt` true and `documents` none;
- the served model (serving/service.py): the named special tokens come from
  tokenizer_config.json before a legacy special_tokens_map.json;
- the shutdown policy (serving/lifecycle.py): a request waiting to be taken keeps the
  server from being idle;
- the engine loop (serving/async_engine.py): its totals count running and waiting requests
  apart; an abort ends a request with its sequence; the shutdown's deadline aborts the
  engine's own requests, not only their streams; a request the engine cannot queue for an
  unexpected reason fails alone as RequestFailed naming it; a thread engine's shutdown waits
  for its thread;
- a follower rank (serving/followers.py) ignores SIGTERM and SIGINT, and an abort of a
  request that already finished there is skipped.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_target
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams
from reference_engine.serving import followers
from reference_engine.serving.args import ServeArgs
from reference_engine.serving.async_engine import (
    AsyncEngine,
    EngineLoop,
    EngineTotals,
    RequestFailed,
    ShuttingDown,
    ThreadEngine,
)
from reference_engine.serving.chat_template import compile_chat_template, render_chat_template
from reference_engine.serving.followers import follow
from reference_engine.serving.lifecycle import Lifecycle
from reference_engine.serving.service import Server


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def target(model_dir: Path):
    return load_target(model_dir, dtype=torch.float64)


def serve(*argv: str) -> ServeArgs:
    return ServeArgs.parse(["--model", "m", *argv])


def refused(capsys, *argv: str) -> str:
    """The last line argparse printed when it refused `argv` (exit 2)."""
    with pytest.raises(SystemExit) as exited:
        serve(*argv)
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# ------------------------------------------------------------------ the command line
def test_threads_takes_one_and_refuses_zero_or_a_word(capsys) -> None:
    assert serve("--threads", "1").threads == 1
    assert "threads must be >= 1, got 0" in refused(capsys, "--threads", "0")
    assert "not a thread count: 'two'" in refused(capsys, "--threads", "two")


@pytest.mark.parametrize(
    "flag",
    ["--header-timeout", "--body-timeout", "--timeout-keep-alive", "--max-body-mb", "--shutdown-grace"],
)
def test_an_infinite_timeout_grace_or_body_limit_is_refused(capsys, flag: str) -> None:
    """docs/engine.md: the timeouts and --max-body-mb must be finite (and --shutdown-grace too):
    `inf` stops start-up with one error line naming the flag."""
    for value in ("inf", "-inf", "1e999"):
        error = refused(capsys, f"{flag}={value}")
        assert flag in error and "not a finite number" in error


@pytest.mark.parametrize("mib", ["1e308", "1e-9"])
def test_a_body_limit_the_parser_takes_is_one_the_server_starts_with(
    model_dir: Path, capsys, mib: str
) -> None:
    """A --max-body-mb value is either refused by the parser (one line naming the flag, exit 2)
    or gives the server a body limit of at least one byte."""
    try:
        args = ServeArgs.parse(["--model", str(model_dir), "--device", "cpu", "--max-body-mb", mib])
    except SystemExit as exited:
        assert exited.code == 2 and "--max-body-mb" in capsys.readouterr().err
        return
    assert Server(args).limits.max_bytes >= 1


# ------------------------------------------------------------------ the chat template
ENVIRONMENT_TEMPLATE = """\
{% for m in messages %}
    {% if loop.index > 2 %}
        {% break %}
    {% endif %}
[{{ m['role'] }}:{{ m['content'] }}]
{% endfor %}
{% if add_generation_prompt %}
<gen>
{% endif %}
{% if documents is none and tools is none %}
.
{% endif %}
"""


def test_a_template_renders_in_transformers_environment() -> None:
    """Block tags on lines of their own leave neither their indent nor their newline
    (trim_blocks, lstrip_blocks), `{% break %}` ends a loop, `add_generation_prompt` is true
    and `documents` and `tools` are none."""
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "never"},
    ]
    rendered = render_chat_template(compile_chat_template(ENVIRONMENT_TEMPLATE), messages)
    assert rendered == "[system:s]\n[user:u]\n<gen>\n.\n"


# ------------------------------------------------------------------ the served model
def test_the_templates_special_tokens_come_from_tokenizer_config_before_the_legacy_map(
    model_dir: Path, copy_checkpoint
) -> None:
    """A name tokenizer_config.json gives is its value, whatever special_tokens_map.json
    says; the legacy map fills only the names the config lacks (transformers' order)."""
    model = copy_checkpoint(model_dir)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("bos_token", None)
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<cfg-eos>"}))
    (model / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<map-eos>", "bos_token": {"content": "<map-bos>"}})
    )
    (model / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}")
    server = Server(ServeArgs.parse(["--model", str(model), "--device", "cpu"]))
    assert server.apply_chat_template([{"role": "user", "content": "hi"}]) == "<map-bos>hi<cfg-eos>"


# ------------------------------------------------------------------ the shutdown policy
class HeldEngine(AsyncEngine):
    """The asyncio side of an engine loop that never takes a request: what it was sent is
    kept in `sent`."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple] = []

    def _send(self, command: tuple) -> None:
        self.sent.append(command)

    @property
    def alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def test_a_request_waiting_to_be_taken_keeps_the_server_from_being_idle() -> None:
    """The drain waits for requests in flight, and a request submitted but not yet taken by
    the engine loop is one: the lifecycle is not idle until it is answered."""

    async def scenario() -> None:
        runner = HeldEngine()
        lifecycle = Lifecycle(lambda: runner, grace_s=1.0)
        async with lifecycle.lifespan(None):
            assert lifecycle.idle()
            waiting = asyncio.create_task(runner.submit("r", [1], SamplingParams(max_tokens=1)))
            await asyncio.sleep(0)
            assert runner.sent and not runner.streams
            assert not lifecycle.idle()
            runner.receive([("added", "r", RequestFailed("refused"))], None)
            with pytest.raises(RequestFailed):
                await waiting
            assert lifecycle.idle()

    asyncio.run(scenario())


# ------------------------------------------------------------------ the engine loop
def engine_loop(target) -> tuple[EngineLoop, list]:
    """An EngineLoop on a real tiny plain engine, and the events it delivered."""
    engine = Engine(target, None, EngineConfig(max_num_seqs=2))
    events: list = []
    return EngineLoop(engine, lambda turn, totals: events.extend(turn), None), events


def test_the_shutdown_deadline_aborts_the_engines_requests_and_ends_each_with_shutting_down(target) -> None:
    """`end_all` (the grace period is over) ends every request in flight with ShuttingDown
    and aborts it in the engine, which then holds nothing and steps no more."""
    loop, events = engine_loop(target)
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    loop.put(("add", "a", [1, 2, 3], long))
    loop.put(("add", "b", [4, 5], long))
    loop._turn()
    loop._turn()
    assert [e for e in events if e[0] == "added"] == [("added", "a", None), ("added", "b", None)]
    assert loop.engine.has_unfinished()
    loop.put(("end_all", "the server shut down"))
    loop._turn()
    ends = {e[1]: e[3] for e in events if e[0] == "end"}
    assert set(ends) == {"a", "b"}
    assert all(isinstance(error, ShuttingDown) and "shut down" in str(error) for error in ends.values())
    assert not loop.engine.has_unfinished() and not loop.engine.scheduler.known


def test_an_aborted_request_ends_with_its_sequence_and_leaves_the_engine(target) -> None:
    """An abort (a client gone, a stop string cut) ends the request with the sequence the
    engine held, so its statistics cover every step it took."""
    loop, events = engine_loop(target)
    loop.put(("add", "a", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True)))
    loop._turn()
    loop._turn()
    loop.put(("abort", "a"))
    loop._turn()
    [end] = [e for e in events if e[0] == "end"]
    assert end[1] == "a" and end[3] is None
    assert end[2] is not None and end[2].request_id == "a" and len(end[2].output_ids) >= 2
    assert not loop.engine.scheduler.known and not loop.known


def test_the_totals_count_the_running_and_the_waiting_requests_apart(target) -> None:
    """/metrics' gauges: with one slot and three requests, one runs and two wait."""
    engine = Engine(target, None, EngineConfig(max_num_seqs=1))
    for name in "abc":
        engine.add_request(name, [1, 2], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    totals = EngineTotals.of(engine)
    assert (totals.running, totals.waiting) == (1, 2)


def test_a_request_the_engine_cannot_queue_for_an_unexpected_reason_fails_alone(target) -> None:
    """An exception that is not the engine's own refusal, raised while queueing a request,
    refuses that request alone with RequestFailed naming it; the next request is taken."""
    engine = Engine(target, None, EngineConfig(max_num_seqs=2))
    events: list = []

    def make_oracle(params: SamplingParams):
        if params.max_tokens == 7:
            raise ValueError("no oracle for this one")
        return None

    loop = EngineLoop(engine, lambda turn, totals: events.extend(turn), make_oracle)
    loop.put(("add", "bad", [1], SamplingParams(max_tokens=7)))
    loop.put(("add", "good", [1], SamplingParams(max_tokens=50, ignore_eos=True)))
    loop._turn()
    added = {e[1]: e[2] for e in events if e[0] == "added"}
    assert isinstance(added["bad"], RequestFailed)
    assert "engine error: ValueError: no oracle for this one" in str(added["bad"])
    assert added["good"] is None and loop.known == {"good"}


def test_a_thread_engines_shutdown_waits_for_its_thread(target) -> None:
    runner = ThreadEngine(Engine(target, None, EngineConfig(max_num_seqs=2)))
    assert runner.alive
    runner.shutdown()
    assert not runner.thread.is_alive() and not runner.alive


# ------------------------------------------------------------------ a follower rank
class Broadcasts:
    """rank 0's side for a follower's `broadcast_object_list`: a request added, steps until
    the follower's engine has finished it, then an abort of it and the stop marker."""

    def __init__(self, engine: Engine, request: tuple) -> None:
        self.engine = engine
        self.messages = [("step", [request])]
        self.aborted = False

    def __call__(self, box: list, src: int) -> None:
        if self.messages:
            box[0] = self.messages.pop(0)
        elif self.engine.has_unfinished():
            box[0] = ("step", [])
        elif not self.aborted:
            self.aborted = True
            box[0] = ("idle", [("abort", "r")])
        else:
            box[0] = ("stop", [])


def test_a_follower_ignores_sigterm_and_sigint_and_skips_an_abort_of_a_request_it_finished(
    target, monkeypatch
) -> None:
    """torchrun passes a signal to every rank; a follower ignores it (rank 0 drains first and
    then sends the stop marker). An abort rank 0 sends for a request the follower has already
    finished is skipped, not raised."""
    engine = Engine(target, None, EngineConfig(max_num_seqs=2))
    rank_0 = Broadcasts(engine, ("add", "r", [1, 2], SamplingParams(max_tokens=2), None))
    monkeypatch.setattr(followers.dist, "broadcast_object_list", rank_0)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        follow(engine, None)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert rank_0.aborted and not engine.has_unfinished() and not engine.scheduler.known
