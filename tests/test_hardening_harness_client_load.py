"""The benchmark harness's request side, on real inputs (a server on loopback, files on disk):

- request bodies (harness/client.py `payload`): SGLang's native body carries the
  `ignore_eos` and temperature asked for, a chat prompt sent there as text is its messages
  one per line (`role: content`); a completions and a chat body name the model.
- reading a stream (harness/client.py `send`): the token ids of every chunk are kept in
  order; a request that streams exactly `max_tokens` tokens passes; a count that is JSON
  `true` is no count; SGLang's prompt tokens stay once reported; a request counted by the
  estimate says so; an error status's body is in the error; SGLang's count as a string is
  a malformed event; a connection broken after [DONE] does not fail the request.
- the requested output length (`requested_tokens`): chat's `max_completion_tokens` wins.
- a measured run (harness/load.py `measure`): a second run into the same folder appends
  its request rows, and a run against an unprobed server says so; fewer prompts than
  client processes run in as many processes as prompts.
- run metrics (harness/metrics.py): p90 is the 90th percentile, an SLO met exactly counts
  for goodput, a one-token request has no TPOT, achieved concurrency is of the completed
  requests, and count sources are of the completed requests only.
- acceptance counters (harness/prometheus.py): lmdeploy's positions count from 0; the
  committed-token bound allows one block a request over; CPU shares are differences, and
  none is reported from a counter that fell (a restarted server); a /metrics page of an
  error status is no snapshot; a per-request `spec_decode` without its fields fails that
  request, not the run.
- A/B servers (harness/ab.py): a server not healthy in time is stopped; `/info` keeps
  where the engine steps (`engine_loop`).
- answers read by `harness compare` (harness/answer.py): a negative usage count, an empty
  finish_reason, a prompt count that contradicts the echoed ids are refused; a reply cut
  short is a truncated stream or a malformed body; logprobs ask for two alternatives;
  margins are top-1 minus top-2.
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from harness.ab import ManagedServer
from harness.answer import (
    Answer,
    AnswerError,
    Ask,
    ask_server,
    listed_ids,
    listed_texts,
    margin,
    read_stream,
    read_whole,
    request_body,
    token_texts,
)
from harness.client import Endpoint, RequestRecord, payload, requested_tokens, send
from harness.load import LoadSpec, client_split, measure
from harness.metrics import calculate_metrics, count_sources
from harness.prometheus import counter_contradictions, parse, server_cpu
from harness.workloads import Prompt, synthetic

from .sse_stub import Script, serve
from .test_hardening_harness_client_answer import Replies


# ----------------------------------------------------------------------------- a loopback server
def sse(*events: dict | str, done: bool = True) -> bytes:
    """Each event as one `data:` line, then [DONE]."""
    lines = [e if isinstance(e, str) else json.dumps(e) for e in events]
    return ("".join(f"data: {line}\n\n" for line in lines) + ("data: [DONE]\n\n" if done else "")).encode()


def chunk(text: str, ids: list[int] | None, finish: str | None = None, usage: dict | None = None) -> dict:
    choice: dict = {"index": 0, "text": text, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    event: dict = {"choices": [choice]}
    if usage is not None:
        event["usage"] = usage
    return event


def bench(endpoint: Endpoint, body: dict, timeout: float = 10.0) -> RequestRecord:
    async def go() -> RequestRecord:
        async with httpx.AsyncClient() as client:
            return await send(client, endpoint, body, 0, time.perf_counter(), timeout)

    return asyncio.run(go())


# ----------------------------------------------------------------------------- request bodies
@pytest.mark.parametrize("ignore_eos", [True, False])
def test_sglangs_body_carries_the_ignore_eos_and_temperature_asked_for(ignore_eos: bool) -> None:
    """SGLang's native body puts the sampling settings under `sampling_params`: the
    `ignore_eos` and the temperature the caller gives, not fixed values."""
    body = payload(
        Endpoint("http://x", kind="sglang"), Prompt(text="hi"), 7, ignore_eos=ignore_eos, temperature=0.5
    )
    assert body["sampling_params"] == {"max_new_tokens": 7, "temperature": 0.5, "ignore_eos": ignore_eos}
    assert body["text"] == "hi" and body["stream"] is True


def test_a_chat_prompt_sent_as_text_is_its_messages_one_per_line() -> None:
    """A chat prompt goes to SGLang's native endpoint and to a completions endpoint as text:
    each message `role: content` on its own line, in order."""
    messages = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"})
    for kind, field in (("sglang", "text"), ("completions", "prompt")):
        body = payload(Endpoint("http://x", kind=kind), Prompt(messages=messages), 4)
        assert body[field] == "system: be brief\nuser: hi there", kind


def test_completions_and_chat_bodies_name_the_model_and_sglangs_does_not() -> None:
    """`--model` goes into the OpenAI bodies of both kinds; the native SGLang body has no
    model field."""
    for kind in ("completions", "chat"):
        assert payload(Endpoint("http://x", model="m1", kind=kind), Prompt(text="hi"), 4)["model"] == "m1"
    assert "model" not in payload(Endpoint("http://x", model="m1", kind="sglang"), Prompt(text="hi"), 4)


# ----------------------------------------------------------------------------- reading a stream
def test_the_token_ids_of_every_chunk_are_kept_in_order() -> None:
    """A record keeps all the token ids the stream sent, chunk after chunk, not the last
    chunk's alone, and counts each chunk's ids."""
    body = sse(chunk("ab", [1, 2]), chunk("c", [3]), chunk("de", [4, 5], "length"))
    with Replies(200, body) as server:
        record = bench(Endpoint(server.url), {"prompt": "x", "max_tokens": 5})
    assert record.success, record.error
    assert record.token_ids == [1, 2, 3, 4, 5]
    assert record.chunk_tokens == [2, 1, 2] and record.output_tokens == 5
    assert record.count_source == "server_ids" and not record.estimated_counts


def test_a_request_that_streams_exactly_max_tokens_tokens_passes() -> None:
    """`max_tokens` is the most a request may stream: exactly that many passes, one more
    fails as inconsistent."""
    with Replies(200, sse(chunk("ab", [1, 2]), chunk("c", [3], "length"))) as server:
        assert bench(Endpoint(server.url), {"prompt": "x", "max_tokens": 3}).success
        over = bench(Endpoint(server.url), {"prompt": "x", "max_tokens": 2})
    assert not over.success and over.error.startswith("inconsistent token counts: 3 tokens")


@pytest.mark.parametrize(
    "event",
    [
        chunk("a", [True], "length"),
        chunk("a", [1], "length", usage={"completion_tokens": True}),
        chunk("a", [1], "length", usage={"prompt_tokens": False}),
    ],
    ids=["true-id", "true-count", "false-prompt-count"],
)
def test_a_count_or_id_that_is_json_true_or_false_is_no_number(event: dict) -> None:
    """JSON `true` is no token id and no count: the request fails as a malformed event."""
    with Replies(200, sse(event)) as server:
        record = bench(Endpoint(server.url), {"prompt": "x", "max_tokens": 4})
    assert not record.success and record.error.startswith("malformed SSE event (")


@pytest.mark.parametrize("name", ["completion_tokens", "spec_verify_ct"])
def test_an_sglang_count_that_is_not_an_integer_fails_the_request(name: str) -> None:
    """SGLang's `meta_info.completion_tokens` and `spec_verify_ct` (its verify steps, read as
    acceptance) are counts: a string there is a malformed event, never a count."""
    meta = {"completion_tokens": 1, "finish_reason": {"type": "length"}, name: "1"}
    with Replies(200, sse({"text": "a", "meta_info": meta})) as server:
        record = bench(Endpoint(server.url, kind="sglang"), {"text": "x"})
    assert not record.success
    assert record.error.startswith(f"malformed SSE event (meta_info.{name} is not an integer)")


def test_sglangs_prompt_tokens_once_reported_stay_when_later_chunks_omit_them() -> None:
    """SGLang reports `prompt_tokens` in its `meta_info`: a later chunk's meta_info without
    it keeps the count reported before."""
    events = (
        {"text": "a", "meta_info": {"completion_tokens": 1, "prompt_tokens": 5}},
        {"text": "b", "meta_info": {"completion_tokens": 2, "finish_reason": {"type": "length"}}},
    )
    with Replies(200, sse(*events)) as server:
        record = bench(Endpoint(server.url, kind="sglang"), {"text": "x"})
    assert record.success, record.error
    assert record.prompt_tokens == 5 and record.output_tokens == 2 and record.count_source == "meta_info"


def test_a_request_counted_by_the_estimate_is_flagged_as_estimated() -> None:
    """A stream without ids or counts, read without a tokenizer, counts a chunk with text as
    one token, and the record says its counts are estimated."""
    with Replies(200, sse(chunk("ab", None), chunk("cd", None, "length"))) as server:
        record = bench(Endpoint(server.url), {"prompt": "x", "max_tokens": 9})
    assert record.success, record.error
    assert record.estimated_counts and record.count_source == "estimated" and record.output_tokens == 2


def test_an_error_status_is_recorded_with_its_body() -> None:
    """A reply of HTTP 503 fails the request; the error quotes the body, where the server
    says why."""
    with Replies(503, b'{"error": "the queue is full"}') as server:
        record = bench(Endpoint(server.url), {"prompt": "x", "max_tokens": 2})
    assert not record.success and record.error == 'HTTP 503: {"error": "the queue is full"}'


def cut_short(body: bytes) -> tuple[ThreadingHTTPServer, str]:
    """A loopback server that answers every POST with `body` under a Content-Length 100 bytes
    longer, then closes the connection: the reply is cut short after `body`."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body) + 100))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_a_connection_cut_after_the_done_marker_does_not_fail_the_request() -> None:
    """A stream whose [DONE] arrived is whole, though the server then breaks the connection
    before the body's end: the request passes with its tokens."""
    server, url = cut_short(sse(chunk("a", [1]), chunk("b", [2], "length")))
    try:
        record = bench(Endpoint(url), {"prompt": "x", "max_tokens": 2})
    finally:
        server.shutdown()
        server.server_close()
    assert record.success, record.error
    assert record.token_ids == [1, 2] and record.done_marker


