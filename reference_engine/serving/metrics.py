"""Prometheus metrics of the reference server (prometheus_client, its own registry).

Names (prefix `dflash:`), with the semantics of vLLM's spec-decode counters:
- `dflash:spec_decode_num_drafts_total`: speculative steps (one draft block each);
- `dflash:spec_decode_num_draft_tokens_total`: draft tokens proposed;
- `dflash:spec_decode_num_accepted_tokens_total`: draft tokens accepted;
- `dflash:spec_decode_num_accepted_tokens_per_pos_total{position="k"}`: steps whose draft
  token k (1-based) was accepted. Mean acceptance length = 1 + accepted / drafts.
- `dflash:spec_decode_fallbacks_total{reason}`: requests moved to plain decode;
- `dflash:request_success_total{finish_reason}`, `dflash:request_failure_total` (requests
  the engine failed: an exception or a non-finite distribution in that request alone),
  `dflash:prompt_tokens_total`,
  `dflash:generation_tokens_total`, `dflash:num_requests_running`, `dflash:num_requests_waiting`;
- `dflash:time_to_first_token_seconds`, `dflash:inter_token_latency_seconds` (per token:
  a step's gap divided evenly among the tokens it committed), `dflash:e2e_request_latency_seconds`
  histograms, with buckets from 0.5 ms so millisecond-scale decode is resolved;
- `dflash:phase_seconds_total{phase}`: engine time per phase (CUDA-event time on a GPU).
The spec counters advance by exactly the engine's own statistics, step by step.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from ..runtime.engine import Engine, StepOutput

PREFIX = "dflash"
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
                   0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0,
                   60.0)


class ServerMetrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series: scrapers diff the counters only
        self.registry = CollectorRegistry()
        r, p = self.registry, PREFIX
        self.drafts = Counter(f"{p}:spec_decode_num_drafts", "Speculative steps", registry=r)
        self.draft_tokens = Counter(f"{p}:spec_decode_num_draft_tokens", "Draft tokens proposed",
                                    registry=r)
        self.accepted = Counter(f"{p}:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                registry=r)
        self.accepted_per_pos = Counter(f"{p}:spec_decode_num_accepted_tokens_per_pos",
                                         "Steps whose draft token at this position was accepted",
                                         ["position"], registry=r)
        self.fallbacks = Counter(f"{p}:spec_decode_fallbacks", "Requests moved to plain decode",
                                 ["reason"], registry=r)
        self.requests = Counter(f"{p}:request_success", "Finished requests", ["finish_reason"],
                                registry=r)
        self.failures = Counter(f"{p}:request_failure", "Requests the engine failed",
                                registry=r)
        self.prompt_tokens = Counter(f"{p}:prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(f"{p}:generation_tokens", "Generated tokens", registry=r)
        self.running = Gauge(f"{p}:num_requests_running", "Requests with a slot", registry=r)
        self.waiting = Gauge(f"{p}:num_requests_waiting", "Requests queued", registry=r)
        self.ttft = Histogram(f"{p}:time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{p}:inter_token_latency_seconds", "Per-token inter-token latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}:e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.phase_seconds = Counter(f"{p}:phase_seconds", "Engine time per phase", ["phase"],
                                     registry=r)
        self._seen: dict = {}  # last engine totals, to advance counters by the differences
        self._last_token_time: dict[str, float] = {}

    def _advance(self, key: str, counter, value: float) -> None:
        delta = value - self._seen.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._seen[key] = value

    def on_step(self, engine: Engine, outputs: list[StepOutput]) -> None:
        """Called on the engine thread after each step."""
        spec = engine.spec_totals
        self._advance("drafts", self.drafts, spec.steps)
        self._advance("draft_tokens", self.draft_tokens, spec.proposed)
        self._advance("accepted", self.accepted, spec.accepted)
        for pos, count in spec.accepted_per_position.items():
            self._advance(f"pos{pos}", self.accepted_per_pos.labels(position=str(pos)), count)
        for reason, count in engine.fallbacks.items():
            self._advance(f"fallback:{reason}", self.fallbacks.labels(reason=reason), count)
        kind = "device_s_" if engine.device.type == "cuda" else "host_s_"
        for name, seconds in engine.timer.as_dict().items():
            if name.startswith(kind):
                phase = name[len(kind):]
                self._advance(name, self.phase_seconds.labels(phase=phase), seconds)
        self.running.set(len(engine.active))
        self.waiting.set(len(engine.waiting))
        for out in outputs:
            if not out.new_token_ids:
                if out.finished:
                    self._last_token_time.pop(out.request_id, None)
                continue
            self.generation_tokens.inc(len(out.new_token_ids))
            last = self._last_token_time.get(out.request_id)
            if last is not None:
                gap = (out.time_s - last) / len(out.new_token_ids)
                for _ in out.new_token_ids:
                    self.itl.observe(gap)
            self._last_token_time[out.request_id] = out.time_s
            if out.finished:
                self._last_token_time.pop(out.request_id, None)

    def on_failed(self, request_id: str, reason: str) -> None:
        self.failures.inc()

    def on_finished(self, sequence) -> None:
        if sequence.finish_reason == "error":
            return  # counted by on_failed
        self.requests.labels(finish_reason=sequence.finish_reason or "abort").inc()
        self.prompt_tokens.inc(len(sequence.prompt_ids))
        if sequence.first_token_s is not None:
            self.ttft.observe(sequence.first_token_s - sequence.arrival_s)
        end = sequence.finished_s or time.monotonic()
        self.e2e.observe(end - sequence.arrival_s)

    def render(self, engine: Engine) -> bytes:
        # gauges are read at scrape time too: an idle engine takes no step to refresh them
        self.running.set(len(engine.active))
        self.waiting.set(len(engine.waiting))
        return generate_latest(self.registry)
