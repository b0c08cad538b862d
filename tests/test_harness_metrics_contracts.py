"""The benchmark client's figures, pinned where they were loosely held: run metrics
(harness/metrics.py), SSE splitting (harness/sse.py), the timing loop and its token counts
(harness/client.py), Prometheus scrapes and their differences (harness/prometheus.py), the
A/B ratios (harness/ab.py) and what a measured run writes (harness/load.py). Streams go over
real loopback HTTP where the client is concerned, Prometheus pages are real text exposition."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import random
import statistics
import sys
import time

import httpx
import pytest

from harness.ab import RATIO_METRICS, ManagedServer, bootstrap_ratio, free_port, ratios
from harness.answer import AnswerError
from harness.client import Endpoint, RequestRecord, StreamReader, send
from harness.load import LoadSpec, append_summary, measure, run_requests
from harness.metrics import calculate_metrics, count_sources
from harness.prometheus import (
    acceptance_from_counters,
    acceptance_from_requests,
    counter_contradictions,
    parse,
    scrape,
    server_cpu,
)
from harness.server_kind import KNOWN, ServerKind
from harness.sse import EventReader, event_data
from harness.workloads import Prompt, arrival_times, mixed_long, synthetic

from . import openai_stub
from .sse_stub import Script, serve
from .test_harness_metrics import record
from .test_harness_prometheus import counters
from .test_harness_sse import both_readers, serve_stream, stream_body

# ---------------------------------------------------------------------------------------------
# run metrics


def test_a_run_of_zero_duration_reports_no_rates_and_raises_nothing() -> None:
    """A measured phase that took no time (a clock that did not move) has no rate: the
    request, token and concurrency rates and the goodput read NaN, the latencies stay."""
    row = calculate_metrics([record(0, None, 0.01, [0.004], [2])], 0.0, {"ttft": 100.0})
    for key in (
        "request_throughput",
        "output_tokens_per_s",
        "achieved_concurrency",
        "goodput_requests_per_s",
    ):
        assert math.isnan(row[key]), key
    assert row["completed"] == 1 and row["ttft_ms_mean"] == pytest.approx(10.0)


def test_a_failed_request_adds_nothing_to_its_groups_latencies() -> None:
    """A request of a group that failed after streaming tokens (its TTFT and gaps recorded) is
    left out of that group's TTFT and ITLs, as it is of the run's."""
    ok = record(0, "long", 0.010, [0.004], [2])
    cut = RequestRecord(1, 0.0, success=False, error="cut", ttft_s=0.5, e2e_s=0.9, group="long")
    cut.chunk_times_s, cut.chunk_tokens, cut.output_tokens = [0.5, 0.9], [1, 1], 2
    row = calculate_metrics([ok, cut], 1.0)
    assert row["ttft_ms_long_mean"] == pytest.approx(10.0)
    assert row["itl_chunk_ms_long_mean"] == pytest.approx(4.0)
    assert row["itl_token_ms_long_mean"] == pytest.approx(2.0)


def test_a_request_not_marked_successful_is_failed_whatever_its_error_says() -> None:
    """`failed` is every request that did not succeed: one left without an error text (never
    settled) counts as failed, not as nothing."""
    unsettled = RequestRecord(1, 0.0)
    row = calculate_metrics([record(0, None, 0.01, [0.004], [1]), unsettled], 1.0)
    assert (row["completed"], row["failed"]) == (1, 1)


def test_where_counts_came_from_is_empty_when_nothing_completed() -> None:
    """With no completed request there is no count source to name."""
    assert count_sources([RequestRecord(0, 0.0, error="x", count_source="estimated")]) == ""
    assert count_sources([]) == ""


# ---------------------------------------------------------------------------------------------
# SSE splitting


def fed(pieces: list[bytes | str]) -> list[str]:
    reader = EventReader()
    return [data for piece in pieces for data in reader.feed(piece)]


def test_a_byte_order_mark_is_skipped_at_the_start_of_the_stream_only() -> None:
    """A U+FEFF opening the stream is skipped; one that opens a later piece is text of the
    event it is in, however the stream is cut into pieces."""
    assert fed(["\ufeffdata: a", "\ufeffb\n\n"]) == ["a\ufeffb"]
    body = "\ufeffdata: a\ufeffb\n\n".encode()
    for cut in range(1, len(body)):
        assert fed([body[:cut], body[cut:]]) == ["a\ufeffb"], cut


def test_a_crlf_split_over_pieces_followed_by_a_blank_line_ends_the_event() -> None:
    """`data: a` CR | LF | LF: the CR and LF are one line end, the next LF the blank line that
    ends the event; the event after it stands alone."""
    assert fed(["data: a\r", "\n", "\n", "data: b\n\n"]) == ["a", "b"]
    body = b"data: a\r\n\ndata: b\r\n\r\n"
    assert fed([body[k : k + 1] for k in range(len(body))]) == ["a", "b"] == event_data(body)


def test_a_piece_without_a_line_end_waits_for_the_rest_of_its_line() -> None:
    """A piece that ends no line yields nothing; its text starts the line the next piece ends."""
    reader = EventReader()
    assert reader.feed(b"data: he") == [] and reader.lines(b"ll") == []
    assert reader.feed(b"o\n\n") == ["hello"]


# ---------------------------------------------------------------------------------------------
# the client's reading of a stream


def read(endpoint: Endpoint, events: list[dict], done_marker: bool = True) -> RequestRecord:
    reader = StreamReader(endpoint, RequestRecord(index=0, send_s=0.0))
    for k, event in enumerate(events):
        assert not reader.event(json.dumps(event), 0.01 * (k + 1))
    if done_marker:
        reader.event("[DONE]", 0.01 * (len(events) + 1))
    return reader.finish()


def test_a_running_usage_after_chunks_with_ids_counts_only_what_it_adds() -> None:
    """A stream whose first chunk carries ids (2 tokens) and whose next carries only a running
    usage of 3: that chunk brought 1 token, not 3."""
    vllm = Endpoint("http://unused", server=KNOWN["vllm"])
    record = read(
        vllm,
        [
            {"choices": [{"text": "ab", "token_ids": [1, 2]}], "usage": {"completion_tokens": 2}},
            {"choices": [{"text": "c", "finish_reason": "length"}], "usage": {"completion_tokens": 3}},
        ],
    )
    assert record.chunk_tokens == [2, 1] and record.output_tokens == 3, record


def test_a_final_usage_from_a_server_without_running_usage_is_not_read_as_a_chunks_tokens() -> None:
    """A plain OpenAI server (no continuous usage) may put its final total on the last text
    chunk: that chunk is one estimated token, not the total less what came before."""
    plain = Endpoint("http://unused", server=KNOWN["openai"])
    record = read(
        plain,
        [
            {"choices": [{"text": "a"}]},
            {"choices": [{"text": "b", "finish_reason": "length"}], "usage": {"completion_tokens": 5}},
        ],
    )
    assert record.chunk_tokens == [1, 1] and record.count_source == "estimated"
    assert record.usage_completion_tokens == 5


def test_a_running_total_that_falls_twice_is_reported_at_its_first_fall() -> None:
    """Of several falls of a running usage, the error names the first: from 5 to 3."""
    vllm = Endpoint("http://unused", server=ServerKind("vllm", continuous_usage=True))
    events = [
        {"choices": [{"text": "x", "finish_reason": finish}], "usage": {"completion_tokens": total}}
        for total, finish in ((5, None), (3, None), (6, None), (2, "length"))
    ]
    record = read(vllm, events, done_marker=False)
    assert record.error == "inconsistent token counts: usage.completion_tokens fell from 5 to 3"


def test_prompt_tokens_once_reported_stay_when_later_chunks_omit_them() -> None:
    """The prompt's token count a server reported is kept when later chunks do not repeat
    it: an OpenAI chunk without `usage`, an SGLang `meta_info` without `prompt_tokens`."""
    record = read(
        Endpoint("http://unused"),
        [
            {"choices": [{"text": "a", "token_ids": [1]}], "usage": {"prompt_tokens": 7}},
            {"choices": [{"text": "b", "token_ids": [2], "finish_reason": "length"}]},
        ],
    )
    assert record.success and record.prompt_tokens == 7
    sglang = read(
        Endpoint("http://unused", kind="sglang"),
        [
            {"text": "a", "meta_info": {"prompt_tokens": 9, "completion_tokens": 1}},
            {"text": "ab", "meta_info": {"completion_tokens": 2, "finish_reason": {"type": "length"}}},
        ],
        done_marker=False,
    )
    assert sglang.success and sglang.prompt_tokens == 9 and sglang.output_tokens == 2


def test_speculative_statistics_in_a_usage_only_chunk_are_kept() -> None:
    """Our server's per-request `spec_decode` may come in the final usage chunk, which has no
    choices: the record keeps it."""
    spec = {"steps": 1, "proposed": 7, "accepted": 1, "acceptance_lengths": [2]}
    record = read(
        Endpoint("http://unused"),
        [
            {"choices": [{"text": "ab", "token_ids": [1, 2], "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}, "spec_decode": spec},
        ],
    )
    assert record.success and record.spec_decode == spec


def test_an_error_member_ends_the_stream_whatever_its_value() -> None:
    """An event carrying an `error` member, even an empty object, is the server's error."""
    reader = StreamReader(Endpoint("http://unused"), RequestRecord(index=0, send_s=0.0))
    assert not reader.event(json.dumps({"choices": [{"text": "a", "token_ids": [1]}]}), 0.01)
    assert reader.event(json.dumps({"choices": [], "error": {}}), 0.02)
    record = reader.finish()
    assert not record.success and record.error.startswith("server error in stream")


