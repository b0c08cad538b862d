"""The server's Prometheus page (serving/metrics.py), what it accepts of a request body
(serving/limits.py) and the deadlines and answers of one connection (serving/connections.py):
each read back as a scraper or a client sees it, the page parsed with prometheus_client's own
parser, the connection driven through the server's h11 protocol on an in-memory transport."""

from __future__ import annotations

import asyncio
import json

import h11
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request

from reference_engine.runtime.stats import SpecCounters
from reference_engine.serving.async_engine import EngineTotals
from reference_engine.serving.limits import BodyLimits, decode_json, read_body
from reference_engine.serving.metrics import LATENCY_BUCKETS, ServerMetrics
from reference_engine.serving.protocol import ProtocolError

from .test_cli_lifecycle_contracts import POST_HEAD, opened, run_for
from .test_serve_metrics import idle_engine, samples, value


# ------------------------------------------------------------------ the Prometheus page
def page_of(metrics: ServerMetrics, totals: EngineTotals | None = None) -> dict:
    return samples(metrics.render(totals or idle_engine())[0])


def test_the_gauges_show_the_engines_running_waiting_and_kv_cache_share() -> None:
    """num_requests_running, num_requests_waiting and kv_cache_usage_perc are the engine's
    latest totals given to render, each its own value."""
    metrics = ServerMetrics()
    page = page_of(metrics, EngineTotals(0, running=3, waiting=5, kv_cache_usage=0.25))
    assert value(page, "dflash:num_requests_running") == 3
    assert value(page, "dflash:num_requests_waiting") == 5
    assert value(page, "dflash:kv_cache_usage_perc") == 0.25
    page = page_of(metrics, EngineTotals(0, running=0, waiting=1, kv_cache_usage=0.0))
    assert value(page, "dflash:num_requests_running") == 0
    assert value(page, "dflash:num_requests_waiting") == 1
    assert value(page, "dflash:kv_cache_usage_perc") == 0.0


def test_the_page_has_no_created_series_and_each_histogram_has_the_documented_buckets() -> None:
    """No `*_created` sample is exported; each latency histogram has exactly the
    LATENCY_BUCKETS bounds (from 0.5 ms) and +Inf, and a value on a bound falls in that bound's
    bucket."""
    metrics = ServerMetrics()
    counted = metrics.request(prompt_tokens=1, arrival_s=0.0)
    counted.delivered(1, 0.0075)  # exactly a bound
    counted.delivered(2, 0.0075 + 2 * 0.003)  # two tokens, 3 ms each
    counted.finish("stop")
    text = metrics.render(idle_engine())[0].decode()
    names = [s.name for f in text_string_to_metric_families(text) for s in f.samples]
    assert not [n for n in names if n.endswith("_created")]
    assert LATENCY_BUCKETS[0] == 0.0005
    for histogram in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        bounds = [
            float(s.labels["le"])
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == f"dflash:{histogram}_seconds_bucket"
        ]
        assert bounds == [*LATENCY_BUCKETS, float("inf")], histogram
    page = samples(text)
    ttft = "dflash:time_to_first_token_seconds_bucket"
    assert value(page, ttft, le="0.005") == 0 and value(page, ttft, le="0.0075") == 1
    itl = "dflash:inter_token_latency_seconds_bucket"
    assert value(page, itl, le="0.002") == 0 and value(page, itl, le="0.003") == 2


def test_a_total_that_never_moved_from_zero_has_no_labelled_series() -> None:
    """A labelled counter (fallback reason, verify width, draft-ahead outcome, phase, draft
    position) appears on the page only once the engine's total for it is above zero."""
    metrics = ServerMetrics()
    totals = EngineTotals(
        0,
        SpecCounters(),
        {4: 0},
        fallbacks={"no_draft": 0},
        phases={"host_s_draft": 0.0},
        draft_ahead={"queued": 0},
    )
    metrics.on_step(totals)
    page = page_of(metrics)
    labelled = {
        name
        for name, labels in page
        if labels and name.startswith("dflash:") and not name.endswith(("_bucket",))
    }
    assert labelled == set()
    metrics.on_step(EngineTotals(0, SpecCounters(), {4: 1}, fallbacks={"no_draft": 2}))
    page = page_of(metrics)
    assert value(page, "dflash:spec_decode_verify_width_total", width="4") == 1
    assert value(page, "dflash:spec_decode_fallbacks_total", reason="no_draft") == 2