def test_a_compared_reply_cut_short_is_a_truncated_stream_or_a_malformed_body() -> None:
    """`harness compare` reads a reply whose connection broke before its end as cut short: a
    stream is `truncated_stream`, a whole reply `malformed_body`."""
    server, url = cut_short(sse(chunk("a", [1]), done=False))
    try:
        for stream, name in ((True, "truncated_stream"), (False, "malformed_body")):

            async def go(stream=stream):
                async with httpx.AsyncClient(timeout=5.0) as client:
                    return await ask_server(client, Endpoint(url), Ask(2, prompt="x"), False, stream)

            with pytest.raises(AnswerError) as caught:
                asyncio.run(go())
            assert caught.value.name == name and "cut short" in caught.value.message
    finally:
        server.shutdown()
        server.server_close()


def test_chats_max_completion_tokens_wins_and_a_boolean_is_no_token_count() -> None:
    """The most tokens a body asks for: chat's `max_completion_tokens` before `max_tokens`;
    JSON `true` names no count."""
    assert requested_tokens({"max_completion_tokens": 3, "max_tokens": 9}) == 3
    assert requested_tokens({"max_tokens": True}) is None
    assert requested_tokens({"max_tokens": True, "sampling_params": {"max_new_tokens": 6}}) == 6


# ----------------------------------------------------------------------------- a measured run
def test_a_second_run_into_the_same_folder_appends_its_request_rows(tmp_path) -> None:
    """Each measured run adds its request rows to `requests.jsonl` (a sweep and a resumed run
    write into one folder), and one summary row each; a run against a server that was not
    probed says so."""
    server, url = serve(Script([(0.0, [1]), (0.0, [2])]))
    try:
        spec = LoadSpec(concurrency=2, num_prompts=3, output_len=2, warmup=0, timeout_s=5.0)
        for repeat in (0, 1):
            summary = measure(
                Endpoint(url), synthetic(3, 4, 0), spec, tmp_path, {"label": "A", "repeat": repeat}, None
            )
    finally:
        server.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert sorted((r["repeat"], r["index"]) for r in rows) == [(k, i) for k in (0, 1) for i in range(3)]
    with (tmp_path / "summary.csv").open(newline="") as f:
        assert [r["repeat"] for r in csv.DictReader(f)] == ["0", "1"]
    assert summary["server_kind"] == "ours (not probed)" and summary["completed"] == 3