def test_a_null_error_member_beside_a_token_is_no_error() -> None:
    """A stream whose chunks carry `"error": null` beside their tokens reports no error: both
    readers of it (`harness compare`'s and the benchmark client's, over HTTP) read the whole
    answer."""
    body = stream_body(
        {"choices": [{"index": 0, "text": "a", "token_ids": [1], "finish_reason": None}], "error": None},
        {"choices": [{"index": 0, "text": "b", "token_ids": [2], "finish_reason": "length"}], "error": None},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
    )
    answer, record = both_readers(body)
    assert not isinstance(answer, AnswerError) and answer.ids == [1, 2], answer
    assert record.success and record.output_tokens == 2, record.error


def test_an_http_error_status_is_recorded_with_its_code_and_body() -> None:
    """A request answered with a non-200 status fails, its error naming the status and the
    start of the body."""
    server, url = openai_stub.serve(lambda prompt, n: ["a"])
    try:
        endpoint = Endpoint(url.rstrip("/") + "/nowhere", server=KNOWN["openai"])

        async def go() -> RequestRecord:
            async with httpx.AsyncClient() as client:
                return await send(client, endpoint, {"prompt": "x"}, 0, time.perf_counter(), 5.0)

        record = asyncio.run(go())
    finally:
        server.shutdown()
    assert not record.success and record.error.startswith("HTTP 404: ") and "Not Found" in record.error