def test_a_delivery_of_no_tokens_is_no_first_token() -> None:
    """delivered(0, t) counts nothing: the first token's time is that of the first delivery
    that carried a token, and a later gap is measured from it."""
    metrics = ServerMetrics()
    counted = metrics.request(prompt_tokens=1, arrival_s=10.0)
    counted.delivered(0, 10.1)
    counted.delivered(1, 10.5)
    counted.delivered(0, 10.7)
    counted.delivered(1, 11.0)
    counted.finish("length")
    page = page_of(metrics)
    assert value(page, "dflash:time_to_first_token_seconds_count") == 1
    assert value(page, "dflash:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value(page, "dflash:inter_token_latency_seconds_count") == 1
    assert value(page, "dflash:inter_token_latency_seconds_sum") == pytest.approx(0.5)
    assert value(page, "dflash:generation_tokens_total") == 2


def test_totals_seen_before_a_reset_and_never_rendered_are_still_counted() -> None:
    """Totals the engine reported before a reset of its statistics, with no page rendered
    between, are counted; the totals after the reset add to them, for every engine counter."""
    metrics = ServerMetrics()
    spec = SpecCounters()
    spec.record(7, 2, 3)
    metrics.on_step(EngineTotals(0, spec, {7: 1}, fallbacks={"x": 1}, steps=4, engine_cpu_s=1.0))
    spec = SpecCounters()
    spec.record(7, 1, 2)
    metrics.on_step(EngineTotals(1, spec, {7: 1}, fallbacks={"x": 1}, steps=1, engine_cpu_s=1.5))
    page = page_of(metrics, idle_engine(epoch=1))
    assert value(page, "dflash:spec_decode_num_drafts_total") == 2
    assert value(page, "dflash:spec_decode_num_accepted_tokens_total") == 3
    assert value(page, "dflash:spec_decode_verify_width_total", width="7") == 2
    assert value(page, "dflash:spec_decode_fallbacks_total", reason="x") == 2
    assert value(page, "dflash:engine_steps_total") == 5
    assert value(page, "dflash:engine_cpu_seconds_total") == pytest.approx(1.5)


def test_a_page_rendered_twice_with_the_same_totals_counts_them_once() -> None:
    """Rendering again, with no new totals or with the same totals given again, leaves every
    engine counter where it was."""
    metrics = ServerMetrics()
    spec = SpecCounters()
    spec.record(7, 3, 4)
    totals = EngineTotals(0, spec, {7: 1}, fallbacks={"x": 2}, steps=3, engine_cpu_s=0.5)
    metrics.on_step(totals)
    first = page_of(metrics)
    second = page_of(metrics)
    metrics.on_step(totals)
    third = page_of(metrics)
    keep = ("dflash:spec_", "dflash:engine_")
    for page in (second, third):
        assert {k: v for k, v in page.items() if k[0].startswith(keep)} == {
            k: v for k, v in first.items() if k[0].startswith(keep)
        }
    assert value(first, "dflash:engine_steps_total") == 3


# ------------------------------------------------------------------ what a body may be
def request_with(headers: list[tuple[bytes, bytes]], messages: list[dict]) -> Request:
    async def receive():
        if not messages:
            raise AssertionError("the body was read past its end")
        return messages.pop(0)

    return Request({"type": "http", "method": "POST", "headers": headers}, receive)


def read(headers: list[tuple[bytes, bytes]], messages: list[dict], limits: BodyLimits | None = None) -> bytes:
    return asyncio.run(read_body(request_with(headers, messages), limits or BodyLimits()))


def whole(body: bytes) -> list[dict]:
    return [{"type": "http.request", "body": body, "more_body": False}]


@pytest.mark.parametrize(
    "content_type", ["application/json", "Application/JSON", "application/json ; charset=utf-8"]
)
def test_a_json_content_type_is_read_whatever_its_case_spacing_or_parameters(content_type: str) -> None:
    """The media type is compared without case, parameters or the spaces on either side."""
    assert read([(b"content-type", content_type.encode())], whole(b"{}")) == b"{}"


@pytest.mark.parametrize("content_type", [None, b"text/plain", b"application/x-www-form-urlencoded"])
def test_a_body_not_declared_as_json_gets_415_naming_what_was_sent(content_type: bytes | None) -> None:
    """A body without a JSON Content-Type is refused with 415, before any of it is read."""
    headers = [] if content_type is None else [(b"content-type", content_type)]
    with pytest.raises(ProtocolError, match="application/json") as info:
        read(headers, [])
    assert info.value.status == 415
    assert (content_type.decode() if content_type else "no Content-Type") in str(info.value)


def test_a_declared_length_over_the_limit_gets_413_before_the_body_is_read() -> None:
    """A Content-Length past max_bytes is refused from the header alone, naming the length."""
    headers = [(b"content-type", b"application/json"), (b"content-length", b"101")]
    with pytest.raises(ProtocolError, match="has 101 bytes or more; this server accepts at most 100") as info:
        read(headers, [], BodyLimits(max_bytes=100))
    assert info.value.status == 413


def test_a_content_length_that_is_not_a_number_is_left_to_the_stream_count() -> None:
    """A Content-Length header that is not digits is not trusted: the body is read and
    counted as it streams in."""
    headers = [(b"content-type", b"application/json"), (b"content-length", b"ten")]
    assert read(headers, whole(b"[1]"), BodyLimits(max_bytes=10)) == b"[1]"


def test_a_client_that_goes_away_mid_body_ends_the_read_with_an_error() -> None:
    """A disconnect before the last part of the body is a ProtocolError, not a short body."""
    messages = [
        {"type": "http.request", "body": b'{"prompt": ', "more_body": True},
        {"type": "http.disconnect"},
    ]
    with pytest.raises(ProtocolError, match="connection closed before the request body was complete"):
        read([(b"content-type", b"application/json")], messages)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"a": NaN}', "NaN is not valid JSON"),
        (b"[Infinity]", "Infinity is not valid JSON"),
        (b"[-Infinity]", "-Infinity is not valid JSON"),
        (b'{"a": 1, "a": 2}', "the key 'a' appears twice"),
        (b'{"b": {"a": 1, "a": 1}}', "the key 'a' appears twice"),
        (b'{"\\udc00": 1}', "invalid character"),
        (b'{"a": ["ok", "\\ud800"]}', "invalid character"),
        (b'{"a": "\\ud800"}', "invalid character"),
        (b'{"a": "\xff"}', "not valid UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "more than 32 levels deep"),
    ],
    ids=[
        "nan",
        "infinity",
        "minus-infinity",
        "duplicate-key",
        "nested-duplicate-key",
        "surrogate-key",
        "surrogate-in-list",
        "surrogate-value",
        "bad-utf8",
        "very-deep",
    ],
)
def test_json_that_is_not_plain_data_gets_400(raw: bytes, message: str) -> None:
    """decode_json refuses non-finite constants, a key twice in one object, a lone surrogate
    anywhere (key, value, list item), bytes that are not UTF-8 and nesting far past the limit,
    each as a 400 naming the cause."""
    with pytest.raises(ProtocolError, match=message) as info:
        decode_json(raw, BodyLimits())
    assert info.value.status == 400


