"""The harness client and metric math against a scripted SSE server on loopback."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest

from harness.client import Endpoint, RequestRecord, StreamReader
from harness.load import LoadSpec, client_processes_for, client_split, measure, merged_end, run_requests
from harness.metrics import calculate_metrics, chunk_itl, per_token_itl, tpot
from harness.workloads import Prompt, synthetic

from .sse_stub import Script, events, serve

# first chunk after 50 ms with 1 token, then 3 chunks 40 ms apart carrying 4, 1, 3 tokens
CHUNKS = [(0.05, [1]), (0.04, [2, 3, 4, 5]), (0.04, [6]), (0.04, [7, 8, 9])]


def one_record(script: Script):
    server, url = serve(script)
    try:
        spec = LoadSpec(concurrency=1, num_prompts=1, output_len=9, timeout_s=2.0)
        records, duration = asyncio.run(run_requests(Endpoint(url), synthetic(1, 4, 0), spec))
        return records[0], duration
    finally:
        server.shutdown()


def scripted_record(script: Script):
    """The client's reader fed the stub's own SSE text, each line at its scripted time: the
    timing rules, free of the machine's scheduling."""
    record = RequestRecord(index=0, send_s=0.0)
    reader = StreamReader(Endpoint("http://unused"), record)
    now = 0.0
    for delay, text in events(script):
        now += delay
        for line in text.split("\n"):
            if reader.feed(line, now):
                return reader.finish()
    return reader.finish()


def test_ttft_tpot_itl_e2e_equal_the_scripted_timing() -> None:
    record = scripted_record(Script(CHUNKS))
    assert record.success and record.output_tokens == 9 and record.done_marker
    assert record.chunk_tokens == [1, 4, 1, 3]
    assert record.ttft_s == pytest.approx(0.05, abs=1e-12)
    assert record.e2e_s == pytest.approx(0.17, abs=1e-12)
    assert tpot(record) == pytest.approx(0.12 / 8, abs=1e-12)
    assert chunk_itl(record) == pytest.approx([0.04, 0.04, 0.04], abs=1e-12)
    # each gap split among the tokens it brought
    assert per_token_itl(record) == pytest.approx([0.01] * 4 + [0.04] + [0.04 / 3] * 3, abs=1e-12)
    row = calculate_metrics([record], 0.2)
    assert row["output_tokens_per_s"] == pytest.approx(9 / 0.2)
    assert row["itl_chunk_ms_mean"] == pytest.approx(40)
    assert row["itl_token_ms_mean"] == pytest.approx(1000 * 0.12 / 8)


def test_over_http_each_chunk_is_timed_no_earlier_than_the_server_sent_it() -> None:
    """The same script over a real socket: the counts are exact, and each token chunk's time
    is at least the stub's cumulative delay before it (the stub sleeps that long; a loaded
    machine only adds to it), within a bound any machine meets."""
    record, duration = one_record(Script(CHUNKS))
    assert record.success and record.output_tokens == 9
    assert record.chunk_tokens == [1, 4, 1, 3]
    assert record.ttft_s == record.chunk_times_s[0] and record.e2e_s == record.chunk_times_s[-1]
    sent_at = [sum(delay for delay, _ in CHUNKS[: k + 1]) for k in range(len(CHUNKS))]
    assert all(t >= s for t, s in zip(record.chunk_times_s, sent_at)), (record.chunk_times_s, sent_at)
    assert record.chunk_times_s == sorted(record.chunk_times_s)
    assert record.e2e_s < sent_at[-1] + 5.0 and duration >= record.e2e_s


def test_a_malformed_sse_line_is_a_counted_failure() -> None:
    record, _ = one_record(Script(CHUNKS, malformed_at=2))
    assert not record.success and "malformed SSE event" in record.error


def test_a_timeout_is_a_counted_failure() -> None:
    record, _ = one_record(Script(CHUNKS, hang_s=3.0))
    assert not record.success and "timed out" in record.error


def test_a_server_dying_mid_stream_is_a_counted_failure_and_rows_are_kept(tmp_path) -> None:
    server, url = serve(Script(CHUNKS, die_at=2))
    try:
        spec = LoadSpec(concurrency=2, num_prompts=4, output_len=9, warmup=0, timeout_s=2.0)
        summary = measure(
            Endpoint(url),
            synthetic(4, 4, 0),
            spec,
            tmp_path,
            {"label": "A", "concurrency": 2, "repeat": 0},
            None,
        )
    finally:
        server.shutdown()
    assert summary["failed"] == 4 and summary["completed"] == 0
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["error"] for r in rows)
    assert (tmp_path / "summary.csv").read_text().count("\n") == 2


