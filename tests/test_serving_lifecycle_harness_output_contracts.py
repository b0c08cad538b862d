"""What the server's shutdown policy, its tensor-parallel followers and its chat templates
promise, and what the harness's tokenizer, verdict and output folder promise, checked where
they are decided (reference_engine/serving/lifecycle.py, followers.py, chat_template.py;
harness/tokens.py, outcome.py, output.py). No server starts: the policies are driven directly,
the followers' broadcast is replaced by a list, and the harness's pieces are called on small
files each test writes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import uvicorn

from harness.__main__ import main as harness_main
from harness.outcome import verdict_line
from harness.output import OutputError, check, claim
from harness.tokens import TextTokenizer
from reference_engine.demo import DEMO_TARGET
from reference_engine.runtime.outputs import StepOutput
from reference_engine.runtime.request import SamplingParams
from reference_engine.serving import followers
from reference_engine.serving.async_engine import EngineTotals
from reference_engine.serving.chat_template import compile_chat_template, render_chat_template
from reference_engine.serving.followers import LeadingEngine, follow
from reference_engine.serving.lifecycle import GracefulServer, Lifecycle

from .server_process import REPO, free_port

MESSAGES = [{"role": "user", "content": "hi"}]
GREEDY = SamplingParams(max_tokens=2)
SAMPLED = SamplingParams(max_tokens=2, temperature=1.0, seed=11)


# ------------------------------------------------------------------ chat_template.py
def test_tojson_takes_the_separators_sort_keys_and_ensure_ascii_a_template_asks_for() -> None:
    """A template's own `tojson(...)` arguments are json.dumps's: compact separators, sorted
    keys and escaped non-ASCII when it asks for them, as transformers renders it."""
    source = "{{ messages[0] | tojson(separators=(',', ':'), sort_keys=true, ensure_ascii=true) }}"
    messages = [{"role": "user", "content": "é"}]
    text = render_chat_template(compile_chat_template(source), messages)
    assert text == json.dumps(messages[0], separators=(",", ":"), sort_keys=True, ensure_ascii=True)
    assert text == '{"content":"\\u00e9","role":"user"}'


def test_strftime_now_formats_the_current_time_as_the_template_asks() -> None:
    """strftime_now(format) is now in the template's format, not a fixed one (Llama 3.x
    templates print "%d %b %Y")."""
    template = compile_chat_template('{{ strftime_now("%d %b %Y") }}')
    before = datetime.now().strftime("%d %b %Y")
    text = render_chat_template(template, MESSAGES)
    after = datetime.now().strftime("%d %b %Y")
    assert text in {before, after}


# ------------------------------------------------------------------ followers.py
class Engine:
    """An engine's request surface, recording what it took; `refuse` makes add_request raise,
    `unfinished` leaves requests running after a step, `fail_steps` makes steps raise."""

    device = torch.device("cpu")

    def __init__(self, log: list | None = None) -> None:
        self.scheduler = SimpleNamespace(known=set())
        self.log = [] if log is None else log
        self.refuse = False
        self.unfinished: set[str] = set()
        self.fail_steps = 0

    def add_request(self, request_id, prompt_ids, params, oracle=None, generator=None) -> None:
        if self.refuse:
            raise ValueError("prompt too long")
        seed = None if generator is None else generator.initial_seed()
        self.log.append(("add", request_id, seed, oracle))
        self.scheduler.known.add(request_id)

    def abort(self, request_id: str) -> None:
        self.log.append(("abort", request_id))
        self.scheduler.known.discard(request_id)

    def step(self) -> list[StepOutput]:
        self.log.append(("step",))
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("out of memory")
        return [
            StepOutput(rid, [1], rid not in self.unfinished, None, 0.0)
            for rid in sorted(self.scheduler.known)
        ]

    def collect(self, request_id: str) -> None:
        self.log.append(("collect", request_id))
        self.scheduler.known.discard(request_id)


def run_follower(monkeypatch, engine: Engine, messages: list, make_oracle=None) -> None:
    """`follow` on `messages`, rank 0's broadcasts, with the process's signal handlers kept."""

    def broadcast(message: list, src: int) -> None:
        message[0] = messages.pop(0)

    monkeypatch.setattr(followers.dist, "broadcast_object_list", broadcast)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        follow(engine, make_oracle)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_sampled_request_with_its_own_seed_is_sent_and_drawn_with_that_seed(monkeypatch) -> None:
    """rank 0 draws a seed only for a sampled request without one: a request's own seed is
    the one every rank seeds its generator with."""
    sent: list = []
    monkeypatch.setattr(followers.dist, "broadcast_object_list", lambda message, src: sent.append(message[0]))
    engine = Engine()
    leading = LeadingEngine(engine)
    leading.add_request("b", [3], SAMPLED)
    leading.step()
    assert sent == [("step", [("add", "b", [3], SAMPLED, 11)])]
    assert engine.log[0] == ("add", "b", 11, None)


def test_a_request_rank_0_refuses_is_never_sent_to_the_followers(monkeypatch) -> None:
    """An add that fails on rank 0 (the request is answered with its error) is not recorded,
    so the followers never hold a request rank 0 does not."""
    sent: list = []
    monkeypatch.setattr(followers.dist, "broadcast_object_list", lambda message, src: sent.append(message[0]))
    engine = Engine()
    leading = LeadingEngine(engine)
    engine.refuse = True
    with pytest.raises(ValueError, match="prompt too long"):
        leading.add_request("a", [1], GREEDY)
    leading.step()
    assert sent == [("step", [])]


def test_rank_0_aborts_in_its_own_engine_and_sends_the_abort(monkeypatch) -> None:
    sent: list = []
    monkeypatch.setattr(followers.dist, "broadcast_object_list", lambda message, src: sent.append(message[0]))
    engine = Engine()
    leading = LeadingEngine(engine)
    leading.add_request("a", [1], GREEDY)
    leading.abort("a")
    assert engine.log == [("add", "a", None, None), ("abort", "a")]
    assert "a" not in engine.scheduler.known
    leading.close()
    assert sent == [("stop", [("add", "a", [1], GREEDY, None), ("abort", "a")])]


def test_rank_0_sends_the_calls_before_it_steps_its_own_engine(monkeypatch) -> None:
    """The followers get the step message before rank 0's engine steps: rank 0's step runs
    collectives the followers must join."""
    log: list = []
    monkeypatch.setattr(followers.dist, "broadcast_object_list", lambda message, src: log.append(message[0]))
    leading = LeadingEngine(Engine(log))
    leading.add_request("a", [1], GREEDY)
    leading.step()
    assert log == [("add", "a", None, None), ("step", [("add", "a", [1], GREEDY, None)]), ("step",)]


def test_a_follower_builds_each_added_requests_oracle_from_its_params(monkeypatch) -> None:
    """With a `make_oracle`, each request a follower adds gets the oracle made from its
    sampling params, as rank 0's does."""
    engine = Engine()
    messages = [("idle", [("add", "a", [1], GREEDY, None), ("add", "b", [2], SAMPLED, 11)]), ("stop", [])]
    run_follower(monkeypatch, engine, messages, make_oracle=lambda params: ("oracle", params.temperature))
    assert engine.log == [("add", "a", None, ("oracle", 0.0)), ("add", "b", 11, ("oracle", 1.0))]