def test_fewer_prompts_than_client_processes_run_in_as_many_processes_as_prompts() -> None:
    """A closed loop never starts a client process with no prompt to send: two prompts run in
    at most two processes, the most that still share the streams evenly."""
    assert client_split(8, 4, 2) == 2
    assert client_split(6, 4, 3) == 3
    assert client_split(6, 4, 1) == 1


# ----------------------------------------------------------------------------- run metrics
def done(index: int, ttft: float, e2e: float, tokens: int, success: bool = True, **fields) -> RequestRecord:
    """A request record whose tokens came in two chunks, at TTFT and at E2E (one chunk for a
    one-token request)."""
    times = [ttft] if tokens == 1 else [ttft, e2e]
    counts = [1] if tokens == 1 else [1, tokens - 1]
    return RequestRecord(
        index,
        0.0,
        success=success,
        ttft_s=ttft,
        e2e_s=e2e,
        chunk_times_s=times,
        chunk_tokens=counts,
        output_tokens=tokens,
        **fields,
    )


def test_p90_is_the_90th_percentile_of_the_values() -> None:
    """TTFTs of 0, 10, ..., 100 ms: the median is 50 ms and the p90 90 ms."""
    records = [done(i, i / 100, i / 100 + 0.5, 2) for i in range(11)]
    row = calculate_metrics(records, 10.0)
    assert row["ttft_ms_median"] == pytest.approx(50.0)
    assert row["ttft_ms_p90"] == pytest.approx(90.0)
    assert row["ttft_ms_p99"] == pytest.approx(99.0)