def test_one_client_process_sustains_hundreds_of_requests_per_second() -> None:
    """The client is not the bottleneck: against a stub that answers at once, one process
    completes this many short streaming requests per second of its own CPU time (printed;
    floor asserted). CPU time, not wall time: the tier runs in two processes on two cores, and
    the other one's load (91 requests per wall second in one run, 140-240 on an idle machine)
    says nothing of the client; the stub's threads share the process, so the client alone
    does better still."""
    server, url = serve(Script([(0.0, [1]), (0.0, [2, 3])]))
    try:
        spec = LoadSpec(concurrency=32, num_prompts=400, output_len=3, timeout_s=10.0)
        wall, cpu = time.perf_counter(), time.process_time()
        records, _ = asyncio.run(run_requests(Endpoint(url), synthetic(400, 4, 0), spec))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        server.shutdown()
    assert all(r.success for r in records)
    rate = len(records) / cpu
    print(f"\nclient ceiling: {rate:.0f} requests per CPU second ({len(records) / wall:.0f} per wall second)")
    assert rate > 150


def test_a_request_waiting_for_a_stream_is_not_sent_before_one_frees(tmp_path) -> None:
    """At concurrency 2 a request is sent (and its TTFT clock starts) when a stream frees,
    not queued inside the HTTP client from the start: of six requests of about 0.12 s each,
    two are sent at once and the others after the first ones end."""
    server, url = serve(Script([(0.06, [1]), (0.06, [2, 3])]))
    try:
        spec = LoadSpec(concurrency=2, num_prompts=6, output_len=3, warmup=0, timeout_s=10.0)
        records, _ = asyncio.run(run_requests(Endpoint(url), synthetic(6, 4, 0), spec))
    finally:
        server.shutdown()
    assert all(r.success for r in records)
    sends = sorted(r.send_s for r in records)
    assert sends[1] < 0.05 <= sends[2], sends


def spread_run(tmp_path, prompts: list, concurrency: int, processes: int) -> tuple[dict, list[dict], Script]:
    script = Script([(0.01, [1]), (0.01, [2, 3])])
    server, url = serve(script)
    try:
        spec = LoadSpec(
            concurrency=concurrency,
            num_prompts=len(prompts),
            output_len=3,
            warmup=0,
            timeout_s=10.0,
            client_processes=processes,
        )
        labels = {"label": "A", "concurrency": concurrency, "repeat": 0}
        summary = measure(Endpoint(url), prompts, spec, tmp_path, labels, None)
    finally:
        server.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    return summary, rows, script


def test_a_closed_loop_spread_over_client_processes_sends_each_prompt_once_within_its_concurrency(
    tmp_path,
) -> None:
    """Three processes share six streams, two each: every prompt is sent once, by its index,
    timed from one start, and no more than six
    streams are ever open at the server."""
    summary, rows, script = spread_run(tmp_path, synthetic(30, 4, 0), concurrency=6, processes=3)
    assert summary["completed"] == 30 and summary["failed"] == 0 and summary["client_processes"] == 3
    assert 0 < summary["client_cpu"] <= 1.5  # the busiest process's CPU time over the run
    assert sorted(r["index"] for r in rows) == list(range(30)) and script.posts == 30
    assert all(r["success"] and r["output_tokens"] == 3 for r in rows)
    assert 2 < script.most_open <= 6
    sends = sorted(r["send_s"] for r in rows)
    assert 0 <= sends[0] < 1.0 and sends[-1] < summary["duration_s"] < 30


class CountingScript(Script):
    """A stub whose acceptance counters move by the requests posted (`counts`)."""

    PREFIX = "dflash:"

    def counts(self, posts: int) -> tuple[int, int, int]:
        """(drafts, draft tokens, accepted tokens) after `posts` requests."""
        raise NotImplementedError

    @property
    def metrics_text(self) -> str:
        drafts, draft_tokens, accepted = self.counts(self.posts)
        return (
            f"{self.PREFIX}spec_decode_num_drafts_total {drafts}\n"
            f"{self.PREFIX}spec_decode_num_draft_tokens_total {draft_tokens}\n"
            f"{self.PREFIX}spec_decode_num_accepted_tokens_total {accepted}\n"
        )

    @metrics_text.setter
    def metrics_text(self, value: str) -> None:
        pass