def test_a_base_url_with_a_trailing_slash_reaches_the_endpoint_path() -> None:
    """The endpoint URL joins the base URL and the kind's path with one slash."""
    assert Endpoint("http://127.0.0.1:9/").url == "http://127.0.0.1:9/v1/completions"
    assert Endpoint("http://127.0.0.1:9//", kind="sglang").url == "http://127.0.0.1:9/generate"


def test_each_requests_chunk_times_count_from_its_own_send() -> None:
    """At concurrency 1 the later requests are sent later in the run; each one's TTFT and
    E2E still count from its own send: send time plus E2E never passes the run's end."""
    server, url = serve(Script([(0.05, [1]), (0.05, [2, 3])]))
    try:
        spec = LoadSpec(concurrency=1, num_prompts=3, output_len=3, timeout_s=10.0)
        records, duration = asyncio.run(run_requests(Endpoint(url), synthetic(3, 4, 0), spec))
    finally:
        server.shutdown()
    assert all(r.success for r in records)
    assert records[-1].send_s >= 0.2
    for r in records:
        assert r.send_s + r.e2e_s <= duration + 1e-6, (r.send_s, r.e2e_s, duration)
        assert r.ttft_s < r.e2e_s


def test_a_crlf_stream_over_http_reads_whole() -> None:
    """Real SSE bytes over loopback, one token chunk, a usage chunk and [DONE]: one token,
    its prompt count, the done marker."""
    body = (
        b'data: {"choices": [{"text": "a", "token_ids": [4], "finish_reason": "length"}]}\r\n\r\n'
        b'data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}}\r\n\r\n'
        b"data: [DONE]\r\n\r\n"
    )
    server, url = serve_stream(body)
    try:

        async def go() -> RequestRecord:
            async with httpx.AsyncClient() as client:
                return await send(client, Endpoint(url), {"prompt": "x"}, 0, time.perf_counter(), 5.0)

        record = asyncio.run(go())
    finally:
        server.shutdown()
    assert record.success and record.token_ids == [4] and record.prompt_tokens == 2 and record.done_marker