def test_a_request_that_meets_an_slo_exactly_counts_for_goodput() -> None:
    """An SLO is met at its bound: a TTFT of exactly 250 ms meets `ttft: 250`."""
    records = [done(0, 0.25, 0.75, 3), done(1, 0.5, 1.0, 3)]
    assert calculate_metrics(records, 2.0, {"ttft": 250.0})["goodput_requests_per_s"] == 0.5
    assert calculate_metrics(records, 2.0, {"e2e": 1000.0})["goodput_requests_per_s"] == 1.0


def test_a_one_token_request_has_no_time_per_output_token() -> None:
    """TPOT leaves out requests of one token (no gap to divide); a run of those alone has
    none, and raises nothing."""
    row = calculate_metrics([done(0, 0.2, 0.2, 1), done(1, 0.3, 0.3, 1)], 1.0)
    assert math.isnan(row["tpot_ms_mean"]) and row["completed"] == 2
    row = calculate_metrics([done(0, 0.2, 0.2, 1), done(1, 0.1, 0.5, 3)], 1.0)
    assert row["tpot_ms_mean"] == pytest.approx(200.0)


def test_achieved_concurrency_and_count_sources_are_of_the_completed_requests() -> None:
    """A request that failed mid-stream keeps its timings in its record, but adds nothing to
    the achieved concurrency, and its count source is not the run's."""
    ok = done(0, 0.1, 1.0, 3, count_source="server_ids")
    failed = done(1, 0.1, 3.0, 3, success=False, error="cut", count_source="estimated")
    assert calculate_metrics([ok, failed], 2.0)["achieved_concurrency"] == pytest.approx(0.5)
    assert count_sources([ok, failed]) == "server_ids"


# ----------------------------------------------------------------------------- acceptance counters
def test_lmdeploys_positions_count_from_zero() -> None:
    """lmdeploy numbers its per-position counter from 0, like vLLM: its position 0 is draft
    token 1."""
    page = (
        "# TYPE lmdeploy:spec_decode_num_accepted_tokens_per_pos counter\n"
        'lmdeploy:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 7\n'
        'lmdeploy:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 3\n'
    )
    snap = parse(page)
    assert snap["pos:1"] == 7.0 and snap["pos:2"] == 3.0 and "pos:0" not in snap


def counts(drafts: float, draft_tokens: float | None, accepted: float, **positions: float) -> dict:
    snap = {"drafts": drafts, "accepted": accepted, **{f"pos:{k[1:]}": v for k, v in positions.items()}}
    if draft_tokens is not None:
        snap["draft_tokens"] = draft_tokens
    return snap


def test_a_run_may_commit_one_block_a_request_past_its_streamed_tokens() -> None:
    """Blocks of 4 draft tokens (block of 5 with the target's own): one request streamed 4
    tokens, so its drafted steps may have committed 3 + 5 = 8; 8 agrees, 9 contradicts."""
    record = done(0, 0.1, 0.2, 4)
    zero = counts(0, 0, 0)
    assert counter_contradictions(zero, counts(2, 8, 6), [record]) == ""
    assert "more than the 4 tokens streamed to 1 requests allow (8:" in counter_contradictions(
        zero, counts(2, 8, 7), [record]
    )


def test_a_position_accepted_as_often_as_the_one_before_is_no_contradiction() -> None:
    """Every draft's first token accepted, and as many second tokens as first ones: the
    counts agree (a position is at most, not below, the one before)."""
    zero = counts(0, 0, 0, p1=0, p2=0)
    assert counter_contradictions(zero, counts(4, 8, 8, p1=4, p2=4), []) == ""