class WarmThenMeasured(CountingScript):
    """Counters that move by the requests posted: each of the first `warm` drafts 7 tokens
    and accepts all, each later one accepts 1 of 7."""

    def __init__(self, chunks, warm: int) -> None:
        super().__init__(chunks)
        self.warm = warm

    def counts(self, posts: int) -> tuple[int, int, int]:
        return posts, 7 * posts, 7 * min(posts, self.warm) + max(posts - self.warm, 0)


def test_the_servers_counters_exclude_the_warm_up_requests(tmp_path) -> None:
    """The warm-up's acceptance (8) is not the measured requests' (2): the counters are read
    after the warm-up, so the run reports 2, and the per-request counts agree."""
    script = WarmThenMeasured([(0.0, [1]), (0.0, [2, 3])], warm=3)
    server, url = serve(script)
    try:
        spec = LoadSpec(concurrency=2, num_prompts=6, output_len=3, warmup=3, timeout_s=10.0)
        labels = {"label": "B", "concurrency": 2, "repeat": 0}
        summary = measure(Endpoint(url), synthetic(9, 4, 0), spec, tmp_path, labels, url + "/metrics")
    finally:
        server.shutdown()
    assert script.posts == 9 and summary["completed"] == 6
    assert summary["acceptance_source"] == "prometheus"
    assert summary["acceptance_length"] == pytest.approx(2.0)
    assert summary["acceptance_rate"] == pytest.approx(1 / 7)
    assert summary["acceptance_check"] == ""


class CountedTwice(CountingScript):
    """Each request streams 33 tokens (a first token, then four chunks of 8) and counts 4 drafts
    of 7 tokens, all accepted; `twice`: its draft and accepted tokens are counted twice (60 and
    56 for 28 and 28, as a server drafting blocks of 15 would count)."""

    def __init__(self, twice: bool) -> None:
        super().__init__([(0.0, [1])] + [(0.0, list(range(8)))] * 4)
        self.twice = twice

    PREFIX = "vllm:"

    def counts(self, posts: int) -> tuple[int, int, int]:
        return 4 * posts, (60 if self.twice else 28) * posts, (56 if self.twice else 28) * posts


def measure_c4(script: Script, out: Path, prompts: int = 8) -> dict:
    """A measured run of `prompts` requests at c4 (2 warm-up) against the stub, its counters
    read from its /metrics."""
    server, url = serve(script)
    try:
        spec = LoadSpec(concurrency=4, num_prompts=prompts, output_len=33, warmup=2, timeout_s=10.0)
        labels = {"label": "B", "concurrency": 4, "repeat": 0}
        return measure(Endpoint(url), synthetic(prompts + 2, 4, 0), spec, out, labels, url + "/metrics")
    finally:
        server.shutdown()


@pytest.mark.parametrize("twice", [False, True])
def test_acceptance_counted_twice_is_caught_against_the_tokens_streamed(tmp_path, twice) -> None:
    """A server whose accepted-token counter counts each token twice reports an acceptance
    length of 15 for steps that committed 8 tokens: its 8 requests streamed 264 tokens, which
    its counters' 480 committed tokens contradict; the honest counters pass."""
    script = CountedTwice(twice)
    summary = measure_c4(script, tmp_path)
    assert summary["completed"] == 8
    assert summary["acceptance_length"] == pytest.approx(15.0 if twice else 8.0)
    if twice:
        assert summary["acceptance_check"] == (
            "the drafted steps committed 480 tokens (32 drafts, 448 accepted), more than the 264 tokens "
            "streamed to 8 requests allow (384: all but each first token, and a block of 16 a request over)"
        )
    else:
        assert summary["acceptance_check"] == ""


def test_client_processes_share_the_streams_evenly_or_fewer_run() -> None:
    assert client_split(16, 2, 256) == 2 and client_split(16, 3, 256) == 2
    assert client_split(6, 4, 100) == 3 and client_split(5, 3, 100) == 1  # 5: one process
    assert client_split(8, 4, 2) == 2  # no more processes than prompts
    assert client_split(1, 8, 10) == 1


def test_an_uneven_share_runs_in_fewer_processes(tmp_path) -> None:
    summary, rows, _ = spread_run(tmp_path, synthetic(10, 4, 0), concurrency=5, processes=3)
    assert summary["client_processes"] == 1 and summary["completed"] == 10
    assert 0 < summary["client_cpu"] <= 1.5


class Unpicklable:
    """A prompt text that cannot be read back in a spawned process: the process that gets it
    dies before it starts."""

    def __reduce__(self):
        return (_refuse, ())