# ---------------------------------------------------------------------------------------------
# Prometheus


def test_cpu_counters_are_summed_over_their_label_sets() -> None:
    """An engine CPU counter exported once a label set (one a rank) reads as their sum."""
    page = (
        "# TYPE dflash:engine_cpu_seconds_total counter\n"
        'dflash:engine_cpu_seconds_total{rank="0"} 10\n'
        'dflash:engine_cpu_seconds_total{rank="1"} 20\n'
    )
    assert parse(page)["cpu:engine"] == 30.0


def test_counters_that_appear_during_the_run_are_differenced_from_zero() -> None:
    """A labelled counter is exported only once it has counted: a page before the run
    without the spec-decode samples, or without the per-position ones, reads them as 0."""
    after = counters("vllm:", 10, 70, 30, [8, 6], 'engine="0"')
    got = acceptance_from_counters(parse(""), parse(after))
    assert got["acceptance_length"] == pytest.approx(4.0)
    assert got["acceptance_per_position"] == pytest.approx([0.8, 0.6])
    before = counters("vllm:", 5, 35, 10, [], 'engine="0"')
    got = acceptance_from_counters(parse(before), parse(after))
    assert got["acceptance_length"] == pytest.approx(1 + 20 / 5)
    assert got["acceptance_per_position"] == pytest.approx([8 / 5, 6 / 5])


def test_only_the_first_position_out_of_order_is_named() -> None:
    """Positions checked in order: the first that breaks the bound is named and the check
    of positions stops there."""
    before = parse(counters("vllm:", 0, 0, 0, [0, 0, 0, 0], 'engine="0"'))
    after = parse(counters("vllm:", 10, 40, 20, [5, 6, 2, 7], 'engine="0"'))
    assert (
        counter_contradictions(before, after, [])
        == "position 2 accepted 6 times, more than the 5 position 1's"
    )


def test_a_run_with_a_request_that_failed_before_its_first_token_is_not_held_to_its_streams() -> None:
    """The committed-tokens bound holds only when every request completed: one request that
    failed without a token (the server may have gone on committing for it) lifts the bound,
    the same counters over the completed ones alone break it."""
    before = parse(counters("vllm:", 10, 70, 20, [9, 6, 5], 'engine="0"'))
    after = parse(counters("vllm:", 18, 150, 100, [17, 14, 13], 'engine="0"'))
    completed = [RequestRecord(i, 0.0, success=True, chunk_tokens=[1, 32]) for i in range(2)]
    assert counter_contradictions(before, after, completed).startswith(
        "the drafted steps committed 88 tokens"
    )
    timed_out = RequestRecord(2, 0.0, error="timed out after 5 s")
    assert counter_contradictions(before, after, [*completed, timed_out]) == ""