def test_a_follower_collects_only_the_requests_that_finished_at_a_step(monkeypatch) -> None:
    engine = Engine()
    engine.unfinished = {"b"}
    messages = [("step", [("add", "a", [1], GREEDY, None), ("add", "b", [2], GREEDY, None)]), ("stop", [])]
    run_follower(monkeypatch, engine, messages)
    assert [c for c in engine.log if c[0] == "collect"] == [("collect", "a")]
    assert engine.scheduler.known == {"b"}


def test_a_follower_whose_step_fails_keeps_following_rank_0(monkeypatch) -> None:
    """A failed step is rank 0's to answer: the follower logs it and takes the next message
    (here rank 0's aborts and another step) instead of leaving the group."""
    engine = Engine()
    engine.fail_steps = 1
    messages = [
        ("step", [("add", "a", [1], GREEDY, None)]),
        ("step", [("abort", "a"), ("add", "b", [2], GREEDY, None)]),
        ("stop", []),
    ]
    run_follower(monkeypatch, engine, messages)
    assert messages == []
    assert engine.log[1:] == [
        ("step",),
        ("abort", "a"),
        ("add", "b", None, None),
        ("step",),
        ("collect", "b"),
    ]


# ------------------------------------------------------------------ lifecycle.py
class Runner:
    def __init__(self, alive: bool = True) -> None:
        self.alive = alive
        self.ended: list[str] = []
        self.totals = EngineTotals()

    def busy(self) -> bool:
        return True

    def end_all(self, reason: str) -> None:
        self.ended.append(reason)

    def shutdown(self) -> None:
        pass


