"""Prometheus metrics of the reference server (prometheus_client, its own registry).

Names (prefix `dflash:`), with the semantics of vLLM's spec-decode counters:
- `dflash:spec_decode_num_drafts_total`: speculative steps (one draft block each);
- `dflash:spec_decode_num_draft_tokens_total`: draft tokens proposed;
- `dflash:spec_decode_num_accepted_tokens_total`: draft tokens accepted (never the bonus);
- `dflash:spec_decode_num_accepted_tokens_per_pos_total{position="k"}`: steps whose draft
  token k (1-based) was accepted. Mean acceptance length = 1 + accepted / drafts.
  With `--metrics-names` these four are also exported under vLLM's (`vllm:`) and lmdeploy's
  (`lmdeploy:`) names, side by side, each with its own position numbering (`SPEC_NAMINGS`:
  both number from 0), so their benchmark clients read our acceptance as they read their own.
- `dflash:spec_decode_verify_width_total{width}`: speculative steps by the draft tokens each
  row verified (the verify width the step chose, runtime/verify_width.py);
- `dflash:spec_decode_fallbacks_total{reason}`: requests moved to plain decode;
- `dflash:spec_decode_draft_ahead_total{outcome}`: drafts queued behind a step's commit
  (`queued`), those the next step took (`used`; the others it drafted afresh, its rows having
  changed) and of those the ones whose head it ran again for a wider verify (`widened`);
- `dflash:engine_steps_total`: engine steps (prefill, plain decode, speculative, or a mix);
- `dflash:request_success_total{finish_reason}` (stop: an EOS or stop token, or a stop
  string; length; abort: the client went away or the server shut down) and
  `dflash:request_failure_total` (requests the engine failed: an exception or a non-finite
  distribution in that request alone): every request counted once, in one of the two;
- `dflash:prompt_tokens_total`, `dflash:generation_tokens_total` (the responses' output
  tokens: those past a stop string are not counted), `dflash:num_requests_running`,
  `dflash:num_requests_waiting`, `dflash:kv_cache_usage_perc` (vLLM's name: the share of the
  KV cache the running requests hold, 0 to 1; with a pooled cache its cells, else its slots);
- `dflash:time_to_first_token_seconds` (every request that got a token),
  `dflash:inter_token_latency_seconds` (per token: the gap between two deliveries divided
  evenly among the tokens the later one carried), `dflash:e2e_request_latency_seconds`
  (every request, to its last token, or to its end when it got none) histograms, with
  buckets from 0.5 ms so millisecond-scale decode is resolved;
- `dflash:phase_seconds_total{phase}`: engine time per phase: host seconds, or CUDA-event time
  on a GPU with `--device-phase-times` (EngineTotals.device_phases);
- `dflash:engine_cpu_seconds_total`: CPU time of the thread that runs the engine loop, and
  prometheus_client's `process_cpu_seconds_total` (with the other `process_*` series, on
  Linux) of the server's own process: over a run, each divided by its duration is the share
  of a core that the engine loop and the HTTP event loop were busy (near 1: that Python
  thread, not the GPU, set the pace; the harness reports both).

Two sources. What the engine did (the spec counters, fallbacks, phase times, gauges) is the
engine's own statistics: the engine loop delivers its totals with each step's outputs
(async_engine.py), `on_step` keeps them before the step's tokens reach any client, and a page
rendered after that shows them exactly (device times of a step's phases come a turn later,
when their events are done). The counters are brought to the latest totals when a page is
rendered (and before a reset of the engine's statistics is taken in), not at every step:
nothing reads them between, and one pass a scrape costs less than a pass a step (at c16 on the
demo pair, a pass a step was 15% of a DFlash server's event loop). What
each client got (the request, token and latency metrics) is counted by the handler that
answers the request (`RequestMetrics`): only it knows how the request ended, since it cuts
stop strings and sees a client go away.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.openmetrics import exposition as openmetrics_text

if TYPE_CHECKING:
    from .async_engine import EngineTotals


PREFIX = "dflash"
# prefix -> the number its per-position label gives the first draft token
SPEC_NAMINGS = {"dflash": 1, "vllm": 0, "lmdeploy": 0}
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
    60.0,
)
FAILED = "error"  # the finish reason of a request the engine failed
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"  # what every scraper reads


class Latencies(Histogram):
    """A histogram that takes one value observed `count` times in one call (a DFlash chunk's
    tokens share one inter-token gap): the buckets, count and sum that `count` calls of
    `observe` give, at the cost of one."""

    def observe_many(self, amount: float, count: int) -> None:
        if count <= 0:
            return
        self._raise_if_not_observable()
        self._sum.inc(amount * count)
        at = bisect.bisect_left(self._upper_bounds, amount)  # the first bound >= amount
        if at < len(self._buckets) and amount <= self._upper_bounds[at]:  # NaN: no bucket
            self._buckets[at].inc(count)


class AcceptanceCounters:
    """The four spec-decode counters under one naming: its prefix, and the number its
    per-position label gives the first draft token."""

    def __init__(self, registry: CollectorRegistry, prefix: str, first_position: int) -> None:
        r, p = registry, prefix
        self.first_position = first_position
        self.drafts = Counter(f"{p}:spec_decode_num_drafts", "Speculative steps", registry=r)
        self.draft_tokens = Counter(f"{p}:spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter(f"{p}:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter(
            f"{p}:spec_decode_num_accepted_tokens_per_pos",
            f"Steps whose draft token at this position (numbered from {first_position}) was accepted",
            ["position"],
            registry=r,
        )

    def at(self, position: int) -> Counter:
        """The counter of draft token `position` (1-based, as the engine counts)."""
        return self.accepted_per_pos.labels(position=str(position - 1 + self.first_position))


class ServerMetrics:
    def __init__(self, spec_names: tuple[str, ...] = (PREFIX,)) -> None:
        """`spec_names`: the namings (SPEC_NAMINGS) the acceptance counters are exported under."""
        disable_created_metrics()  # no *_created series: scrapers diff the counters only
        self.registry = CollectorRegistry()
        r, p = self.registry, PREFIX
        self.acceptance = [AcceptanceCounters(r, name, SPEC_NAMINGS[name]) for name in spec_names]
        self.verify_width = Counter(
            f"{p}:spec_decode_verify_width", "Speculative steps by verify width", ["width"], registry=r
        )
        self.fallbacks = Counter(
            f"{p}:spec_decode_fallbacks", "Requests moved to plain decode", ["reason"], registry=r
        )
        self.requests = Counter(f"{p}:request_success", "Finished requests", ["finish_reason"], registry=r)
        self.failures = Counter(f"{p}:request_failure", "Requests the engine failed", registry=r)
        self.prompt_tokens = Counter(f"{p}:prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            f"{p}:generation_tokens", "Output tokens of the responses", registry=r
        )
        self.running = Gauge(f"{p}:num_requests_running", "Requests with a slot", registry=r)
        self.waiting = Gauge(f"{p}:num_requests_waiting", "Requests queued", registry=r)
        self.kv_cache_usage = Gauge(
            f"{p}:kv_cache_usage_perc", "Share of the KV cache the running requests hold, 0 to 1", registry=r
        )
        self.ttft = Histogram(
            f"{p}:time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Latencies(
            f"{p}:inter_token_latency_seconds",
            "Per-token inter-token latency",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{p}:e2e_request_latency_seconds",
            "End-to-end request latency",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.phase_seconds = Counter(f"{p}:phase_seconds", "Engine time per phase", ["phase"], registry=r)
        self.engine_steps = Counter(f"{p}:engine_steps", "Engine steps", registry=r)
        self.draft_ahead = Counter(
            f"{p}:spec_decode_draft_ahead",
            "Drafts queued behind a step's commit (queued), taken by the next step (used), "
            "and of those run again for a wider verify (widened)",
            ["outcome"],
            registry=r,
        )
        self.engine_cpu = Counter(
            f"{p}:engine_cpu_seconds", "CPU time of the thread that runs the engine loop", registry=r
        )
        self._engine_cpu_seen = 0.0  # a thread's CPU time: not restarted by the engine's resets
        ProcessCollector(registry=r)  # process_cpu_seconds_total and the rest, of this process
        self._seen: dict[str, float] = {}  # last engine totals: counters advance by differences
        self._epoch = 0  # the engine's resets seen (Engine.stats_epoch)
        self._latest: EngineTotals | None = None  # the totals the counters are not yet at

    def _advance(self, key: str, counters: Callable[[], list[Counter]], value: float) -> None:
        """Advance each of `counters()` (one count under several names) to the engine total
        `value`; the counters are looked up only when the total moved (a labelled child's
        lookup costs more than the comparison, and most totals stand still in a turn)."""
        delta = value - self._seen.get(key, 0)  # since the last turn seen, or the last reset
        self._seen[key] = value
        if delta > 0:
            for counter in counters():
                counter.inc(delta)

    def on_step(self, totals: EngineTotals) -> None:
        """Called on the event loop with each turn's engine totals, before its outputs are
        handed on: kept, and taken into the counters when a page is rendered (`settle`)."""
        if totals.stats_epoch != self._epoch:  # Engine.reset_stats: every total restarted from zero
            self.settle()  # the counts before the reset, then counting starts again
            self._seen.clear()
            self._epoch = totals.stats_epoch
        self._latest = totals

    def settle(self) -> None:
        """Advance the engine's counters to the latest totals `on_step` was given."""
        totals, self._latest = self._latest, None
        if totals is None:
            return
        if totals.engine_cpu_s > self._engine_cpu_seen:
            self.engine_cpu.inc(totals.engine_cpu_s - self._engine_cpu_seen)
            self._engine_cpu_seen = totals.engine_cpu_s
        spec = totals.spec_totals
        names = self.acceptance
        self._advance("drafts", lambda: [c.drafts for c in names], spec.steps)
        self._advance("draft_tokens", lambda: [c.draft_tokens for c in names], spec.proposed)
        self._advance("accepted", lambda: [c.accepted for c in names], spec.accepted)
        for pos, count in spec.accepted_per_position.items():
            self._advance(f"pos{pos}", lambda pos=pos: [c.at(pos) for c in names], count)
        for width, count in totals.verify_widths.items():
            self._advance(f"width:{width}", lambda w=width: [self.verify_width.labels(width=str(w))], count)
        for reason, count in totals.fallbacks.items():
            self._advance(f"fallback:{reason}", lambda r=reason: [self.fallbacks.labels(reason=r)], count)
        self._advance("steps", lambda: [self.engine_steps], totals.steps)
        for outcome, count in totals.draft_ahead.items():
            self._advance(f"ahead:{outcome}", lambda o=outcome: [self.draft_ahead.labels(outcome=o)], count)
        kind = "device_s_" if totals.device_phases else "host_s_"
        for name, seconds in totals.phases.items():
            if name.startswith(kind):
                phase = name[len(kind) :]
                self._advance(name, lambda p=phase: [self.phase_seconds.labels(phase=p)], seconds)

    def _gauges(self, totals: EngineTotals) -> None:
        self.running.set(totals.running)
        self.waiting.set(totals.waiting)
        self.kv_cache_usage.set(totals.kv_cache_usage)

    def request(self, prompt_tokens: int, arrival_s: float) -> RequestMetrics:
        """The metrics of one request that arrived at `arrival_s` (time.monotonic())."""
        return RequestMetrics(self, prompt_tokens, arrival_s)

    def render(self, totals: EngineTotals, openmetrics: bool = False) -> tuple[bytes, str]:
        """The page and its content type: Prometheus text 0.0.4, or OpenMetrics 1.0.0 for a
        scraper that asks for it. `totals`: the engine's latest (its gauges are shown)."""
        self.settle()
        self._gauges(totals)
        if openmetrics:
            return openmetrics_text.generate_latest(self.registry), openmetrics_text.CONTENT_TYPE_LATEST
        return generate_latest(self.registry), PROMETHEUS_TEXT


