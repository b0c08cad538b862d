"""Run metrics from per-request records: one pure function, definitions stated once.

- TTFT: request sent -> first chunk that carries a token.
- E2E latency: request sent -> last chunk that carries a token.
- TPOT per request = (E2E - TTFT) / (output_tokens - 1); one-token requests are left out.
- Per-token ITL: each gap between token-bearing chunks is divided evenly among the tokens
  the later chunk carries (one value per token). Chunk ITL: the raw gaps, one per chunk.
  Under speculative decoding one chunk carries several tokens, so the two differ a lot.
- Output throughput = all output tokens / wall time of the measured phase (warm-up
  excluded); request throughput likewise.
- Achieved concurrency = sum of request E2E / wall time (mean requests in flight).
- Goodput = requests per second meeting every given SLO (TTFT, TPOT, E2E in ms).
- Per group (a workload that tags its prompts, e.g. short and long): TTFT and both ITLs over
  that group's requests alone, columns `<metric>_<group>_<stat>`.
Statistics: mean, median, p90, p99 across values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .client import RequestRecord

STATS = ("mean", "median", "p90", "p99")
GROUP_LATENCIES = ("ttft_ms", "itl_token_ms", "itl_chunk_ms")  # reported per workload group


def summarize(values: Sequence[float], prefix: str) -> dict[str, float]:
    if not values:
        return {f"{prefix}_{s}": math.nan for s in STATS}
    a = np.asarray(values, dtype=float)
    return {
        f"{prefix}_mean": float(a.mean()),
        f"{prefix}_median": float(np.median(a)),
        f"{prefix}_p90": float(np.percentile(a, 90)),
        f"{prefix}_p99": float(np.percentile(a, 99)),
    }


def per_token_itl(record: RequestRecord) -> list[float]:
    out = []
    for i in range(1, len(record.chunk_times_s)):
        gap = record.chunk_times_s[i] - record.chunk_times_s[i - 1]
        k = record.chunk_tokens[i]
        out += [gap / k] * k
    return out


def chunk_itl(record: RequestRecord) -> list[float]:
    t = record.chunk_times_s
    return [t[i] - t[i - 1] for i in range(1, len(t))]


def tpot(record: RequestRecord) -> float | None:
    if record.output_tokens <= 1 or record.ttft_s is None or record.e2e_s is None:
        return None
    return (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)


def calculate_metrics(
    records: Sequence[RequestRecord], duration_s: float, slo_ms: dict[str, float] | None = None
) -> dict[str, float]:
    ok = [r for r in records if r.success]
    ms = 1000.0
    row: dict[str, float] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else math.nan,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration_s if duration_s > 0 else math.nan,
        "achieved_concurrency": sum(r.e2e_s or 0 for r in ok) / duration_s if duration_s > 0 else math.nan,
    }
    row |= summarize([r.ttft_s * ms for r in ok if r.ttft_s is not None], "ttft_ms")
    row |= summarize([t * ms for r in ok if (t := tpot(r)) is not None], "tpot_ms")
    row |= summarize([v * ms for r in ok for v in per_token_itl(r)], "itl_token_ms")
    row |= summarize([v * ms for r in ok for v in chunk_itl(r)], "itl_chunk_ms")
    row |= summarize([r.e2e_s * ms for r in ok if r.e2e_s is not None], "e2e_ms")
    for group in dict.fromkeys(r.group for r in records if r.group is not None):
        mine = [r for r in ok if r.group == group]
        row |= summarize([r.ttft_s * ms for r in mine if r.ttft_s is not None], f"ttft_ms_{group}")
        row |= summarize([v * ms for r in mine for v in per_token_itl(r)], f"itl_token_ms_{group}")
        row |= summarize([v * ms for r in mine for v in chunk_itl(r)], f"itl_chunk_ms_{group}")
    if slo_ms:
        good = 0
        for r in ok:
            values = {"ttft": (r.ttft_s or 0) * ms, "tpot": (tpot(r) or 0) * ms, "e2e": (r.e2e_s or 0) * ms}
            good += all(values[k] <= v for k, v in slo_ms.items())
        row["goodput_requests_per_s"] = good / duration_s if duration_s > 0 else math.nan
    return row


def count_sources(records: Sequence[RequestRecord]) -> str:
    """Where the completed requests' token counts came from, e.g. `server_ids` or
    `tokenizer (3), estimated (1)` when requests differ."""
    ok = [r.count_source or "none" for r in records if r.success]
    counts = {s: ok.count(s) for s in dict.fromkeys(ok)}
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{s} ({n})" for s, n in counts.items())