def test_a_run_of_zero_duration_has_no_cpu_share() -> None:
    """CPU shares over a run that took no time are not given (and raise nothing)."""
    page = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total {}\n"
    assert server_cpu(parse(page.format(1)), parse(page.format(2)), 0.0) == {}


def test_per_request_acceptance_rate_is_accepted_over_proposed() -> None:
    """Our server's per-request figures: the rate is accepted draft tokens over proposed ones,
    the length committed tokens over steps."""
    spec = {"steps": 3, "proposed": 21, "accepted": 6, "acceptance_lengths": [4, 1, 4]}
    got = acceptance_from_requests([RequestRecord(0, 0.0, success=True, spec_decode=spec)])
    assert got["acceptance_rate"] == pytest.approx(6 / 21)
    assert got["acceptance_length"] == pytest.approx(3.0)


def test_sglang_acceptance_counts_completed_requests_only() -> None:
    """A failed request's `meta_info` is left out of SGLang's per-request acceptance."""
    records = [
        RequestRecord(0, 0.0, success=True, meta_info={"spec_verify_ct": 10, "completion_tokens": 30}),
        RequestRecord(1, 0.0, error="cut", meta_info={"spec_verify_ct": 10, "completion_tokens": 10}),
    ]
    assert acceptance_from_requests(records)["acceptance_length"] == pytest.approx(3.0)


def test_a_metrics_page_that_is_not_there_or_not_answering_is_no_snapshot() -> None:
    """A server whose /metrics answers 404, or nothing listening at the URL, gives no
    snapshot (None), not an error."""
    server, url = openai_stub.serve(lambda prompt, n: ["a"])
    try:
        assert scrape(url + "/metrics", timeout=5.0) is None
    finally:
        server.shutdown()
    assert scrape(f"http://127.0.0.1:{free_port()}/metrics", timeout=2.0) is None


def test_a_scrape_reads_a_served_page() -> None:
    """A served page of counters is read through the same parse as its text."""
    page = counters("dflash:", 4, 28, 12, [4, 3], 'server="ref"')
    server, url = serve(Script([(0.0, [1])], metrics_text=page))
    try:
        assert scrape(url + "/metrics") == parse(page)
    finally:
        server.shutdown()


# ---------------------------------------------------------------------------------------------
# A/B ratios


def test_the_ratio_is_of_medians_not_means() -> None:
    """A skewed side's outlier moves its mean, not its median: the ratio follows the medians."""
    point, low, high = bootstrap_ratio([100.0, 100.0, 400.0], [200.0, 200.0, 200.0])
    assert point == pytest.approx(2.0)


def test_the_interval_leaves_out_two_and_a_half_percent_of_resampled_ratios_on_each_side() -> None:
    """The 95% interval: of the 2000 ratios of resampled medians (B's repeats then A's drawn
    from Random(seed)), sorted, the 51st and the 1950th: 50 below it and 50 above it (40
    repeats a side, so that no two resampled ratios near either bound tie)."""
    rng = random.Random(7)
    a = [rng.uniform(90, 110) for _ in range(40)]
    b = [rng.uniform(95, 130) for _ in range(40)]
    draw = random.Random(5)
    resampled = sorted(
        statistics.median(draw.choices(b, k=len(b))) / statistics.median(draw.choices(a, k=len(a)))
        for _ in range(2000)
    )
    assert (
        resampled[49] < resampled[50] < resampled[51] and resampled[1948] < resampled[1949] < resampled[1950]
    )
    point, low, high = bootstrap_ratio(a, b, seed=5)
    assert point == statistics.median(b) / statistics.median(a)
    assert (low, high) == (resampled[50], resampled[-51])