class RequestMetrics:
    """One request's share of the server metrics, as its client sees it, fed by the handler
    that answers it. The first `finish` counts the request; later calls change nothing, so
    however many ways a request seems to end (a stop string cut, then the engine's abort;
    a client gone after its last token), it is counted once."""

    def __init__(self, metrics: ServerMetrics, prompt_tokens: int, arrival_s: float) -> None:
        self.metrics = metrics
        self.prompt_tokens = prompt_tokens
        self.arrival_s = arrival_s
        self.last_token_s: float | None = None  # engine commit time of the last delivery
        self.finish_reason: str | None = None  # set once, by the first `finish`

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def delivered(self, count: int, time_s: float) -> None:
        """`count` output tokens of the response, committed by the engine at `time_s`
        (time.monotonic())."""
        if count <= 0 or self.finished:
            return
        m = self.metrics
        m.generation_tokens.inc(count)
        if self.last_token_s is None:
            m.ttft.observe(time_s - self.arrival_s)
        else:
            m.itl.observe_many((time_s - self.last_token_s) / count, count)
        self.last_token_s = time_s

    def finish(self, finish_reason: str) -> None:
        """Count the request as ended with `finish_reason` ("error": the engine failed it)."""
        if self.finished:
            return
        self.finish_reason = finish_reason
        m = self.metrics
        if finish_reason == FAILED:
            m.failures.inc()
        else:
            m.requests.labels(finish_reason=finish_reason).inc()
        m.prompt_tokens.inc(self.prompt_tokens)
        end = self.last_token_s if self.last_token_s is not None else time.monotonic()
        m.e2e.observe(end - self.arrival_s)
