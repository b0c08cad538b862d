"""The server's metrics (reference_engine/serving/metrics.py) and how requests reach them
(async_engine.py, server.py): each request is counted once, by the way its client saw it
end; the engine's counters advance by its own statistics before a client sees the step."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.openmetrics import parser as openmetrics_parser
from prometheus_client.parser import text_string_to_metric_families

from reference_engine.runtime.stats import SpecCounters
from reference_engine.serving.async_engine import EngineTotals
from reference_engine.serving.metrics import FAILED, ServerMetrics

from .server_process import ServerProcess

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str | bytes) -> Samples:
    """Every sample of a Prometheus text page, keyed by (name, sorted labels)."""
    if isinstance(text, bytes):
        text = text.decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(page: Samples, name: str, **labels: str) -> float:
    return page.get((name, tuple(sorted(labels.items()))), 0.0)


def idle_engine(
    spec: SpecCounters | None = None, verify_widths: dict[int, int] | None = None, epoch: int = 0
) -> EngineTotals:
    """The totals of an engine with nothing running (`epoch`: its resets so far)."""
    return EngineTotals(epoch, spec or SpecCounters(), verify_widths or {})


# ------------------------------------------------------------------ one request, counted once
@pytest.mark.parametrize("reason", ["stop", "length", "abort", FAILED])
def test_a_request_is_counted_once_in_its_finish_reason_and_in_each_histogram(reason: str) -> None:
    metrics = ServerMetrics()
    counted = metrics.request(prompt_tokens=5, arrival_s=10.0)
    counted.delivered(1, 10.25)
    counted.delivered(3, 10.5)  # one speculative step's three tokens
    for again in (reason, "stop", "abort"):  # a stop string cut, then the engine's abort lands
        counted.finish(again)
    page = samples(metrics.render(idle_engine())[0])
    success = value(page, "dflash:request_success_total", finish_reason=reason)
    assert success == (0 if reason == FAILED else 1)
    assert value(page, "dflash:request_failure_total") == (1 if reason == FAILED else 0)
    assert sum(v for (name, _), v in page.items() if name == "dflash:request_success_total") == success
    assert value(page, "dflash:prompt_tokens_total") == 5
    assert value(page, "dflash:generation_tokens_total") == 4
    assert value(page, "dflash:time_to_first_token_seconds_count") == 1
    assert value(page, "dflash:time_to_first_token_seconds_sum") == pytest.approx(0.25)
    # the second delivery's gap, shared evenly by its three tokens
    assert value(page, "dflash:inter_token_latency_seconds_count") == 3
    assert value(page, "dflash:inter_token_latency_seconds_sum") == pytest.approx(0.25)
    # to the last token, not to when the abort of a stop string landed
    assert value(page, "dflash:e2e_request_latency_seconds_count") == 1
    assert value(page, "dflash:e2e_request_latency_seconds_sum") == pytest.approx(0.5)


def test_a_request_that_ends_before_its_first_token_is_in_e2e_but_not_in_ttft() -> None:
    metrics = ServerMetrics()
    metrics.request(prompt_tokens=3, arrival_s=time.monotonic()).finish("abort")
    page = samples(metrics.render(idle_engine())[0])
    assert value(page, "dflash:request_success_total", finish_reason="abort") == 1
    assert value(page, "dflash:e2e_request_latency_seconds_count") == 1
    assert value(page, "dflash:time_to_first_token_seconds_count") == 0
    assert value(page, "dflash:generation_tokens_total") == 0


def test_tokens_delivered_after_the_request_ended_are_not_counted() -> None:
    """A request is counted as its client saw it: once it has ended (a stop string cut, a
    client gone), tokens the engine committed before the abort landed are neither output
    tokens nor inter-token gaps."""
    metrics = ServerMetrics()
    counted = metrics.request(prompt_tokens=2, arrival_s=10.0)
    counted.delivered(1, 10.25)
    counted.delivered(2, 10.5)
    counted.finish("stop")
    counted.delivered(4, 11.0)  # the engine's tokens after the cut
    page = samples(metrics.render(idle_engine())[0])
    assert value(page, "dflash:generation_tokens_total") == 3
    assert value(page, "dflash:time_to_first_token_seconds_count") == 1
    assert value(page, "dflash:inter_token_latency_seconds_count") == 2
    assert value(page, "dflash:inter_token_latency_seconds_sum") == pytest.approx(0.25)
    assert value(page, "dflash:e2e_request_latency_seconds_sum") == pytest.approx(0.5)


def test_verify_widths_count_the_engines_steps_per_width() -> None:
    metrics = ServerMetrics()
    metrics.on_step(idle_engine(verify_widths={15: 2, 3: 1}))
    metrics.on_step(idle_engine(verify_widths={15: 2, 3: 4}))
    page = samples(metrics.render(idle_engine())[0])
    assert value(page, "dflash:spec_decode_verify_width_total", width="15") == 2
    assert value(page, "dflash:spec_decode_verify_width_total", width="3") == 4


def test_engine_steps_and_drafts_ahead_are_the_engines_totals() -> None:
    metrics = ServerMetrics()
    metrics.on_step(EngineTotals(0, steps=5, draft_ahead={"queued": 3, "used": 2, "widened": 0}))
    metrics.on_step(EngineTotals(0, steps=9, draft_ahead={"queued": 6, "used": 4, "widened": 1}))
    metrics.on_step(EngineTotals(1, steps=2, draft_ahead={"queued": 1, "used": 1, "widened": 0}))  # a reset
    page = samples(metrics.render(idle_engine(epoch=1))[0])
    assert value(page, "dflash:engine_steps_total") == 11
    assert value(page, "dflash:spec_decode_draft_ahead_total", outcome="queued") == 7
    assert value(page, "dflash:spec_decode_draft_ahead_total", outcome="used") == 5
    assert value(page, "dflash:spec_decode_draft_ahead_total", outcome="widened") == 1


@pytest.mark.parametrize(
    "device_phases, seconds",
    [(False, {"draft": 1.5, "verify": 2.0}), (True, {"draft": 0.25, "verify": 0.5})],
    ids=["host", "device"],
)
def test_phase_seconds_are_the_device_times_when_the_engine_times_the_device_else_the_host_times(
    device_phases: bool, seconds: dict[str, float]
) -> None:
    """The engine's phase timer reports host seconds per phase, and device seconds too when it
    times the device (CUDA events, --device-phase-times): the counter takes the device's then
    and the host's otherwise, labelled by the phase's own name, at the engine's latest totals.
    The first totals hold no device time yet (it comes a turn later), and none is counted from
    the host's in its place."""
    metrics = ServerMetrics()
    first = {"host_s_draft": 1.0, "host_s_verify": 1.5}
    metrics.on_step(EngineTotals(0, phases=first, device_phases=device_phases))
    metrics.render(idle_engine())
    later = {"host_s_draft": 1.5, "host_s_verify": 2.0, "device_s_draft": 0.25, "device_s_verify": 0.5}
    metrics.on_step(EngineTotals(0, phases=later, device_phases=device_phases))
    page = samples(metrics.render(idle_engine())[0])
    got = {
        dict(labels)["phase"]: v for (name, labels), v in page.items() if name == "dflash:phase_seconds_total"
    }
    assert got == pytest.approx(seconds)