def _refuse():
    raise RuntimeError("planted: this prompt cannot cross to a client process")


def test_a_client_process_that_dies_fails_its_own_requests_and_the_others_run(tmp_path) -> None:
    prompts = synthetic(8, 4, 0)
    prompts[1] = Prompt(text=Unpicklable())  # process 1 of 2 takes prompts 1, 3, 5, 7
    summary, rows, script = spread_run(tmp_path, prompts, concurrency=2, processes=2)
    failed = sorted(r["index"] for r in rows if not r["success"])
    assert failed == [1, 3, 5, 7] and summary["completed"] == 4 and script.posts == 4
    assert all("client process" in r["error"] for r in rows if not r["success"])
    assert sorted(r["index"] for r in rows) == list(range(8))


def test_the_automatic_client_processes_take_eight_streams_each_within_a_quarter_of_the_cores() -> None:
    assert client_processes_for(16, cpus=16) == 2
    assert client_processes_for(64, cpus=16) == 4  # a quarter of the cores
    assert client_processes_for(4, cpus=16) == 1
    assert client_processes_for(64, cpus=2) == 1  # a small machine: one, as before
    assert client_processes_for(17, cpus=64) == 3


@pytest.mark.parametrize("value", ["0", "-2", "many", "1.5"])
def test_a_client_process_count_that_is_not_auto_or_a_whole_number_is_refused(value, capsys) -> None:
    from harness.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--base-url", "http://127.0.0.1:9", "--client-processes", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--client-processes: expected auto or a whole number >= 1, got" in err and value in err


def test_client_processes_with_an_arrival_rate_are_refused(tmp_path, capsys) -> None:
    from harness.__main__ import main

    argv = ["bench", "--base-url", "http://127.0.0.1:9", "--request-rate", "5", "--client-processes", "2"]
    assert main([*argv, "--out", str(tmp_path / "x")]) == 2
    assert "--client-processes spreads a closed loop" in capsys.readouterr().err


def test_the_same_seed_sends_the_same_prompts_in_the_same_order() -> None:
    assert synthetic(5, 8, seed=3) == synthetic(5, 8, seed=3)
    assert synthetic(5, 8, seed=3) != synthetic(5, 8, seed=4)