def summaries_of(values: dict[int, tuple[list[float], list[float]]], metric: str = "output_tokens_per_s"):
    return [
        {"label": label, "concurrency": c, **dict.fromkeys(RATIO_METRICS, math.nan), metric: value}
        for c, sides in values.items()
        for label, side in zip("AB", sides)
        for value in side
    ]


def test_a_metric_whose_baseline_median_is_zero_has_no_ratio(tmp_path) -> None:
    """No ratio is made over an A median of zero; the other metrics still get theirs."""
    rows = summaries_of({1: ([0.0, 0.0, 1.0], [2.0, 2.0, 2.0])}, "ttft_ms_median")
    for r in rows:
        r["output_tokens_per_s"] = 10.0 if r["label"] == "A" else 20.0
    got = ratios(rows, tmp_path / "ab.csv")
    assert [r["metric"] for r in got] == ["output_tokens_per_s"]


def test_ratio_rows_come_in_concurrency_order_and_the_file_holds_them_all(tmp_path) -> None:
    """ab.csv: one row a (concurrency, metric) with a ratio, concurrencies ascending, every
    row written with the header of its fields."""
    summaries = summaries_of({16: ([10.0], [20.0]), 1: ([10.0], [30.0]), 4: ([10.0], [40.0])})
    got = ratios(summaries, tmp_path / "ab.csv")
    assert [r["concurrency"] for r in got] == [1, 4, 16]
    assert [r["ratio"] for r in got] == pytest.approx([3.0, 4.0, 2.0])
    with (tmp_path / "ab.csv").open() as f:
        written = list(csv.DictReader(f))
    assert [(int(r["concurrency"]), r["metric"]) for r in written] == [
        (r["concurrency"], r["metric"]) for r in got
    ]
    assert list(written[0]) == list(got[0])
    assert float(written[2]["b_median"]) == 20.0 and written[0]["within_noise"] == "False"


def test_no_ratio_rows_write_no_file(tmp_path) -> None:
    """Summaries with one side only give no rows and no ab.csv, and raise nothing."""
    assert (
        ratios([{"label": "A", "concurrency": 1, **dict.fromkeys(RATIO_METRICS, 1.0)}], tmp_path / "ab.csv")
        == []
    )
    assert not (tmp_path / "ab.csv").exists()


def test_a_server_that_dies_before_it_is_healthy_is_reported_with_its_last_output(tmp_path) -> None:
    """The error of a server command that exits during start-up names its exit status and
    quotes the last lines of its output (where its reason is), not the first ones."""
    script = "import sys\nfor i in range(20):\n    print(f'line {i}')\nsys.exit(3)\n"
    (tmp_path / "dies.py").write_text(script)
    with pytest.raises(RuntimeError) as caught:
        ManagedServer.start(
            f"{sys.executable} {tmp_path / 'dies.py'} --port {{port}}", tmp_path / "log.txt", 30.0
        )
    message = str(caught.value)
    assert "exited with 3" in message and "line 19" in message and "line 12" in message
    assert "line 11\n" not in message and "line 0\n" not in message


# ---------------------------------------------------------------------------------------------
# a measured run


def test_the_warm_up_is_sent_at_once_whatever_the_measured_arrival_rate(tmp_path) -> None:
    """The warm-up requests go out together (no arrival schedule), even when the measured
    requests follow a slow arrival rate."""
    seed, rate = 1, 2.0
    schedule = arrival_times(3, rate, 1.0, seed)
    assert schedule[-1] > 1.0  # the measured schedule would spread three requests this far
    posted: list[float] = []
    server, url = openai_stub.serve(lambda prompt, n: posted.append(time.perf_counter()) or ["a", "b"])
    try:
        spec = LoadSpec(
            concurrency=3, num_prompts=1, output_len=2, warmup=3, request_rate=rate, seed=seed, timeout_s=10.0
        )
        labels = {"label": "A", "concurrency": 3, "repeat": 0}
        endpoint = Endpoint(url, server=KNOWN["openai"])
        summary = measure(endpoint, synthetic(4, 4, 0, as_text=True), spec, tmp_path, labels, None)
    finally:
        server.shutdown()
    assert summary["completed"] == 1 and len(posted) == 4
    assert posted[2] - posted[0] < 0.5, posted