def test_accepted_tokens_where_the_draft_tokens_counter_did_not_move_contradict_it() -> None:
    """A draft-token counter that stayed at 0 over a run with accepted tokens: more accepted
    than drafted is named."""
    found = counter_contradictions(counts(0, 0, 0), counts(2, 0, 1), [])
    assert "1 accepted tokens of 0 drafted" in found


def test_the_servers_cpu_share_is_its_cpu_counters_difference_over_the_run() -> None:
    """A server whose process had used 100 s of CPU before and 105 s after a 10 s run was
    busy half a core."""
    assert server_cpu({"cpu:server": 100.0}, {"cpu:server": 105.0}, 10.0) == {"server_cpu": 0.5}


def test_a_server_restarted_between_the_scrapes_reports_no_cpu_share() -> None:
    """A CPU counter that fell over the run started again (a restarted server): its difference
    is no CPU time, so no share is reported, as no acceptance is."""
    assert server_cpu({"cpu:server": 100.0}, {"cpu:server": 2.0}, 10.0) == {}


def test_a_per_request_statistics_object_missing_a_field_does_not_lose_the_runs_summary(tmp_path) -> None:
    """A server's per-request `spec_decode` that lacks the fields it should have is a
    malformed reply, failing that request by name: the run still ends with its summary row
    written, and the statistics are not read as acceptance."""
    events = [chunk("a", [1]), {**chunk("b", [2], "length"), "spec_decode": {"steps": 1}}]
    with Replies(200, sse(*events)) as server:
        spec = LoadSpec(concurrency=1, num_prompts=1, output_len=2, warmup=0, timeout_s=5.0)
        summary = measure(Endpoint(server.url), synthetic(1, 4, 0), spec, tmp_path, {"label": "A"}, None)
    assert (summary["completed"], summary["failed"]) == (0, 1)
    assert (tmp_path / "summary.csv").exists()
    (row,) = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert "spec_decode has no integer proposed" in row["error"]