def test_poisson_arrival_times_have_the_requested_rate_and_shape() -> None:
    from harness.workloads import arrival_times

    times = arrival_times(20_000, 200.0, 1.0, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert abs(mean - 0.005) < 0.0002 and abs(cv - 1.0) < 0.05  # exponential gaps
    bursty = arrival_times(20_000, 200.0, 0.25, seed=1)
    gaps = [b - a for a, b in zip(bursty, bursty[1:])]
    mean = sum(gaps) / len(gaps)
    assert abs(mean - 0.005) < 0.0005  # same rate, burstier (gamma shape 0.25: cv 2)
    assert (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean > 1.7
    assert arrival_times(5, float("inf"), 1.0, seed=1) == [0.0] * 5
    assert arrival_times(50, 200.0, 1.0, seed=3) == arrival_times(50, 200.0, 1.0, seed=3)


def test_arrivals_come_when_due_and_a_late_one_does_not_delay_the_rest() -> None:
    """Each arrival waits for its own due time: never early, and lateness does not add up
    (a machine that wakes a sleeper late delays that arrival only)."""
    from harness.workloads import arrival_times, arrivals

    due = arrival_times(40, 200.0, 1.0, seed=1)

    async def times() -> list[float]:
        start, out = time.perf_counter(), []
        async for i in arrivals(40, 200.0, 1.0, seed=1):
            out.append(time.perf_counter() - start)
            if i == 5:
                time.sleep(0.3)  # the loop is held up well past the next arrivals' times
        return out

    t = asyncio.run(times())
    assert all(got >= want - 1e-6 for got, want in zip(t, due))
    # after the hold-up the schedule catches up: the last arrival is late by scheduling noise
    # only, not by the 0.3 s hold-up on top of it
    assert t[-1] - due[-1] < 0.25, (t[-1], due[-1])


def read_events(endpoint: Endpoint, timed: list[tuple[float, dict]]) -> RequestRecord:
    """The reader fed these events (data objects) at these times, then [DONE]."""
    reader = StreamReader(endpoint, RequestRecord(index=0, send_s=0.0))
    for now, event in timed:
        assert not reader.event(json.dumps(event), now)
    reader.event("[DONE]", timed[-1][0])
    return reader.finish()


def test_ttft_is_the_first_chunk_that_carries_a_token_not_the_first_event() -> None:
    """A chat stream opens with a role-only delta (no token); TTFT is the first token's time."""
    record = read_events(
        Endpoint("http://unused", kind="chat"),
        [
            (0.01, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
            (0.05, {"choices": [{"index": 0, "delta": {"content": "<1>"}, "token_ids": [1]}]}),
            (0.07, {"choices": [{"index": 0, "delta": {"content": "<2>"}, "token_ids": [2]}]}),
            (0.08, {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),
        ],
    )
    assert record.success and record.ttft_s == pytest.approx(0.05) and record.chunk_times_s == [0.05, 0.07]


def test_tokens_are_counted_from_the_ids_a_server_sends_not_from_its_text() -> None:
    """Three characters a token in the text, one id a token: the ids are the count."""
    record = read_events(
        Endpoint("http://unused"),
        [
            (0.02, {"choices": [{"index": 0, "text": "abcdefghi", "token_ids": [5, 6, 7]}]}),
            (0.03, {"choices": [{"index": 0, "text": "xyz", "token_ids": [8], "finish_reason": "length"}]}),
        ],
    )
    assert record.success and record.output_tokens == 4 and record.chunk_tokens == [3, 1]
    assert record.token_ids == [5, 6, 7, 8] and record.count_source == "server_ids"


class PositionsCounted(CountedTwice):
    """CountedTwice's honest stream and counters (4 drafts of 7, all accepted), with the
    accepted tokens by position; `halved`: the accepted-token counter says half of them (14 of
    28), while every position still says each draft's token there was accepted."""

    def __init__(self, halved: bool) -> None:
        super().__init__(twice=False)
        self.halved = halved

    @property
    def metrics_text(self) -> str:
        drafts, draft_tokens, accepted = self.counts(self.posts)
        accepted = accepted // 2 if self.halved else accepted
        lines = [
            f"vllm:spec_decode_num_drafts_total {drafts}",
            f"vllm:spec_decode_num_draft_tokens_total {draft_tokens}",
            f"vllm:spec_decode_num_accepted_tokens_total {accepted}",
        ]
        lines += [
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{k}"}} {drafts}' for k in range(7)
        ]
        return "\n".join(lines) + "\n"

    @metrics_text.setter
    def metrics_text(self, value: str) -> None:
        pass


@pytest.mark.parametrize("halved", [False, True])
def test_accepted_tokens_fewer_than_their_positions_count_are_caught(tmp_path, halved) -> None:
    """Each accepted token is counted at its one position: a server whose positions count 28
    accepted tokens and whose accepted-token counter says 14 contradicts itself (every other
    bound holds: 14 of 28 drafted, each position within the drafts and falling, 18 tokens
    committed of the 264 streamed), and the run says so; the honest counters pass."""
    script = PositionsCounted(halved)
    summary = measure_c4(script, tmp_path)
    assert summary["completed"] == 8
    assert summary["acceptance_per_position"] == pytest.approx([1.0] * 7)
    if halved:
        assert (
            summary["acceptance_check"]
            == "the positions' counts total 224, more than the 112 accepted tokens"
        )
    else:
        assert summary["acceptance_check"] == ""


class PageBreaks(CountedTwice):
    """Honest counters until `broken_after` requests were posted; then a /metrics page that is
    not Prometheus text (a sample whose value is not a number)."""

    def __init__(self, broken_after: int) -> None:
        super().__init__(twice=False)
        self.broken_after = broken_after

    @property
    def metrics_text(self) -> str:
        if self.posts >= self.broken_after:
            return "dflash:spec_decode_num_drafts_total many\n"
        return CountedTwice.metrics_text.fget(self)

    @metrics_text.setter
    def metrics_text(self, value: str) -> None:
        pass


def test_a_metrics_page_that_breaks_during_the_run_loses_its_counters_not_the_run(tmp_path) -> None:
    """A page readable before the run and not Prometheus text after it: the run's requests are
    measured and written, no acceptance is read from counters, and the summary's check names
    the page; a page unreadable before the run stops it at once, naming the URL."""
    summary = measure_c4(PageBreaks(broken_after=3), tmp_path / "a")
    assert summary["completed"] == 8 and summary.get("acceptance_source") != "prometheus"
    assert summary["acceptance_check"].startswith("the /metrics page after the run: http://127.0.0.1:")
    assert "/metrics is not Prometheus text" in summary["acceptance_check"]
    assert len((tmp_path / "a" / "requests.jsonl").read_text().splitlines()) == 8
    with pytest.raises(ValueError, match=r"http://127\.0\.0\.1:\d+/metrics is not Prometheus text"):
        measure_c4(PageBreaks(broken_after=0), tmp_path / "b")


def test_a_server_whose_usage_contradicts_its_ids_fails_the_request_over_http(tmp_path) -> None:
    """The throughput is made of the server's counts: a final usage.completion_tokens that is
    not the number of ids streamed fails each request by name, and the run with it."""
    record, _ = one_record(Script(CHUNKS, usage_over=3))
    assert not record.success
    assert record.error == "inconsistent token counts: usage.completion_tokens is 12 for 9 token ids"
    server, url = serve(Script(CHUNKS, usage_over=-1))
    try:
        spec = LoadSpec(concurrency=2, num_prompts=4, output_len=9, warmup=0, timeout_s=2.0)
        labels = {"label": "A", "concurrency": 2, "repeat": 0}
        summary = measure(Endpoint(url), synthetic(4, 4, 0), spec, tmp_path, labels, None)
    finally:
        server.shutdown()
    assert summary["failed"] == 4 and summary["completed"] == 0
    assert "usage.completion_tokens is 8 for 9 token ids" in summary["errors"]


def test_more_tokens_than_max_tokens_from_the_servers_counts_fail_the_request() -> None:
    """Ids, a running usage or SGLang's meta_info that add up to more than the request's
    max_tokens fail it; as many as max_tokens pass."""
    from harness.server_kind import ServerKind

    def read(endpoint, stream, max_tokens):
        reader = StreamReader(endpoint, RequestRecord(index=0, send_s=0.0), max_tokens)
        for k, event in enumerate(stream):
            reader.event(json.dumps(event), 0.01 * (k + 1))
        return reader.finish()

    ids = [
        {"choices": [{"text": "ab", "token_ids": [1, 2]}]},
        {"choices": [{"text": "c", "token_ids": [3], "finish_reason": "length"}]},
    ]
    running = [
        {"choices": [{"text": "ab"}], "usage": {"completion_tokens": 2}},
        {"choices": [{"text": "c", "finish_reason": "length"}], "usage": {"completion_tokens": 3}},
    ]
    meta = [
        {"text": "ab", "meta_info": {"completion_tokens": 2}},
        {"text": "abc", "meta_info": {"completion_tokens": 3, "finish_reason": {"type": "length"}}},
    ]
    vllm = Endpoint("http://unused", server=ServerKind("vllm", continuous_usage=True))
    for endpoint, stream in (
        (Endpoint("http://unused"), ids),
        (vllm, running),
        (Endpoint("http://unused", kind="sglang"), meta),
    ):
        assert read(endpoint, stream, 3).success
        record = read(endpoint, stream, 2)
        assert not record.success and record.error.startswith("inconsistent token counts: 3 tokens (")
        assert record.error.endswith("for max_tokens 2")


def test_a_running_total_that_falls_fails_the_request() -> None:
    """A running usage or meta_info count that goes down contradicts the server's own earlier
    count: the request fails, naming both."""
    from harness.server_kind import ServerKind

    vllm = Endpoint("http://unused", server=ServerKind("vllm", continuous_usage=True))
    reader = StreamReader(vllm, RequestRecord(index=0, send_s=0.0))
    for k, (total, finish) in enumerate(((4, None), (2, None), (5, "length"))):
        event = {"choices": [{"text": "x", "finish_reason": finish}], "usage": {"completion_tokens": total}}
        reader.event(json.dumps(event), 0.01 * (k + 1))
    record = reader.finish()
    assert record.error == "inconsistent token counts: usage.completion_tokens fell from 4 to 2"
    reader = StreamReader(Endpoint("http://unused", kind="sglang"), RequestRecord(index=0, send_s=0.0))
    for k, (total, finish) in enumerate(((3, None), (1, {"type": "length"}))):
        reader.event(
            json.dumps({"text": "x", "meta_info": {"completion_tokens": total, "finish_reason": finish}}), k
        )
    assert reader.finish().error == "inconsistent token counts: meta_info.completion_tokens fell from 3 to 1"


def test_counts_made_on_this_side_are_not_held_to_max_tokens() -> None:
    """Text tokenized again, or estimated a chunk a token, may come to more tokens than the
    server generated: no check holds them to max_tokens."""
    for endpoint in (Endpoint("http://unused"),):
        reader = StreamReader(endpoint, RequestRecord(index=0, send_s=0.0), 1)
        for k, finish in enumerate((None, "length")):
            reader.event(json.dumps({"choices": [{"text": "x", "finish_reason": finish}]}), k)
        record = reader.finish()
        assert record.success and record.output_tokens == 2 and record.count_source == "estimated"


def test_the_requested_tokens_are_read_from_each_endpoint_kinds_body() -> None:
    from harness.client import payload, requested_tokens

    prompt = Prompt(token_ids=(1, 2, 3), text="abc")
    for kind in ("completions", "chat", "sglang"):
        assert requested_tokens(payload(Endpoint("http://unused", kind=kind), prompt, 7)) == 7
    assert requested_tokens({"max_completion_tokens": 5, "max_tokens": 9}) == 5
    assert requested_tokens({"prompt": "x"}) is None and requested_tokens({"max_tokens": True}) is None


def test_without_token_ids_a_running_usage_gives_each_chunk_its_tokens() -> None:
    """A server kind that sends no ids but keeps a running usage (`continuous_usage_stats`):
    each chunk carries the growth of `usage.completion_tokens`, however many tokens that is."""
    from harness.client import Endpoint, RequestRecord, _Counter
    from harness.server_kind import ServerKind

    endpoint = Endpoint("http://127.0.0.1:1", server=ServerKind("vllm", continuous_usage=True))
    counter, record = _Counter(endpoint), RequestRecord(0, 0.0)
    counts = []
    for running, text in ((1, "a"), (4, "bcd"), (9, "efghi"), (10, "j")):
        event = {"choices": [{"text": text, "finish_reason": None}], "usage": {"completion_tokens": running}}
        counts.append(counter.tokens(event, "completions", record))
    assert counts == [1, 3, 5, 1] and record.count_source == "usage"


def test_the_run_ends_at_the_latest_client_process_end_in_any_order_of_reports() -> None:
    """Client processes report (end, share on a core) when done; their reports are read in
    whatever order the pipes deliver them. The run ends at the latest end and counts the
    busiest share, not the last report read."""
    reports = [(10.0, 0.4), (12.5, 0.2), (11.0, 0.9)]
    for order in (reports, reports[::-1], [reports[1], reports[0], reports[2]]):
        so_far = (0.0, 0.0)
        for reported in order:
            so_far = merged_end(so_far, reported)
        assert so_far == (12.5, 0.9)


def test_a_token_whose_text_reads_done_does_not_end_the_stream() -> None:
    """Only an event whose whole data is `[DONE]` ends a stream: a model may well write the
    text `[DONE]`, inside a JSON string of a token chunk."""
    record = read_events(
        Endpoint("http://unused"),
        [
            (0.02, {"choices": [{"index": 0, "text": "data: [DONE]", "token_ids": [5, 6]}]}),
            (0.03, {"choices": [{"index": 0, "text": "[DONE]", "token_ids": [7], "finish_reason": "stop"}]}),
        ],
    )
    assert record.success and record.output_tokens == 3 and record.token_ids == [5, 6, 7]
    assert record.chunk_times_s == [0.02, 0.03] and record.done_marker


def test_a_stream_that_ends_cleanly_without_a_token_is_a_failure() -> None:
    """A finish_reason and [DONE] with no token before them is no completed request: counted
    as completed it would add a request, and no tokens, to the throughput."""
    record = read_events(
        Endpoint("http://unused"),
        [
            (0.01, {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}),
            (0.02, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 0}}),
        ],
    )
    assert not record.success and record.output_tokens == 0
    assert record.error == "the stream ended without a token"


def test_an_error_object_in_a_stream_fails_the_request_whatever_else_the_event_carries() -> None:
    """An event with an `error` member is the server's error, also when it keeps the chunk's
    other members (an empty `choices` list)."""
    reader = StreamReader(Endpoint("http://unused"), RequestRecord(index=0, send_s=0.0))
    assert not reader.event(json.dumps({"choices": [{"index": 0, "text": "a", "token_ids": [1]}]}), 0.01)
    assert reader.event(json.dumps({"choices": [], "error": {"message": "the engine failed"}}), 0.02)
    record = reader.finish()
    assert not record.success and "the engine failed" in (record.error or "")


def test_an_sglang_stream_is_whole_after_its_finish_reason_without_done() -> None:
    """SGLang's native stream says it is finished in `meta_info.finish_reason`: a stream that
    ends cleanly after it is whole even without [DONE], one cut before it is not."""

    def sglang(finished: bool) -> RequestRecord:
        reader = StreamReader(Endpoint("http://unused", kind="sglang"), RequestRecord(index=0, send_s=0.0))
        meta = {"prompt_tokens": 3, "completion_tokens": 1, "finish_reason": None}
        assert not reader.event(json.dumps({"text": "a", "meta_info": meta}), 0.01)
        meta = {**meta, "completion_tokens": 3, "finish_reason": {"type": "length"} if finished else None}
        assert not reader.event(json.dumps({"text": "abc", "meta_info": meta}), 0.02)
        return reader.finish()

    whole, cut = sglang(True), sglang(False)
    assert whole.success and whole.output_tokens == 3 and not whole.done_marker, whole.error
    assert whole.chunk_tokens == [1, 2] and whole.count_source == "meta_info"
    assert not cut.success and "before [DONE] or a finish_reason" in (cut.error or "")


def test_only_completed_streams_are_counted_as_ended_without_done(tmp_path) -> None:
    """`streams_without_done` counts completed requests whose stream ended cleanly without
    [DONE] (a plain OpenAI server's way); a request that failed (HTTP 500 here) ended no
    stream and is counted as failed only."""
    server, url = serve(Script(CHUNKS, fail_every=2))
    try:
        spec = LoadSpec(concurrency=1, num_prompts=4, output_len=9, warmup=0, timeout_s=5.0)
        labels = {"label": "A", "concurrency": 1, "repeat": 0}
        summary = measure(Endpoint(url), synthetic(4, 4, 0), spec, tmp_path, labels, None)
    finally:
        server.shutdown()
    assert (summary["completed"], summary["failed"]) == (2, 2)
    assert summary["streams_without_done"] == 0


class _ChunkedSSE:
    """A keep-alive SSE server on loopback that ends each body with the chunked encoding's
    last chunk (as uvicorn does), counting the connections it accepts; `after_done_s`: it
    goes on sending comments for that long after [DONE] before it ends the body."""

    def __init__(self, after_done_s: float = 0.0) -> None:
        import socketserver
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self
        self.connections = 0
        self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with outer.lock:
                    outer.connections += 1

            def chunk(self, text: str) -> None:
                data = text.encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for ids in ([1], [2, 3]):
                    event = {"choices": [{"index": 0, "text": "x", "token_ids": ids, "finish_reason": None}]}
                    self.chunk(f"data: {json.dumps(event)}\n\n")
                self.chunk("data: [DONE]\n\n")
                end = time.monotonic() + after_done_s
                while time.monotonic() < end:
                    self.chunk(": still here\n\n")
                    time.sleep(0.02)
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

        class Server(ThreadingHTTPServer, socketserver.ThreadingMixIn):
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def test_a_closed_loop_reuses_its_connections_as_a_real_client_does() -> None:
    """Each stream is read to its body's end after [DONE], so its connection goes back to the
    pool: a closed loop of 2 streams and 12 requests opens 2 connections, not one a request
    (a response closed unread closes its connection, and the server under test would pay for
    a new one every request)."""
    stub = _ChunkedSSE()
    try:
        spec = LoadSpec(concurrency=2, num_prompts=12, output_len=3, timeout_s=5.0)
        records, _ = asyncio.run(run_requests(Endpoint(stub.url), synthetic(12, 4, 0), spec))
    finally:
        stub.server.shutdown()
    assert all(r.success and r.output_tokens == 3 for r in records)
    assert stub.connections == 2


def test_a_server_that_sends_on_after_done_is_cut_and_its_request_counts(monkeypatch) -> None:
    """A body that goes on past [DONE] (comments for 3 s) is read for DRAIN_S at most, then
    its connection is closed: the request succeeds with the tokens before [DONE], and the run
    does not wait for the body's end."""
    import harness.client

    monkeypatch.setattr(harness.client, "DRAIN_S", 0.2)
    stub = _ChunkedSSE(after_done_s=3.0)
    try:
        spec = LoadSpec(concurrency=1, num_prompts=2, output_len=3, timeout_s=10.0)
        start = time.perf_counter()
        records, _ = asyncio.run(run_requests(Endpoint(stub.url), synthetic(2, 4, 0), spec))
        took = time.perf_counter() - start
    finally:
        stub.server.shutdown()
    assert all(r.success and r.output_tokens == 3 and r.done_marker for r in records)
    assert took < 2.0 and stub.connections == 2  # each cut body closed its connection