def test_the_same_error_of_many_requests_is_named_once(tmp_path) -> None:
    """The summary's errors are the distinct error texts: four requests failed alike read as
    one error."""
    server, url = serve(Script([(0.0, [1]), (0.0, [2])], usage_over=1))
    try:
        spec = LoadSpec(concurrency=2, num_prompts=4, output_len=2, warmup=0, timeout_s=5.0)
        summary = measure(Endpoint(url), synthetic(4, 4, 0), spec, tmp_path, {"label": "A"}, None)
    finally:
        server.shutdown()
    assert summary["failed"] == 4
    assert summary["errors"] == "inconsistent token counts: usage.completion_tokens is 3 for 2 token ids"


def test_a_grouped_workload_reports_each_groups_latencies_and_tags_each_row(tmp_path) -> None:
    """Prompts tagged short and long: every request row carries its prompt's group, and the
    summary has each group's TTFT and ITLs."""
    server, url = serve(Script([(0.0, [1]), (0.0, [2, 3])]))
    try:
        prompts = mixed_long(8, 4, 16, 0.25, 0)
        spec = LoadSpec(concurrency=2, num_prompts=8, output_len=3, warmup=0, timeout_s=5.0)
        summary = measure(Endpoint(url), prompts, spec, tmp_path, {"label": "A"}, None)
    finally:
        server.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert sorted((r["index"], r["group"]) for r in rows) == [(i, p.group) for i, p in enumerate(prompts)]
    assert {p.group for p in prompts} == {"short", "long"}
    for group in ("short", "long"):
        assert not math.isnan(summary[f"ttft_ms_{group}_median"]), group
        assert summary[f"itl_chunk_ms_{group}_mean"] >= 0


def test_a_prompt_with_its_own_output_length_asks_for_it() -> None:
    """A dataset prompt that gives its own `max_tokens` is sent with it; the others with the
    run's output length."""
    bodies: list[dict] = []
    server, url = openai_stub.serve(lambda prompt, n: ["a"] * n, bodies)
    try:
        prompts = [Prompt(text="one", max_tokens=5), Prompt(text="two")]
        spec = LoadSpec(concurrency=1, num_prompts=2, output_len=3, timeout_s=5.0)
        records, _ = asyncio.run(run_requests(Endpoint(url, server=KNOWN["openai"]), prompts, spec))
    finally:
        server.shutdown()
    assert [b["max_tokens"] for b in bodies] == [5, 3]
    assert [r.output_tokens for r in records] == [5, 3]


def test_a_summary_file_left_empty_gets_its_header_first(tmp_path) -> None:
    """A summary.csv that exists but is empty (a full disk) is written as a new one: header,
    then the row."""
    path = tmp_path / "summary.csv"
    path.write_text("")
    append_summary(path, {"label": "A", "concurrency": 2, "repeat": 0, "completed": 5})
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and rows[0]["label"] == "A" and rows[0]["completed"] == "5"


def test_a_run_with_an_arrival_rate_runs_in_one_client_process(tmp_path) -> None:
    """Client processes split a closed loop only: asked for two with an arrival rate, the run
    is measured in one and says so."""
    server, url = serve(Script([(0.0, [1]), (0.0, [2])]))
    try:
        spec = LoadSpec(
            concurrency=4,
            num_prompts=4,
            output_len=2,
            warmup=0,
            request_rate=1000.0,
            timeout_s=5.0,
            client_processes=2,
        )
        summary = measure(Endpoint(url), synthetic(4, 4, 0), spec, tmp_path, {"label": "A"}, None)
    finally:
        server.shutdown()
    assert summary["completed"] == 4 and summary["client_processes"] == 1