def test_plain_json_is_decoded_as_it_is() -> None:
    """A body of plain data comes back as json.loads gives it, strings with any valid text."""
    raw = '{"a": [1, -2, 3.5, "é\U0001f600", {"b": null}], "c": true}'.encode()
    assert decode_json(raw, BodyLimits()) == {"a": [1, -2, 3.5, "é\U0001f600", {"b": None}], "c": True}


# ------------------------------------------------------------------ one connection
def answer_of(written: bytes) -> tuple[h11.Response, bytes, bool]:
    """The one response in `written`, parsed as a client would, its body and whether it
    was followed by anything else."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
    client.send(h11.EndOfMessage())
    client.receive_data(written)
    head = client.next_event()
    assert isinstance(head, h11.Response), head
    body = b""
    while True:
        event = client.next_event()
        if isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            break
        else:
            raise AssertionError(f"the response ended early: {event!r}")
    return head, body, bool(client.trailing_data[0])


def test_a_connection_over_the_cap_gets_503_with_retry_after_and_a_json_error(loop) -> None:
    """Past max_connections the request gets 503, Retry-After: 1, Connection: close and an
    OpenAI error body naming the limit."""
    protocol, transport = opened(loop, header_s=5.0, body_s=5.0, cap=0)
    protocol.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    run_for(loop, 0.05)
    head, body, _ = answer_of(transport.written)
    assert head.status_code == 503
    headers = dict(head.headers)
    assert headers[b"retry-after"] == b"1" and headers[b"connection"] == b"close"
    assert headers[b"content-type"] == b"application/json"
    error = json.loads(body)["error"]
    assert error["type"] == "service_unavailable" and error["code"] == 503
    assert "0 connections open" in error["message"] and "--max-connections" in error["message"]


def test_the_408_answer_is_one_whole_response_with_its_length_and_reason(loop) -> None:
    """The body-timeout answer parses as one complete HTTP response: status 408 with its
    reason phrase, a Content-Length that matches the JSON error body, Connection: close."""
    protocol, transport = opened(loop, header_s=5.0, body_s=0.05)
    protocol.data_received(POST_HEAD)
    run_for(loop, 0.15)
    head, body, trailing = answer_of(transport.written)
    assert head.status_code == 408 and head.reason == b"Request Timeout"
    assert dict(head.headers)[b"connection"] == b"close"
    error = json.loads(body)["error"]
    assert error["code"] == 408 and error["type"] == "invalid_request_error"
    assert not trailing


def test_a_trickled_body_gets_408_at_its_deadline_from_the_headers(loop) -> None:
    """The body deadline runs from the headers: bytes arriving before it do not restart it."""
    protocol, transport = opened(loop, header_s=5.0, body_s=0.3)
    protocol.data_received(POST_HEAD)
    for _ in range(6):
        run_for(loop, 0.1)
        if transport.written:
            break
        protocol.data_received(b" ")
    assert transport.written.startswith(b"HTTP/1.1 408 ")


async def answers_without_reading(scope, receive, send) -> None:
    """A route that answers at once, before its body is in."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_a_request_its_route_answered_gets_no_second_answer_when_the_client_ends_early(loop) -> None:
    """When the route has already answered, a client closing mid-body writes nothing more."""
    errors: list[dict] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    protocol, transport = opened(loop, header_s=5.0, body_s=5.0, app=answers_without_reading)
    protocol.data_received(POST_HEAD + b"{")
    run_for(loop, 0.05)
    answered = transport.written
    assert answered.startswith(b"HTTP/1.1 200 ")
    protocol.eof_received()
    run_for(loop, 0.05)
    assert transport.written == answered and errors == []


async def answers_slowly(scope, receive, send) -> None:
    """A route that takes 0.3 s before it answers."""
    await asyncio.sleep(0.3)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_the_next_header_deadline_runs_from_the_response_not_from_the_request(loop) -> None:
    """While a route works no header deadline runs; once it has answered, the client has the
    whole header timeout for its next request."""
    protocol, transport = opened(loop, header_s=0.4, body_s=5.0, app=answers_slowly)
    protocol.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    run_for(loop, 0.35)
    assert transport.written.startswith(b"HTTP/1.1 200 ")
    run_for(loop, 0.2)  # 0.55 s from the request, 0.25 s from the response
    assert not transport.closed
    run_for(loop, 0.4)
    assert transport.closed
