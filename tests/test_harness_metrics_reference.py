"""Every figure of a run's summary (harness/metrics.py) equals the same figure computed here
from the per-request records by the definitions in that module's docstring, written out
independently: sorted medians, percentiles by linear interpolation between order statistics,
TPOT from E2E and TTFT, per-token ITL spreading each gap over the tokens of its chunk, goodput
against each SLO. The records are drawn at random (unsorted latencies, chunks of 1 to 7
tokens, one-token requests, failures, two groups), so a figure taken from the wrong field, an
unsorted middle element or the wrong percentile cannot agree by chance."""

from __future__ import annotations

import math
import random

import pytest

from harness.client import RequestRecord
from harness.metrics import calculate_metrics

MS = 1000.0


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linear between the order statistics at rank q/100 x (n - 1)."""
    s = sorted(values)
    rank = q / 100 * (len(s) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(s) - 1)
    return s[low] + (s[high] - s[low]) * (rank - low)


def median(values: list[float]) -> float:
    s, n = sorted(values), len(values)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def stats(values: list[float], prefix: str) -> dict[str, float]:
    if not values:
        return {f"{prefix}_{s}": math.nan for s in ("mean", "median", "p90", "p99")}
    return {
        f"{prefix}_mean": sum(values) / len(values),
        f"{prefix}_median": median(values),
        f"{prefix}_p90": percentile(values, 90),
        f"{prefix}_p99": percentile(values, 99),
    }


def random_records(seed: int, count: int = 40) -> list[RequestRecord]:
    rng = random.Random(seed)
    records = []
    for i in range(count):
        if rng.random() < 0.1:
            records.append(RequestRecord(i, rng.random(), success=False, error="boom"))
            continue
        ttft = rng.uniform(0.01, 2.0)
        chunks = 1 if rng.random() < 0.1 else rng.randint(2, 30)
        times, tokens = [ttft], [1]
        for _ in range(chunks - 1):
            times.append(times[-1] + rng.expovariate(50.0))
            tokens.append(rng.randint(1, 7))
        records.append(
            RequestRecord(
                i,
                rng.uniform(0, 5),
                success=True,
                ttft_s=ttft,
                e2e_s=times[-1],
                chunk_times_s=times,
                chunk_tokens=tokens,
                output_tokens=sum(tokens),
                group=rng.choice(["short", "long"]),
            )
        )
    return records


def reference(records: list[RequestRecord], duration: float, slo: dict[str, float]) -> dict[str, float]:
    ok = [r for r in records if r.success]
    row = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration,
        "achieved_concurrency": sum(r.e2e_s for r in ok) / duration,
    }

    def tpot(r: RequestRecord) -> float | None:
        return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else None

    def token_gaps(r: RequestRecord) -> list[float]:
        out = []
        for before, after, tokens in zip(r.chunk_times_s, r.chunk_times_s[1:], r.chunk_tokens[1:]):
            out += [(after - before) / tokens] * tokens
        return out

    def chunk_gaps(r: RequestRecord) -> list[float]:
        return [after - before for before, after in zip(r.chunk_times_s, r.chunk_times_s[1:])]

    def latencies(rs: list[RequestRecord], suffix: str = "") -> dict[str, float]:
        out = stats([r.ttft_s * MS for r in rs], f"ttft_ms{suffix}")
        out |= stats([g * MS for r in rs for g in token_gaps(r)], f"itl_token_ms{suffix}")
        out |= stats([g * MS for r in rs for g in chunk_gaps(r)], f"itl_chunk_ms{suffix}")
        return out

    row |= latencies(ok)
    row |= stats([t * MS for r in ok if (t := tpot(r)) is not None], "tpot_ms")
    row |= stats([r.e2e_s * MS for r in ok], "e2e_ms")
    for group in ("short", "long"):
        row |= latencies([r for r in ok if r.group == group], f"_{group}")
    value = {
        "ttft": lambda r: r.ttft_s * MS,
        "tpot": lambda r: (tpot(r) or 0) * MS,
        "e2e": lambda r: r.e2e_s * MS,
    }
    good = sum(all(value[name](r) <= limit for name, limit in slo.items()) for r in ok)
    row["goodput_requests_per_s"] = good / duration
    return row


@pytest.mark.parametrize("seed", range(6))
def test_every_summary_figure_equals_its_definition_computed_from_the_records(seed: int) -> None:
    records = random_records(seed)
    duration = 7.5
    ok = [r for r in records if r.success]
    # SLOs at the medians, so each one passes some requests and fails others
    slo = {
        "ttft": median([r.ttft_s * MS for r in ok]),
        "tpot": median(
            [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) * MS for r in ok if r.output_tokens > 1]
        ),
        "e2e": median([r.e2e_s * MS for r in ok]),
    }
    for slos in (slo, *({name: limit} for name, limit in slo.items())):  # all together, and each alone
        got = calculate_metrics(records, duration, slos)
        want = reference(records, duration, slos)
        wrong = {
            k: (got.get(k), v)
            for k, v in want.items()
            if not math.isclose(got.get(k, math.nan), v, rel_tol=1e-9)
        }
        assert not wrong, (
            f"SLOs {sorted(slos)}: figures that do not follow their definition (got, want): {wrong}"
        )
        assert set(got) == set(want), sorted(set(got) ^ set(want))