async def _app(scope, receive, send) -> None:  # never called: the server is not started
    raise AssertionError("no request expected")


def graceful(grace_s: float, idle) -> tuple[GracefulServer, list[str]]:
    events: list[str] = []
    config = uvicorn.Config(_app, log_level="critical")
    server = GracefulServer(
        config, grace_s, lambda: events.append("drain"), lambda: events.append("deadline"), idle
    )
    return server, events


def test_a_second_signal_during_the_drain_ends_the_drain_at_once() -> None:
    """After the second signal the drain stops waiting out its grace period: it ends within
    a moment, not 30 s later."""
    server, events = graceful(30.0, idle=lambda: False)

    async def two_signals() -> float:
        server.handle_exit(signal.SIGTERM, None)
        await asyncio.sleep(0.2)  # the drain is waiting
        server.handle_exit(signal.SIGTERM, None)
        start = time.monotonic()
        while [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
            await asyncio.sleep(0.02)
            if time.monotonic() - start > 5:
                break
        return time.monotonic() - start

    assert asyncio.run(two_signals()) < 5
    assert events[:2] == ["drain", "deadline"] and server.should_exit


def test_the_drain_ends_the_requests_left_once_the_grace_period_is_over() -> None:
    """The drain waits `grace_s`, not longer, before ending the requests still in flight."""
    server, events = graceful(1.0, idle=lambda: False)
    start = time.monotonic()
    asyncio.run(server._drain(signal.SIGTERM, None))
    assert 0.99 <= time.monotonic() - start < 1.9  # twice the grace would be 2 s
    assert events == ["deadline"]


def test_a_draining_server_says_draining_on_health_whatever_its_engine_loop() -> None:
    """From the first signal /health says "draining", even when the engine loop has not
    started or is gone."""
    lifecycle = Lifecycle(lambda: Runner(), grace_s=1.0)
    lifecycle.drain()
    assert lifecycle.health() == ({"status": "draining"}, 503)
    lifecycle.runner = Runner(alive=False)
    assert lifecycle.health() == ({"status": "draining"}, 503)


@pytest.mark.parametrize(("grace_s", "named"), [(30.0, "30"), (0.25, "0.25"), (120, "120")])
def test_the_deadline_names_the_grace_period_as_it_is_written_on_the_command_line(
    grace_s: float, named: str
) -> None:
    runner = Runner()
    lifecycle = Lifecycle(lambda: runner, grace_s=grace_s)
    lifecycle.runner = runner
    lifecycle.deadline()
    assert runner.ended == [f"the server shut down before this request finished (--shutdown-grace {named} s)"]


def test_a_deadline_before_the_engine_loop_started_ends_nothing() -> None:
    """A signal while the app starts: the deadline has no request to end and does not fail."""
    lifecycle = Lifecycle(lambda: Runner(), grace_s=1.0)
    lifecycle.deadline()
    assert lifecycle.idle() and lifecycle.runner is None


# ------------------------------------------------------------------ tokens.py
def test_the_tokenizer_takes_a_folder_or_its_tokenizer_json_and_keeps_the_path_given() -> None:
    """--tokenizer DIR or --tokenizer DIR/tokenizer.json load the same tokenizer; `path` is
    what was given (the comparison's identity records it)."""
    by_dir = TextTokenizer(DEMO_TARGET)
    by_file = TextTokenizer(DEMO_TARGET / "tokenizer.json")
    assert by_dir.path == str(DEMO_TARGET)
    assert by_file.path == str(DEMO_TARGET / "tokenizer.json")
    assert by_file.encode("hello world") == by_dir.encode("hello world") != []


def test_a_tokenizer_folder_without_tokenizer_json_is_refused_with_one_line(tmp_path, capsys) -> None:
    with pytest.raises(ValueError, match="no tokenizer.json there"):
        TextTokenizer(tmp_path)
    status = harness_main(
        ["bench", "--base-url", f"http://127.0.0.1:{free_port()}", "--tokenizer", str(tmp_path)]
        + ["--num-prompts", "1", "--warmup", "0", "--out", str(tmp_path / "out")]
    )
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"error: --tokenizer {tmp_path}: no tokenizer.json there"


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory) -> Path:
    """The demo tokenizer with a post-processor that puts <|endoftext|> before every text, as
    a tokenizer with a BOS token does."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    tokenizer = Tokenizer.from_file(str(DEMO_TARGET / "tokenizer.json"))
    bos = tokenizer.token_to_id("<|endoftext|>")
    tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", bos)]
    )
    out = tmp_path_factory.mktemp("bos-tokenizer")
    tokenizer.save(str(out / "tokenizer.json"))
    return out


def test_streamed_text_is_counted_without_the_tokenizers_special_tokens(bos_tokenizer) -> None:
    """Counting a server's text counts its tokens only: no BOS the tokenizer would put in
    front of a prompt."""
    plain = TextTokenizer(DEMO_TARGET)
    with_bos = TextTokenizer(bos_tokenizer)
    text = "hello world"
    assert with_bos.encode(text) == plain.encode(text)
    assert with_bos.count(text) == plain.count(text) == len(plain.encode(text))


def test_decoding_keeps_special_tokens_and_a_token_reads_as_its_text() -> None:
    """Decoded ids keep special tokens (<|im_end|> is part of what was generated), and one
    token's text is its decoded text, not the vocabulary's byte-level spelling."""
    tokenizer = TextTokenizer(DEMO_TARGET)
    text = "<|im_start|>user hello world<|im_end|>"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    first = tokenizer.encode(" hello")[0]
    assert tokenizer.token_text(first) == tokenizer.decode([first])
    assert tokenizer.token_text(first).startswith(" ") and "\u0120" not in tokenizer.token_text(first)


# ------------------------------------------------------------------ outcome.py
def row(concurrency: int, completed: int, failed: int, errors: str = "", repeat: int = 0) -> dict:
    return {
        "label": "A",
        "concurrency": concurrency,
        "repeat": repeat,
        "completed": completed,
        "failed": failed,
        "errors": errors,
    }


def test_a_run_failing_exactly_the_allowed_share_passes() -> None:
    """--max-failure-rate is the largest share tolerated: a run at it passes."""
    assert verdict_line([row(1, 3, 1), row(2, 4, 0)], max_failure_rate=0.25) is None
    assert verdict_line([row(1, 3, 1)], max_failure_rate=0.24) is not None


def test_the_first_error_quoted_is_a_failed_runs_cut_at_200_characters() -> None:
    """The error the verdict quotes comes from a run that failed, not from one within the
    threshold, and is cut at 200 characters."""
    tolerated = row(1, 3, 1, errors="HTTP 429: slow down")
    failed = row(2, 1, 3, errors="HTTP 500: " + "x" * 300)
    line = verdict_line([tolerated, failed], max_failure_rate=0.5)
    assert line is not None and "429" not in line
    assert line.endswith("; first error: " + ("HTTP 500: " + "x" * 300)[:200])


def test_exactly_four_failed_runs_are_all_named_and_no_more_claimed() -> None:
    rows = [row(c, 3, 1) for c in (1, 2, 4, 8)]
    line = verdict_line(rows, max_failure_rate=0.0)
    assert line == (
        "benchmark failed: 4 of 4 runs failed more than --max-failure-rate 0 of their requests "
        "(A c=1 r=0 1/4, A c=2 r=0 1/4, A c=4 r=0 1/4, A c=8 r=0 1/4)"
    )


def test_completed_requests_are_counted_over_every_run() -> None:
    """A benchmark whose first run completed nothing but whose others did has completed
    requests: its verdict is about the failure rates, not "no request completed"."""
    line = verdict_line([row(1, 0, 4), row(2, 4, 0)], max_failure_rate=0.5)
    assert line is not None and line.startswith("benchmark failed: 1 of 2 runs failed"), line


# ------------------------------------------------------------------ output.py
def test_claim_makes_every_missing_parent_folder(tmp_path) -> None:
    out = tmp_path / "a" / "b" / "out"
    claim(out).release()
    assert out.is_dir()


def test_a_check_leaves_the_folder_as_it_found_it(tmp_path) -> None:
    """The probe file is written and removed, and `python -m harness.output DIR` (how
    scripts/profile.sh checks its folder) takes no lock: the folder stays empty."""
    check(tmp_path / "checked")
    assert os.listdir(tmp_path / "checked") == []
    done = subprocess.run(
        [sys.executable, "-m", "harness.output", str(tmp_path / "cli")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert os.listdir(tmp_path / "cli") == []


def test_the_output_check_on_the_command_line_refuses_with_one_line_and_status_2(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "harness.output", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )

    refused = cli(str(blocker / "out"))
    assert refused.returncode == 2
    assert refused.stderr == f"error: cannot create the output folder {blocker / 'out'}: Not a directory\n"
    usage = cli(str(tmp_path / "x"), str(tmp_path / "y"))
    assert usage.returncode == 1 and usage.stderr.strip() == "usage: python -m harness.output DIR"
    assert not (tmp_path / "x").exists()


def test_a_folder_that_takes_no_file_is_refused_with_one_line(tmp_path) -> None:
    """Any failure to write the probe (here its name is taken by a folder) is an OutputError
    naming the folder, not a traceback."""
    out = tmp_path / "out"
    (out / ".write-check").mkdir(parents=True)
    with pytest.raises(OutputError, match=f"^cannot write into the output folder {out}: Is a directory$"):
        claim(out)


def test_room_is_measured_against_the_whole_need(tmp_path) -> None:
    """A folder with less room than asked is refused, even when it has more than half."""
    need = int(shutil.disk_usage(tmp_path).free * 1.5)
    with pytest.raises(OutputError, match="MiB free; a run needs at least"):
        check(tmp_path, min_free_bytes=need)


@pytest.mark.parametrize(("free_mib", "taken"), [(8, False), (15, False), (17, True)])
def test_by_default_a_run_needs_16_mib_free(tmp_path, monkeypatch, free_mib: int, taken: bool) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=free_mib * 2**20))
    if taken:
        claim(tmp_path).release()
    else:
        with pytest.raises(OutputError, match=f"has {free_mib}.0 MiB free; a run needs at least 16 MiB"):
            claim(tmp_path)


def test_a_released_folder_is_free_while_its_lock_object_lives_on(tmp_path) -> None:
    """`release` lets go of the folder at once, not when the lock object is collected: the
    same process can claim it again."""
    hold = claim(tmp_path)
    hold.release()
    again = claim(tmp_path)
    again.release()
    assert hold.file.closed and again.file.closed


def test_a_tokenizer_json_that_does_not_parse_is_refused_with_one_line(tmp_path, capsys) -> None:
    """--tokenizer naming a broken tokenizer.json is a bad argument like a missing one: exit
    status 2 and one error line naming it, no traceback, and no output folder left behind."""
    broken = tmp_path / "tok"
    broken.mkdir()
    (broken / "tokenizer.json").write_text('{"version": "1.0", ')
    status = harness_main(
        ["bench", "--base-url", f"http://127.0.0.1:{free_port()}", "--tokenizer", str(broken)]
        + ["--num-prompts", "1", "--warmup", "0", "--out", str(tmp_path / "out")]
    )
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and str(broken) in last
    assert not (tmp_path / "out").exists()  # refused before the output folder is made
