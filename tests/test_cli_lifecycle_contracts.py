"""What the command lines and the server's policies promise, checked where they are decided:
the defaults that docs/engine.md and each --help state, the values each option refuses with
one clear message, what `generate` and `make-tiny` write, one connection's deadlines, the
drain at shutdown, the tensor-parallel followers (the calls every rank repeats), the engine a
server builds from its options, and the training recipe's settings, schedules and corpus
split. No server starts and nothing trains: the checks call the parsers and policies
directly, on tiny checkpoints where an engine is needed."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import re
import shutil
import signal
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import h11
import pytest
import torch
import uvicorn
from safetensors.torch import load_file
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from reference_engine.bench import BenchArgs
from reference_engine.checkpoint.__main__ import main as checkpoint_main
from reference_engine.checkpoint.synthetic import make_tiny_draft, make_tiny_target
from reference_engine.engine_args import engine_config, resolve_device, resolve_dtype
from reference_engine.errors import ReferenceEngineError, RequestError
from reference_engine.generate import GenerateArgs
from reference_engine.generate import main as generate_main
from reference_engine.runtime.outputs import StepOutput
from reference_engine.runtime.request import SamplingParams
from reference_engine.serving import followers
from reference_engine.serving.args import ServeArgs
from reference_engine.serving.async_engine import EngineTotals
from reference_engine.serving.connections import LINGER_S, connection_policy_protocol
from reference_engine.serving.engine_build import EngineInfo, build_engine, engine_loop_mode
from reference_engine.serving.followers import FollowersLost, LeadingEngine, follow
from reference_engine.serving.lifecycle import GracefulServer, Lifecycle
from reference_engine.serving.protocol import ProtocolError
from reference_engine.training.corpus import Corpus, CorpusError, train_tokenizer
from reference_engine.training.evaluation import heldout_prompts, mean_tail
from reference_engine.training.loops import loss_curve, lr_at, optimise
from reference_engine.training.settings import Recipe
from reference_engine.training.stages import generator


def refused(capsys, parse, *argv: str) -> str:
    """The one error line argparse prints for `parse(*argv)`, which must exit with status 2."""
    with pytest.raises(SystemExit) as stop:
        parse(*argv)
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# ------------------------------------------------------------------ serve's defaults
def test_serve_defaults_are_the_documented_ones() -> None:
    """docs/engine.md and --help: loopback, port 8000, body 4 MiB, grace 5 s, header 10 s,
    body 30 s, 512 connections, keep-alive 5 s, the key guarding /v1/* only, dflash counter
    names, the engine loop chosen by the device, the checkpoint's dtype on the device there
    is, and phases timed on the host alone (no CUDA events a step unless asked)."""
    args = ServeArgs.parse(["--model", "m"])
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert (args.max_body_mb, args.shutdown_grace) == (4.0, 5.0)
    assert (args.header_timeout, args.body_timeout, args.timeout_keep_alive) == (10.0, 30.0, 5.0)
    assert (args.max_connections, args.max_waiting) == (512, 256)
    assert (args.api_key_scope, args.metrics_names, args.engine_loop) == ("api", ("dflash",), "auto")
    assert (args.dtype, args.device, args.verify_width) == ("auto", "auto", "auto")
    assert args.device_phase_times is False and engine_config(args).device_phase_times is False


def test_the_serve_parser_and_its_dataclass_agree_on_every_default() -> None:
    """ServeArgs built in code (its field defaults) is the server the command line starts
    when the option is left out."""
    parsed = ServeArgs.parse(["--model", "m"])
    for field in dataclasses.fields(ServeArgs):
        if field.default is not dataclasses.MISSING:
            assert getattr(parsed, field.name) == field.default, field.name


def test_generate_and_the_engine_benchmark_default_to_the_checkpoints_dtype_on_the_device_there_is() -> None:
    generate = GenerateArgs.parse(["--model", "m", "--prompt-ids", "1", "--max-tokens", "1"])
    bench = BenchArgs.parse([])
    assert (generate.dtype, generate.device) == ("auto", "auto")
    assert (bench.dtype, bench.device, bench.verify_width) == ("auto", "auto", "auto")


def test_generate_decodes_greedily_without_a_cut_unless_told_and_seeds_with_0() -> None:
    """generate's sampling defaults are a request's own: greedy, top_p 1, no top-k cut, EOS
    honoured, no extra stop ids; --seed 0."""
    args = GenerateArgs.parse(["--model", "m", "--prompt-ids", "1", "--max-tokens", "1"])
    default = SamplingParams()
    assert (args.temperature, args.top_p, args.top_k) == (default.temperature, default.top_p, default.top_k)
    assert (args.ignore_eos, args.stop_ids, args.seed, args.json) == (False, "", 0, False)


# ------------------------------------------------------------------ serve's option values
def serve(*argv: str) -> ServeArgs:
    return ServeArgs.parse(["--model", "m", *argv])


def test_the_whole_port_range_is_taken_and_nothing_past_it(capsys) -> None:
    assert serve("--port", "65535").port == 65535 and serve("--port", "1").port == 1
    assert "port must be in 1-65535, got 65536" in refused(capsys, serve, "--port", "65536")


def test_max_connections_takes_one_and_refuses_zero(capsys) -> None:
    assert serve("--max-connections", "1").max_connections == 1
    assert "--max-connections: must be >= 1, got 0" in refused(capsys, serve, "--max-connections", "0")


def test_metrics_names_are_read_around_spaces_once_each_and_unknown_ones_refused(capsys) -> None:
    assert serve("--metrics-names", "dflash, vllm").metrics_names == ("dflash", "vllm")
    assert serve("--metrics-names", "vllm,dflash,vllm").metrics_names == ("vllm", "dflash")
    error = refused(capsys, serve, "--metrics-names", "dflash,sglang")
    assert "expected a comma-separated list of dflash, vllm, lmdeploy, got 'dflash,sglang'" in error


@pytest.mark.parametrize(
    "flag", ["--header-timeout", "--body-timeout", "--timeout-keep-alive", "--max-body-mb"]
)
def test_serve_refuses_a_timeout_or_body_limit_that_would_refuse_every_request(capsys, flag: str) -> None:
    """0 s or less would close every connection at once (or answer every body with 413):
    one error line at start instead."""
    assert getattr(serve(flag, "0.5"), flag[2:].replace("-", "_")) == 0.5
    for value in ("0", "-1", "nan"):
        assert flag in refused(capsys, serve, flag, value)


def test_a_shutdown_grace_of_zero_is_taken_and_a_negative_one_refused(capsys) -> None:
    assert serve("--shutdown-grace", "0").shutdown_grace == 0.0
    assert "--shutdown-grace: must be >= 0, got -1" in refused(capsys, serve, "--shutdown-grace", "-1")


# ------------------------------------------------------------------ --dtype auto
@pytest.mark.parametrize("named", ["float8_e4m3fn", "int4", "float16_x"])
def test_dtype_auto_refuses_every_checkpoint_dtype_it_does_not_run_with_one_message(tmp_path, named) -> None:
    from reference_engine.errors import ConfigError

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": named}))
    with pytest.raises(ConfigError, match=f"the checkpoint's dtype '{named}' is not one of .*; pass --dtype"):
        resolve_dtype("auto", str(tmp_path), torch.device("cpu"))


# ------------------------------------------------------------------ one connection's deadlines
class Transport:
    """The socket side of one connection: what the protocol wrote, half-closed and closed."""

    def __init__(self) -> None:
        self.written, self.eof, self.closed, self.reading = b"", False, False, True

    def get_extra_info(self, name: str, default=None):
        return default

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


async def reads_its_body(scope, receive, send) -> None:
    """A route that waits for the whole request body."""
    while (await receive()).get("more_body"):
        pass


def opened(
    loop: asyncio.AbstractEventLoop, header_s: float, body_s: float, cap: int = 8, app=reads_its_body
) -> tuple[H11Protocol, Transport]:
    """A connection of the server's protocol, just accepted on `loop`."""
    config = uvicorn.Config(app, log_level="critical", timeout_keep_alive=60)
    protocol = connection_policy_protocol(header_s, body_s, cap)(
        config=config, server_state=ServerState(), app_state={}, _loop=loop
    )
    transport = Transport()
    protocol.connection_made(transport)
    return protocol, transport


def run_for(loop: asyncio.AbstractEventLoop, seconds: float) -> None:
    loop.run_until_complete(asyncio.sleep(seconds))


POST_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    b"Content-Type: application/json\r\nContent-Length: 40\r\n\r\n"
)


def test_a_connection_that_sends_no_headers_is_closed_at_the_header_timeout(loop) -> None:
    _, transport = opened(loop, header_s=0.4, body_s=5.0)
    run_for(loop, 0.05)
    assert not transport.closed  # not before its deadline
    run_for(loop, 0.5)
    assert transport.closed and transport.written == b""  # closed without an answer


async def answers(scope, receive, send) -> None:
    """A route that answers at once, keeping the connection alive."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_a_kept_alive_connection_owes_its_next_headers_within_the_header_timeout(loop) -> None:
    """The header deadline runs again from each response, whatever the (longer) keep-alive."""
    protocol, transport = opened(loop, header_s=0.2, body_s=5.0, app=answers)
    protocol.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    run_for(loop, 0.05)
    assert transport.written.startswith(b"HTTP/1.1 200 ")
    run_for(loop, 0.4)
    assert transport.closed


def test_a_body_that_does_not_arrive_gets_408_at_the_body_timeout_not_the_header_timeout(loop) -> None:
    """The header deadline ends once the headers are in: a body still due past it waits
    for --body-timeout, then gets 408 and the connection half-closes."""
    protocol, transport = opened(loop, header_s=0.05, body_s=0.6)
    protocol.data_received(POST_HEAD + b'{"prompt": ')
    run_for(loop, 0.2)  # past the header deadline
    assert transport.written == b"" and not transport.closed
    run_for(loop, 0.6)
    assert transport.written.startswith(b"HTTP/1.1 408 ")
    assert b"--body-timeout" in transport.written and transport.eof


def test_the_rest_of_a_refused_body_is_dropped_and_the_clients_close_ends_the_connection(loop) -> None:
    protocol, transport = opened(loop, header_s=5.0, body_s=0.05)
    protocol.data_received(POST_HEAD)
    run_for(loop, 0.1)
    answered = transport.written
    assert answered.startswith(b"HTTP/1.1 408 ") and not transport.closed  # lingering
    for late in (b"x" * 40, POST_HEAD):  # the rest of the body, then more: dropped unparsed
        protocol.data_received(late)
    assert transport.written == answered and transport.reading  # read on, so no reset
    protocol.eof_received()
    assert transport.closed


def test_an_answered_connection_closes_after_lingering_when_the_client_stays(loop) -> None:
    protocol, transport = opened(loop, header_s=5.0, body_s=0.05)
    protocol.data_received(POST_HEAD)
    run_for(loop, 0.1)
    assert transport.written.startswith(b"HTTP/1.1 408 ") and transport.eof and not transport.closed
    run_for(loop, LINGER_S)
    assert transport.closed


def test_a_body_the_client_ends_early_gets_400_at_once(loop) -> None:
    protocol, transport = opened(loop, header_s=5.0, body_s=5.0)
    protocol.data_received(POST_HEAD + b"{}")
    protocol.eof_received()
    assert transport.written.startswith(b"HTTP/1.1 400 ") and b"Content-Length" in transport.written


def test_a_request_answered_400_gets_no_second_answer_when_its_body_deadline_passes(loop) -> None:
    errors: list[dict] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    protocol, transport = opened(loop, header_s=5.0, body_s=0.1)
    protocol.data_received(POST_HEAD + b"{}")
    protocol.eof_received()
    answered = transport.written
    run_for(loop, 0.2)
    assert transport.written == answered and errors == []


def test_the_keep_alive_timeout_leaves_a_request_whose_response_has_not_started(loop) -> None:
    """uvicorn's keep-alive timer can fire just as a request arrives; the connection stays
    for the response the route owes (else h11 refuses the close and the loop logs it)."""
    protocol, transport = opened(loop, header_s=5.0, body_s=5.0)
    protocol.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert protocol.conn.our_state is h11.SEND_RESPONSE
    protocol.timeout_keep_alive_handler()
    assert not transport.closed and protocol.conn.our_state is h11.SEND_RESPONSE


# ------------------------------------------------------------------ the drain at shutdown
class Runner:
    """The engine loop as the server's lifecycle sees it."""

    def __init__(self, busy: bool = False, alive: bool = True) -> None:
        self.is_busy, self.alive = busy, alive
        self.ended: list[str] = []
        self.shut = False
        self.totals = EngineTotals(steps=7)

    def busy(self) -> bool:
        return self.is_busy

    def end_all(self, reason: str) -> None:
        self.ended.append(reason)

    def shutdown(self) -> None:
        self.shut = True


def test_health_is_ok_with_a_running_engine_loop_and_503_while_draining_or_without_one() -> None:
    runner = Runner()
    lifecycle = Lifecycle(lambda: runner, grace_s=1.5)
    assert lifecycle.health() == ({"status": "unhealthy", "reason": "the engine loop is not running"}, 503)
    assert lifecycle.totals() == EngineTotals()  # before the app starts
    lifecycle.runner = runner
    assert lifecycle.health() == ({"status": "ok"}, 200) and lifecycle.totals().steps == 7
    runner.alive = False
    assert lifecycle.health()[1] == 503
    runner.alive = True
    lifecycle.admit()  # admitted
    lifecycle.drain()
    assert lifecycle.health() == ({"status": "draining"}, 503)
    with pytest.raises(ProtocolError, match="shutting down") as refused_request:
        lifecycle.admit()
    assert refused_request.value.status == 503


def test_the_engine_loop_runs_while_the_app_does_and_the_deadline_names_the_grace() -> None:
    runner = Runner(busy=True)
    lifecycle = Lifecycle(lambda: runner, grace_s=1.5)
    assert lifecycle.idle()  # nothing started, nothing in flight

    async def serve_once() -> None:
        async with lifecycle.lifespan(app=None):
            assert lifecycle.runner is runner and not runner.shut
            assert not lifecycle.idle()
            runner.is_busy = False
            assert lifecycle.idle()

    asyncio.run(serve_once())
    assert runner.shut
    lifecycle.deadline()
    assert runner.ended == ["the server shut down before this request finished (--shutdown-grace 1.5 s)"]


def graceful(grace_s: float, idle) -> tuple[GracefulServer, list[str]]:
    events: list[str] = []
    config = uvicorn.Config(reads_its_body, log_level="critical")
    server = GracefulServer(
        config, grace_s, lambda: events.append("drain"), lambda: events.append("deadline"), idle
    )
    return server, events


def test_the_drain_waits_the_grace_period_for_requests_in_flight_then_ends_them() -> None:
    server, events = graceful(0.3, idle=lambda: False)
    start = time.monotonic()
    asyncio.run(server._drain(signal.SIGTERM, None))
    assert time.monotonic() - start >= 0.29
    assert events == ["deadline"] and server.should_exit


def test_the_drain_ends_as_soon_as_nothing_is_in_flight() -> None:
    left = [3]  # in flight for the first three looks

    def idle() -> bool:
        left[0] -= 1
        return left[0] < 0

    server, events = graceful(30.0, idle)
    start = time.monotonic()
    asyncio.run(server._drain(signal.SIGTERM, None))
    assert time.monotonic() - start < 2 and events == [] and server.should_exit


def test_a_second_signal_ends_the_requests_left_at_once() -> None:
    server, events = graceful(30.0, idle=lambda: False)

    async def two_signals() -> None:
        server.handle_exit(signal.SIGTERM, None)
        assert events == ["drain"] and server.draining and not server.should_exit
        server.handle_exit(signal.SIGTERM, None)
        assert events == ["drain", "deadline"] and server.should_exit

    asyncio.run(two_signals())


# ------------------------------------------------------------------ tensor-parallel followers
class RecordingEngine:
    """An engine's request surface, recording the calls it took and finishing every request
    it holds at its first step."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.scheduler = SimpleNamespace(known=set())
        self.calls: list[tuple] = []

    def add_request(self, request_id, prompt_ids, params, oracle=None, generator=None) -> None:
        seed = None if generator is None else generator.initial_seed()
        self.calls.append(("add", request_id, list(prompt_ids), seed))
        self.scheduler.known.add(request_id)

    def abort(self, request_id: str) -> None:
        self.calls.append(("abort", request_id))
        self.scheduler.known.discard(request_id)

    def step(self) -> list[StepOutput]:
        self.calls.append(("step",))
        return [StepOutput(rid, [1], True, "length", 0.0) for rid in sorted(self.scheduler.known)]

    def collect(self, request_id: str) -> None:
        self.calls.append(("collect", request_id))
        self.scheduler.known.discard(request_id)


GREEDY = SamplingParams(max_tokens=2)
SAMPLED = SamplingParams(max_tokens=2, temperature=1.0, seed=11)


def test_a_follower_repeats_rank_0s_calls_and_steps_until_the_stop_marker(monkeypatch) -> None:
    """Adds with rank 0's seeds, aborts of the requests it still holds (one it finished is
    not aborted again), a step per "step" message and none at an idle one, finished requests
    collected; SIGTERM and SIGINT ignored meanwhile (rank 0 decides when to stop)."""
    messages = [
        ("idle", [("add", "a", [1, 2], GREEDY, None)]),
        ("step", [("add", "b", [3], SAMPLED, 11)]),
        ("idle", [("add", "c", [4], GREEDY, None)]),
        ("step", [("abort", "a"), ("abort", "c")]),
        ("stop", [("add", "d", [5], GREEDY, None)]),
    ]

    def broadcast(message: list, src: int) -> None:
        assert src == 0
        message[0] = messages.pop(0)

    monkeypatch.setattr(followers.dist, "broadcast_object_list", broadcast)
    engine = RecordingEngine()
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        follow(engine, None)
        ignored = [signal.getsignal(sig) for sig in before]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert ignored == [signal.SIG_IGN, signal.SIG_IGN]
    assert engine.calls == [
        ("add", "a", [1, 2], None),
        ("add", "b", [3], 11),
        ("step",),
        ("collect", "a"),
        ("collect", "b"),
        ("add", "c", [4], None),
        ("abort", "c"),  # "a" finished here already
        ("step",),
        ("add", "d", [5], None),
    ]
    assert messages == []


def test_rank_0_sends_its_calls_once_before_the_next_step_and_an_idle_heartbeat_only_when_due(
    monkeypatch,
) -> None:
    sent: list[tuple] = []
    monkeypatch.setattr(followers.dist, "broadcast_object_list", lambda message, src: sent.append(message[0]))
    engine = RecordingEngine()
    leading = LeadingEngine(engine)
    leading.idle()
    assert sent == []  # nothing to send and the last message is recent
    leading.add_request("a", [1, 2], GREEDY)
    leading.idle()
    assert sent == [("idle", [("add", "a", [1, 2], GREEDY, None)])]
    leading.idle()
    leading.step()
    assert sent[1:] == [("step", [])] and engine.calls[-2:] == [("add", "a", [1, 2], None), ("step",)]
    leading.sent_s -= followers.HEARTBEAT_S  # a second of silence
    leading.idle()
    leading.idle()
    assert sent[2:] == [("idle", [])]
    leading.abort("a")
    leading.close()
    assert sent[3:] == [("stop", [("abort", "a")])]


def test_a_broadcast_that_fails_is_followers_lost_naming_the_cause(monkeypatch) -> None:
    def broken(message, src) -> None:
        raise ConnectionResetError("peer gone")

    monkeypatch.setattr(followers.dist, "broadcast_object_list", broken)
    with pytest.raises(FollowersLost, match="the follower ranks are gone: ConnectionResetError: peer gone"):
        LeadingEngine(RecordingEngine()).step()


# ------------------------------------------------------------------ the served engine
def test_serve_refuses_a_block_size_or_a_forced_acceptance_without_a_draft(served_pair) -> None:
    target, _ = served_pair
    with pytest.raises(ReferenceEngineError, match="--block-size needs --dflash-draft-model-path"):
        build_engine(serve("--model", target, "--device", "cpu", "--block-size", "4"))
    with pytest.raises(ReferenceEngineError, match="--oracle-acceptance needs --dflash-draft-model-path"):
        build_engine(serve("--model", target, "--device", "cpu", "--oracle-acceptance", "2"))


def test_the_served_engine_takes_its_queue_and_block_from_the_command_line(served_pair) -> None:
    target, draft = served_pair
    plain, tp, oracle = build_engine(serve("--model", target, "--device", "cpu", "--max-waiting", "3"))
    assert (plain.config.max_waiting, tp, oracle) == (3, None, None)
    assert EngineInfo.of(plain).block_size is None and not EngineInfo.of(plain).speculative
    argv = ["--model", target, "--dflash-draft-model-path", draft, "--device", "cpu", "--max-num-seqs", "2"]
    engine, _, _ = build_engine(serve(*argv))
    info = EngineInfo.of(engine)
    assert (info.block_size, info.speculative, info.max_num_seqs) == (4, True, 2)
    assert engine.config.max_waiting == 256  # serve's default, not the engine's


def test_a_forced_acceptance_is_checked_at_start_and_forced_on_greedy_requests_only(served_pair) -> None:
    target, draft = served_pair
    argv = ["--model", target, "--dflash-draft-model-path", draft, "--device", "cpu"]
    with pytest.raises(
        ReferenceEngineError, match=r"oracle acceptance length must be in \[1, 4\] .* got 5.0"
    ):
        build_engine(serve(*argv, "--oracle-acceptance", "5"))
    _, _, make_oracle = build_engine(serve(*argv, "--oracle-acceptance", "2.5"))
    assert make_oracle(GREEDY) is not None and make_oracle(SAMPLED) is None


def test_the_cpu_note_on_a_half_precision_checkpoint_suggests_only_a_dtype_the_commands_take(
    tmp_path, capsys
) -> None:
    for half in ("bfloat16", "float16"):
        (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": half}))
        assert resolve_dtype("auto", str(tmp_path), torch.device("cpu")) == torch.float32
        note = capsys.readouterr().err
        assert f"runs the {half} checkpoint in float32 on the CPU" in note
        for suggested in re.findall(r"--dtype (\w+) keeps its own", note):
            assert serve("--dtype", suggested).dtype == suggested  # a value serve takes
    assert "--dtype float16" not in note


# ------------------------------------------------------------------ --device
@pytest.mark.parametrize("name", ["meta", "mps", "nonsense"])
def test_a_device_other_than_cpu_or_cuda_is_refused_by_name(name: str) -> None:
    with pytest.raises(RequestError, match=f"unknown --device '{name}', expected auto, cpu, cuda or cuda:N"):
        resolve_device(name)


def test_a_cuda_device_past_the_machines_count_is_refused_at_start(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1") and resolve_device("cuda").type == "cuda"
    with pytest.raises(
        RequestError, match=r"--device cuda:2 asked for, but this machine has 2 CUDA device\(s\)"
    ):
        resolve_device("cuda:2")


def test_the_engine_loop_is_a_process_on_one_gpu_and_a_thread_at_two_ranks(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert engine_loop_mode(serve("--device", "cuda")) == "process"
    assert engine_loop_mode(serve("--device", "cuda", "--tensor-parallel-size", "2")) == "thread"
    assert engine_loop_mode(serve("--device", "cpu")) == "thread"


# ------------------------------------------------------------------ generate and make-tiny
def test_generate_refuses_a_block_size_without_a_draft_as_serve_does(served_pair, capsys) -> None:
    target, _ = served_pair
    status = generate_main(
        ["--model", target, "--prompt-ids", "1,2", "--max-tokens", "2", "--block-size", "4"]
    )
    out, err = capsys.readouterr()
    assert (status, out) == (2, "")
    assert err == "error: --block-size needs --draft (--dflash-draft-model-path)\n"


def test_generate_with_a_draft_runs_and_reports_the_block_size_commit_and_context_given(
    served_pair, capsys
) -> None:
    target, draft = served_pair  # the draft's own block size is 4
    argv = ["--model", target, "--draft", draft, "--prompt-ids", "1,2,3", "--max-tokens", "6"]
    argv += ["--block-size", "3", "--commit-strategy", "per_token", "--ignore-eos", "--json"]
    assert generate_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["block_size"], out["commit_strategy"]) == (3, "per_token")
    assert sum(out["acceptance_lengths"]) + 1 == len(out["output_ids"]) == 6
    assert max(out["acceptance_lengths"]) <= 3
    assert generate_main([*argv, "--max-model-len", "8"]) == 2
    assert "exceeds the context of 8 tokens" in capsys.readouterr().err


def test_generate_stops_at_the_checkpoints_eos_unless_told_to_ignore_it(
    served_pair, tmp_path, capsys
) -> None:
    target = tmp_path / "target"
    shutil.copytree(served_pair[0], target)
    argv = ["--model", str(target), "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json"]
    assert generate_main(argv) == 0
    first = json.loads(capsys.readouterr().out)["output_ids"][0]
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "eos_token_id": first}))
    assert generate_main(argv) == 0
    stopped = json.loads(capsys.readouterr().out)
    assert (stopped["output_ids"], stopped["finish_reason"]) == ([first], "stop")
    assert generate_main([*argv, "--ignore-eos"]) == 0
    ignored = json.loads(capsys.readouterr().out)
    assert (len(ignored["output_ids"]), ignored["finish_reason"]) == (4, "length")


def test_make_tiny_without_options_writes_what_the_python_api_writes_by_default(
    served_pair, tmp_path, capsys
) -> None:
    target = served_pair[0]
    assert checkpoint_main(["make-tiny", "--arch", "qwen3", "--out", str(tmp_path / "cli")]) == 0
    draft_argv = ["make-tiny", "--arch", "dflash", "--target", target, "--out", str(tmp_path / "dcli")]
    assert checkpoint_main(draft_argv) == 0
    written = {
        "cli": tmp_path / "cli",
        "api": make_tiny_target(tmp_path / "api", arch="qwen3"),
        "dcli": tmp_path / "dcli",
        "dapi": make_tiny_draft(tmp_path / "dapi", target),
    }
    for cli, api in (("cli", "api"), ("dcli", "dapi")):
        for name in ("config.json", "model.safetensors"):
            assert (written[cli] / name).read_bytes() == (written[api] / name).read_bytes(), (cli, name)
    files = {name: sorted(p.name for p in folder.iterdir()) for name, folder in written.items()}
    assert files["cli"] == files["api"] and files["dcli"] == files["dapi"]
    assert capsys.readouterr().out.split() == [str(tmp_path / "cli"), str(tmp_path / "dcli")]


def test_make_tiny_writes_a_draft_of_the_seed_and_dtype_asked_and_needs_its_target(
    served_pair, tmp_path, capsys
) -> None:
    out = tmp_path / "draft"
    argv = ["make-tiny", "--arch", "dflash", "--out", str(out), "--dtype", "bfloat16"]
    assert checkpoint_main([*argv, "--target", served_pair[0], "--block-size", "4", "--seed", "3"]) == 0
    same = make_tiny_draft(tmp_path / "api", served_pair[0], block_size=4, seed=3, dtype=torch.bfloat16)
    assert (out / "model.safetensors").read_bytes() == (same / "model.safetensors").read_bytes()
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(SystemExit) as stop:
        checkpoint_main([*argv[:-2], "--out", str(tmp_path / "none")])
    assert stop.value.code == 2 and "--arch dflash needs --target DIR" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [[], ["--multimodal-wrapper"]], ids=["text", "wrapper"])
def test_a_tiny_bfloat16_checkpoint_names_bfloat16_so_dtype_auto_keeps_it_on_cuda(tmp_path, flags) -> None:
    out = tmp_path / "tiny"
    argv = ["make-tiny", "--arch", "qwen3_5", "--out", str(out), "--dtype", "bfloat16", *flags]
    assert checkpoint_main(argv) == 0
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    assert resolve_dtype("auto", str(out), torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize("arch", ["qwen3", "dflash"])
def test_make_tiny_refuses_zero_layers_instead_of_writing_its_default(
    served_pair, tmp_path, capsys, arch: str
) -> None:
    argv = ["make-tiny", "--arch", arch, "--out", str(tmp_path / "tiny"), "--layers", "0"]
    status = checkpoint_main([*argv, "--target", served_pair[0]] if arch == "dflash" else argv)
    assert status == 2 and "got 0" in capsys.readouterr().err
    assert not (tmp_path / "tiny" / "config.json").exists()


# ------------------------------------------------------------------ the recipe's settings
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_files": 1}, "max_files must be a whole number of at least 2, got 1"),
        ({"seq_len": 79}, "seq_len must hold a prompt and one block"),  # 64 + 16 > 79
        (
            {"target_layer_ids": (0, 6)},
            r"target_layer_ids \[0, 6\]: give one or more of the target's 6 layers, 0 to 5",
        ),
        ({"train_block_sizes": (8, 32)}, "block sizes cannot exceed block_size"),
        ({"eval_block_sizes": (4, 32)}, "block sizes cannot exceed block_size"),
        ({"short_block_share": 1.01}, r"short_block_share must be in \[0, 1\], got 1.01"),
        ({"short_block_share": -0.1}, r"short_block_share must be in \[0, 1\], got -0.1"),
        ({"selector_top_k": 0}, r"selector_top_k must be in \[1, 4096\], got 0"),
        ({"selector_top_k": 4097}, r"selector_top_k must be in \[1, 4096\], got 4097"),
        ({"selector_loss_weight": -1.0}, "selector_loss_weight must be a finite number >= 0, got -1.0"),
        ({"conv_group_size": 24}, "conv_group_size 24 does not divide hidden_size 256"),
        ({"draft_arch": "eagle"}, "draft_arch must be one of dflash, dflash2, got 'eagle'"),
    ],
)
def test_a_recipe_outside_what_it_can_train_is_refused_naming_the_setting(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(Recipe(), **change)


def test_a_recipe_at_each_bound_is_taken() -> None:
    at_bounds = {
        "max_files": 2,
        "seq_len": 80,  # a prompt of 64 and a block of 16 exactly
        "target_layer_ids": (0, 5),
        "train_block_sizes": (16,),
        "eval_block_sizes": (16,),
        "short_block_share": 1.0,
        "selector_top_k": 4096,
        "selector_loss_weight": 0.0,
        "conv_group_size": 256,
    }
    for name, value in at_bounds.items():
        assert getattr(dataclasses.replace(Recipe(), **{name: value}), name) == value
    assert dataclasses.replace(Recipe(), short_block_share=0.0).short_block_share == 0.0


def test_each_draft_arch_has_its_own_stage_folder_and_results_file() -> None:
    dflash, dflash2 = Recipe(), Recipe(draft_arch="dflash2")
    assert (dflash.draft_stage, dflash.results_file) == ("draft", "training.json")
    assert (dflash2.draft_stage, dflash2.results_file) == ("draft-dflash2", "training-dflash2.json")


# ------------------------------------------------------------------ the recipe's schedules and figures
def test_the_learning_rate_warms_up_linearly_to_the_peak_then_decays_to_a_tenth() -> None:
    steps, peak, warmup = 110, 2.0, 10
    assert [lr_at(step, steps, peak, warmup) for step in range(3)] == pytest.approx([0.2, 0.4, 0.6])
    assert lr_at(warmup - 1, steps, peak, warmup) == pytest.approx(peak)
    assert lr_at(warmup, steps, peak, warmup) == pytest.approx(peak)  # the cosine starts at the peak
    assert lr_at(warmup + 50, steps, peak, warmup) == pytest.approx(peak * 0.55)  # halfway
    assert lr_at(steps, steps, peak, warmup) == pytest.approx(peak / 10)


def test_the_loss_curve_averages_the_steps_since_its_previous_point() -> None:
    losses = [float(i) for i in range(20)]
    assert loss_curve(losses, points=4) == [(5, 2.0), (10, 7.0), (15, 12.0), (20, 17.0)]
    assert loss_curve([1.0, 3.0], points=10) == [(1, 1.0), (2, 3.0)]  # fewer steps than points
    assert loss_curve([]) == []


def test_the_final_loss_is_the_mean_of_the_last_fifty_steps_or_of_all_when_fewer() -> None:
    assert mean_tail([float(i) for i in range(100)]) == pytest.approx(74.5)
    assert mean_tail([1.0, 2.0, 6.0]) == pytest.approx(3.0)


def test_optimise_warms_up_over_a_tenth_of_the_steps_and_keeps_the_best_validated_weights() -> None:
    """AdamW's first update of an undecayed parameter is the learning rate itself, so the
    bias's first move reads the warm-up's first rate: peak / (steps // 10). The weights
    kept are those of the lowest validation score."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    biases: list[float] = []  # before each step
    kept: list[float] = []  # at each validation
    scores = iter([3.0, 1.0, 2.0, 4.0] * 5)

    def loss_at(step: int) -> torch.Tensor:
        biases.append(model.bias.item())
        return (model(torch.ones(1, 2)) - 5.0).pow(2).sum()

    def validate() -> float:
        kept.append(model.bias.item())
        return next(scores)

    fit = optimise(model, 20, 0.1, loss_at, log=lambda _: None, what="t", validate=validate, validate_every=1)
    assert abs(biases[1] - biases[0]) == pytest.approx(0.1 / 2, rel=1e-4)  # warm-up of 2 steps
    assert (fit["best_step"], fit["best_score"]) == (2, 1.0)
    assert model.bias.item() == pytest.approx(kept[1]) and len(fit["losses"]) == 20


def test_each_seed_and_stage_draws_its_own_batches() -> None:
    draws = {
        (seed, stage): torch.rand(4, generator=generator(seed, stage)).tolist()
        for seed in (0, 1)
        for stage in (0, 1)
    }
    assert len({tuple(d) for d in draws.values()}) == 4
    assert torch.rand(4, generator=generator(1, 0)).tolist() == draws[1, 0]


def locked_wheels(folder: Path, files: dict[str, dict[str, str]], heldout: set[str]) -> Path:
    """Wheels of the given package files, served from file:// URLs, and their lock."""
    rows = []
    for name, members in files.items():
        wheel = folder / f"{name}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            for member, text in members.items():
                archive.writestr(member, text)
        data = wheel.read_bytes()
        rows.append(
            {
                "name": name,
                "version": "1.0",
                "filename": wheel.name,
                "url": wheel.as_uri(),
                "sha256": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "heldout": name in heldout,
            }
        )
    lock = folder / "lock.json"
    lock.write_text(json.dumps({"wheels": rows}))
    return lock


def test_a_smoke_corpus_keeps_the_first_files_and_at_least_one_held_out_and_no_empty_files(tmp_path) -> None:
    train = {f"a/m{i}.py": f"x = {i}\n" for i in range(6)} | {
        "a/__init__.py": "",
        "a/_vendor/b/v.py": "y = 1\n",
    }
    lock = locked_wheels(tmp_path, {"a": train, "b": {"b/one.py": "z = 1\n", "b/two.py": "z = 2\n"}}, {"b"})
    whole = Corpus.from_lock(tmp_path / "cache", lock, log=lambda _: None)
    assert [p.split(":")[1] for p in whole.train] == [f"a/m{i}.py" for i in range(6)]  # no empty, no vendored
    assert [p.split(":")[1] for p in whole.heldout] == ["b/one.py", "b/two.py"]
    smoke = Corpus.from_lock(tmp_path / "cache", lock, max_files=4, log=lambda _: None)
    assert (len(smoke.train), len(smoke.heldout)) == (4, 1)


def test_a_cached_wheel_changed_after_its_download_is_refused(tmp_path) -> None:
    lock = locked_wheels(tmp_path, {"a": {"a/m.py": "x = 1\n"}, "b": {"b/m.py": "y = 1\n"}}, {"b"})
    Corpus.from_lock(tmp_path / "cache", lock, log=lambda _: None)
    with zipfile.ZipFile(tmp_path / "cache" / "a-1.0-py3-none-any.whl", "a") as archive:
        archive.writestr("a/extra.py", "z = 1\n")
    with pytest.raises(CorpusError, match="a-1.0-py3-none-any.whl: sha256 differs from the lock .delete it"):
        Corpus.from_lock(tmp_path / "cache", lock, log=lambda _: None)


def test_the_tokenizer_learns_from_files_across_the_whole_train_set() -> None:
    """A character budget of half the corpus takes every other file, so the last files'
    words are learned too, not only the first files'."""
    texts = ["alpha " * 200] * 5 + ["omega " * 200] * 5
    tokenizer = train_tokenizer(texts, vocab_size=300, max_chars=sum(map(len, texts)) // 2)
    assert len(tokenizer.encode("omega").ids) == 1 and len(tokenizer.encode("alpha").ids) == 1


class HeldOut:
    """Held-out files of `sizes` token ids each (the text of a file is its ids)."""

    def __init__(self, sizes: list[int]) -> None:
        self.heldout = tuple(f"w.whl:f{n}.py" for n in sizes)

    def text(self, path: str) -> str:
        return path


class IdsOfName:
    """A tokenizer whose ids of a file `w.whl:fN.py` are 0..N-1."""

    def encode(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(ids=list(range(int(text.split(":f")[1].removesuffix(".py")))))

    def decode(self, ids: list[int]) -> str:
        return ",".join(map(str, ids))


def test_held_out_prompts_come_one_per_file_long_enough_for_two_prompts() -> None:
    recipe = Recipe(prompt_len=64, eval_prompts=3)
    prompts = heldout_prompts(HeldOut([100, 127, 128, 300, 500]), IdsOfName(), recipe)
    assert sorted(p["file"] for p in prompts) == sorted(["w.whl:f128.py", "w.whl:f300.py", "w.whl:f500.py"])
    for prompt in prompts:
        size = int(prompt["file"].split(":f")[1].removesuffix(".py"))
        start = prompt["prompt_ids"][0]
        assert prompt["prompt_ids"] == list(range(start, start + 64)) and start + 64 <= size
    assert len(heldout_prompts(HeldOut([300, 400, 500]), IdsOfName(), Recipe(eval_prompts=2))) == 2