# ----------------------------------------------------------------------------- A/B servers
def test_a_server_not_healthy_within_its_timeout_is_stopped(tmp_path) -> None:
    """A server command that never answers /health: waiting for it ends at the timeout with
    an error naming the URL, and its process is stopped, not left running."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        server = ManagedServer("http://127.0.0.1:9", ["sleeper"], process, tmp_path / "none.log")
        with pytest.raises(RuntimeError, match=r"not healthy after 0\.5 s"):
            server.wait_healthy(0.5)
        assert process.poll() is not None
    finally:
        process.kill()
        process.wait()


# ----------------------------------------------------------------------------- compared answers
def whole(choice: dict, **body) -> bytes:
    return json.dumps({"choices": [{"index": 0, **choice}], **body}).encode()


def test_a_compared_request_with_logprobs_asks_for_two_alternatives() -> None:
    """The baseline's logprobs are asked with the top two alternatives (a margin needs two):
    `logprobs: 2` for completions, `top_logprobs: 2` for chat."""
    endpoint = Endpoint("http://x")
    assert request_body(endpoint, Ask(4, prompt="hi"), logprobs=True, stream=False)["logprobs"] == 2
    chat = request_body(endpoint, Ask(4, messages=({"role": "user", "content": "hi"},)), True, False)
    assert chat["logprobs"] is True and chat["top_logprobs"] == 2


@pytest.mark.parametrize(
    "content",
    [
        whole({"text": "a", "finish_reason": "length"}, usage={"completion_tokens": -1}),
        whole({"text": "a", "finish_reason": "length"}, usage={"prompt_tokens": -3}),
        whole({"text": "a", "finish_reason": ""}),
    ],
    ids=["negative-completion", "negative-prompt", "empty-finish"],
)
def test_a_negative_count_or_an_empty_finish_reason_is_a_malformed_body(content: bytes) -> None:
    """A usage count below 0 is no count, and an empty finish_reason no reason."""
    with pytest.raises(AnswerError) as caught:
        read_whole(content, chat=False)
    assert caught.value.name == "malformed_body"


def test_a_prompt_count_that_contradicts_the_echoed_prompt_ids_is_inconsistent() -> None:
    """The echoed prompt ids, in the choice or at the top of the body, are held to
    `usage.prompt_tokens`."""
    echoed = whole(
        {"text": "a", "finish_reason": "length", "prompt_token_ids": [5, 6]}, usage={"prompt_tokens": 3}
    )
    with pytest.raises(AnswerError) as caught:
        read_whole(echoed, chat=False)
    assert caught.value.name == "inconsistent_answer"
    top = whole(
        {"text": "a", "finish_reason": "length"}, prompt_token_ids=[5, 6, 7], usage={"prompt_tokens": 3}
    )
    answer = read_whole(top, chat=False)
    assert answer.prompt_ids == [5, 6, 7] and answer.prompt_tokens == 3


def test_chat_logprobs_without_token_ids_name_no_ids() -> None:
    """Chat logprobs whose entries carry no `token_id` say nothing of the ids: the answer has
    none, and nothing contradicts."""
    logprobs = {"content": [{"token": "a", "logprob": -0.1, "top_logprobs": []}]}
    body = json.dumps(
        {
            "choices": [
                {"index": 0, "message": {"content": "a"}, "finish_reason": "stop", "logprobs": logprobs}
            ]
        }
    )
    answer = read_whole(body.encode(), chat=True)
    assert answer.ids is None and answer.text == "a"


def test_a_streamed_tool_call_keeps_its_type_from_the_first_piece() -> None:
    """A tool call streamed in pieces: the type the first piece names stays when the later
    pieces name none."""
    first = {"index": 0, "type": "custom", "function": {"name": "f", "arguments": "{"}}
    later = {"index": 0, "function": {"arguments": "}"}}
    events = [
        {"choices": [{"index": 0, "delta": {"tool_calls": [first]}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [later]}, "finish_reason": "tool_calls"}]},
    ]
    answer = read_stream(sse(*events), chat=True)
    assert answer.tool_calls == [{"type": "custom", "name": "f", "arguments": "{}"}]


def logprob_answer(logprobs: dict, ids: list[int] | None = None) -> Answer:
    return Answer("ab", ids, "length", logprobs=logprobs)


def test_the_margin_is_the_top_logprob_minus_the_second() -> None:
    """With three alternatives listed, the margin is between the best two, not the best and
    the worst; past the last position there is none."""
    answer = logprob_answer({"top_logprobs": [{"a": -0.1, "b": -0.5, "c": -3.0}]})
    assert margin(answer, 0) == pytest.approx(0.4)
    assert margin(answer, 1) is None
    assert listed_texts(answer, 0) == {"a", "b", "c"} and listed_texts(answer, 1) == set()


def test_alternatives_listed_by_text_only_name_no_ids() -> None:
    """A position whose alternatives carry no token id (text only) names no ids; one whose
    alternatives all carry ids names them."""
    by_id = [[{"token_id": 1, "logprob": -0.1}, {"token_id": 2, "logprob": -0.2}]]
    assert listed_ids(logprob_answer({"top_token_logprobs": by_id}), 0) == {1, 2}
    assert listed_ids(logprob_answer({"top_logprobs": [{"a": -0.1, "b": -0.2}]}), 0) is None


def test_alternative_texts_are_paired_with_ids_only_where_they_list_as_many() -> None:
    """Alternatives listed by id beside texts of another number are not paired with those
    texts; the last position's alternatives are read too."""
    by_id = [
        [{"token_id": 1, "logprob": -0.1}, {"token_id": 2, "logprob": -0.2}],
        [{"token_id": 3, "logprob": -0.1}, {"token_id": 4, "logprob": -0.3}],
    ]
    texts = [{"a": -0.1}, {"c": -0.1, "d": -0.3}]
    answer = logprob_answer({"top_token_logprobs": by_id, "top_logprobs": texts})
    assert listed_texts(answer, 0) == set()
    assert token_texts(answer, 1) == {3: "c", 4: "d"}


def test_server_info_keeps_the_engine_loop_and_a_metrics_page_of_an_error_status_is_no_snapshot() -> None:
    """`/info` gives where our engine steps (`engine_loop`) beside its torch and device; a
    `/metrics` that answers 503 with Prometheus text is no snapshot."""
    from harness.ab import server_info
    from harness.prometheus import scrape

    info = {"torch": "2.5", "engine_loop": "thread", "other": 1}
    page = "# TYPE dflash:spec_decode_num_drafts counter\ndflash:spec_decode_num_drafts_total 4\n"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            status, data = (200, json.dumps(info)) if self.path == "/info" else (503, page)
            self.send_response(status)
            self.send_header("Content-Length", str(len(data.encode())))
            self.end_headers()
            self.wfile.write(data.encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert server_info(url) == {"torch": "2.5", "engine_loop": "thread"}
        assert scrape(url + "/metrics") is None
    finally:
        server.shutdown()
        server.server_close()