def test_engine_counters_advance_by_the_totals_differences_and_survive_a_reset() -> None:
    metrics = ServerMetrics()
    spec = SpecCounters()
    spec.record(7, 3, 4)
    spec.record(7, 7, 8)
    metrics.on_step(idle_engine(spec))
    metrics.on_step(idle_engine(spec))  # the same totals again: nothing new
    spec = SpecCounters()  # Engine.reset_stats
    spec.record(7, 1, 2)
    metrics.on_step(idle_engine(spec, epoch=1))
    page = samples(metrics.render(idle_engine())[0])
    assert value(page, "dflash:spec_decode_num_drafts_total") == 3
    assert value(page, "dflash:spec_decode_num_draft_tokens_total") == 21
    assert value(page, "dflash:spec_decode_num_accepted_tokens_total") == 11  # no bonus
    per_pos = {
        int(dict(labels)["position"]): v
        for (name, labels), v in page.items()
        if name == "dflash:spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert per_pos == {1: 3, 2: 2, 3: 2, 4: 1, 5: 1, 6: 1, 7: 1}


def test_a_reset_whose_new_totals_pass_the_old_ones_is_counted_whole() -> None:
    """Totals that restart and, by the next step seen, exceed what was seen before the reset
    do not look restarted: the engine's reset count says so, and all of them are new."""
    metrics = ServerMetrics()
    spec = SpecCounters()
    spec.record(7, 3, 4)
    metrics.on_step(idle_engine(spec, verify_widths={7: 1}))
    spec = SpecCounters()  # Engine.reset_stats, then two steps before the next one seen
    spec.record(7, 2, 3)
    spec.record(7, 5, 6)
    metrics.on_step(idle_engine(spec, verify_widths={7: 2}, epoch=1))
    page = samples(metrics.render(idle_engine(epoch=1))[0])
    assert value(page, "dflash:spec_decode_num_drafts_total") == 3
    assert value(page, "dflash:spec_decode_num_accepted_tokens_total") == 3 + 2 + 5
    assert value(page, "dflash:spec_decode_verify_width_total", width="7") == 3


def test_the_acceptance_counters_under_vllm_and_lmdeploy_names_count_the_same_from_position_0() -> None:
    metrics = ServerMetrics(("dflash", "vllm", "lmdeploy"))
    spec = SpecCounters()
    spec.record(7, 3, 4)
    spec.record(7, 1, 2)
    metrics.on_step(idle_engine(spec))
    page = samples(metrics.render(idle_engine())[0])
    for prefix, first in (("dflash", 1), ("vllm", 0), ("lmdeploy", 0)):
        assert value(page, f"{prefix}:spec_decode_num_drafts_total") == 2
        assert value(page, f"{prefix}:spec_decode_num_draft_tokens_total") == 14
        assert value(page, f"{prefix}:spec_decode_num_accepted_tokens_total") == 4
        per_pos = {
            int(dict(labels)["position"]): v
            for (name, labels), v in page.items()
            if name == f"{prefix}:spec_decode_num_accepted_tokens_per_pos_total"
        }
        assert per_pos == {first: 2, first + 1: 1, first + 2: 1}, prefix
    # only the acceptance counters have aliases
    assert not any(name.startswith("vllm:") and "request" in name for name, _ in page)


def test_openmetrics_is_the_same_page_in_the_other_format() -> None:
    metrics = ServerMetrics()
    metrics.request(prompt_tokens=3, arrival_s=time.monotonic()).finish("stop")
    page, content_type = metrics.render(idle_engine(), openmetrics=True)
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    assert page.decode().endswith("# EOF\n")
    families = {f.name for f in openmetrics_parser.text_string_to_metric_families(page.decode())}
    assert "dflash:request_success" in families


@pytest.fixture(scope="module")
def pair_dirs(tiny_pair):
    return tiny_pair("qwen3", block_size=4)


# ------------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def server(pair_dirs):
    server = ServerProcess(
        "--model", str(pair_dirs[0]), "--dflash-draft-model-path", str(pair_dirs[1]), "--dtype", "float64"
    )
    yield server
    server.stop()


def test_requests_ended_by_a_stop_string_or_a_disconnect_are_counted(server) -> None:
    body = {"prompt": [5, 17, 99], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    text = full["choices"][0]["text"]
    stop = next(
        (
            text[i : i + 2]
            for i in range(3, len(text) - 2)
            if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2] and text.find(text[i : i + 2]) == i
        ),
        None,
    )
    if stop is None:
        pytest.skip(f"no clean stop string in {text!r}")
    before = samples(httpx.get(server.url + "/metrics").text)
    cut = httpx.post(server.url + "/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    with httpx.stream(
        "POST", server.url + "/v1/completions", timeout=60, json={**body, "stop": [stop], "stream": True}
    ) as r:
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    with httpx.stream(
        "POST", server.url + "/v1/completions", timeout=60, json={**body, "max_tokens": 2000, "stream": True}
    ) as r:
        next(r.iter_lines())  # one event, then hang up
    deadline = time.monotonic() + 20
    while True:
        after = samples(httpx.get(server.url + "/metrics").text)
        aborted = value(after, "dflash:request_success_total", finish_reason="abort") - value(
            before, "dflash:request_success_total", finish_reason="abort"
        )
        if aborted or time.monotonic() > deadline:
            break
        time.sleep(0.05)

    def diff(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert diff("dflash:request_success_total", finish_reason="stop") == 2
    assert aborted == 1
    assert diff("dflash:request_success_total", finish_reason="length") == 0
    assert diff("dflash:e2e_request_latency_seconds_count") == 3
    assert diff("dflash:time_to_first_token_seconds_count") == 3
    assert diff("dflash:prompt_tokens_total") == 9
    assert diff("dflash:generation_tokens_total") >= 2 * cut["usage"]["completion_tokens"] + 1
    # the per-request figures of a stop-string request cover every step the engine took
    assert cut["spec_decode"]["steps"] >= 1


def test_the_engine_loops_cpu_time_is_counted_once_across_a_reset_and_the_process_is_exported() -> None:
    """The engine loop's CPU time is its thread's, which an engine reset does not restart:
    the counter follows it, not the reset's new epoch."""
    metrics = ServerMetrics()
    metrics.on_step(EngineTotals(0, engine_cpu_s=2.0))
    metrics.on_step(EngineTotals(0, engine_cpu_s=3.5))
    page = samples(metrics.render(idle_engine())[0])
    assert value(page, "dflash:engine_cpu_seconds_total") == 3.5
    metrics.on_step(EngineTotals(1, engine_cpu_s=4.0))  # Engine.reset_stats, then a step
    page = samples(metrics.render(idle_engine(epoch=1))[0])
    assert value(page, "dflash:engine_cpu_seconds_total") == 4.0
    assert value(page, "process_cpu_seconds_total") > 0  # the server's own process (Linux)


def test_a_gap_observed_for_several_tokens_at_once_fills_the_buckets_as_one_call_a_token() -> None:
    """A DFlash chunk's tokens share one inter-token gap, observed in one call
    (`Latencies.observe_many`): the same buckets, count and sum as one `observe` a token,
    for values below, on, between and past the bounds."""
    from prometheus_client import CollectorRegistry, generate_latest

    from reference_engine.serving.metrics import LATENCY_BUCKETS, Latencies

    values = [0.0, -0.001, 1e-6, 0.0005, 0.00051, 0.001, 0.0049, 0.005, 0.25, 60.0, 61.0, 1e9, float("inf")]
    values += list(LATENCY_BUCKETS)
    for count in (0, 1, 2, 3, 7):
        pages = []
        for many in (True, False):
            registry = CollectorRegistry()
            histogram = Latencies("itl", "gaps", buckets=LATENCY_BUCKETS, registry=registry)
            for v in values:
                if many:
                    histogram.observe_many(v, count)
                else:
                    for _ in range(count):
                        histogram.observe(v)
            pages.append(samples(generate_latest(registry).decode()))
        many_page, single_page = pages
        assert many_page.keys() == single_page.keys()
        for key, v in single_page.items():
            if key[0] == "itl_sum":
                assert many_page[key] == pytest.approx(v, rel=1e-12, abs=1e-12), count
            else:
                assert many_page[key] == v, (key, count)
    nan = Latencies("nan_itl", "gaps", buckets=LATENCY_BUCKETS, registry=CollectorRegistry())
    nan.observe_many(float("nan"), 2)  # as `observe`: in no bucket
    assert sum(b.get() for b in nan._buckets) == 0
