"""Acceptance metrics from a server: Prometheus counter differences, or per-request data.

Counters are snapshotted right after warm-up and right after the run, and only their
differences are used (never lifetime totals):
    acceptance length = 1 + d(accepted) / d(drafts)
    acceptance rate   = d(accepted) / d(draft tokens)
    per-position[k]   = d(accepted_per_pos{position=k}) / d(drafts)
Counter families: ours (`dflash:`), vLLM (`vllm:`), lmdeploy (`lmdeploy:`), all named
`<prefix>spec_decode_num_{drafts,draft_tokens,accepted_tokens,accepted_tokens_per_pos}`;
samples of one family are summed over their other labels (model, engine, ...). A page that
carries several families (our server with `--metrics-names dflash,vllm`: the same counts
under two names) is read for the first of PREFIXES only. Positions are kept 1-based: vLLM
and lmdeploy number theirs from 0. SGLang
exposes gauges (`sglang:spec_accept_length`), read as they are after the run (a mean over
their label sets where there are several, one a scheduler), and per-request `meta_info`
(`spec_verify_ct`, `completion_tokens`).

The counters are checked against what they count (`counter_contradictions`): accepted tokens
are at most the draft tokens, each position's at most the drafts and at most the position
before's (a token is accepted only after every one before it), the positions' counts together
at most the accepted tokens (each accepted token is counted at its one position), and the
tokens the drafted steps committed (a draft's accepted tokens and the target's own after them)
at most what the run streamed past each request's first token, plus one block a request (a last
step may commit past max_tokens or a stop string), checked when every request of the run
completed and the run's requests were the server's only traffic. A server whose counters break
one reports an acceptance its steps cannot have had.
"""

from __future__ import annotations

import math
from collections import Counter as Tally
from collections.abc import Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .client import RequestRecord

PREFIXES = ("dflash:", "vllm:", "lmdeploy:")
FIRST_POSITION = {"dflash:": 1, "vllm:": 0, "lmdeploy:": 0}  # the number of draft token 1
FAMILIES = {
    "drafts": "spec_decode_num_drafts",
    "draft_tokens": "spec_decode_num_draft_tokens",
    "accepted": "spec_decode_num_accepted_tokens",
    "per_pos": "spec_decode_num_accepted_tokens_per_pos",
}
# CPU time counters, where a server exports them: its own process's (prometheus_client's
# process collector, which vLLM's and our server's pages carry) and our engine loop's thread
CPU_COUNTERS = {
    "cpu:server": "process_cpu_seconds_total",
    "cpu:engine": "dflash:engine_cpu_seconds_total",
}
SGLANG_GAUGES = {
    "acceptance_length": "sglang:spec_accept_length",
    "acceptance_rate": "sglang:spec_accept_rate",
}

Snapshot = dict[str, float]  # "drafts" / "accepted" / "pos:3" / "sglang:..." -> value


def parse(text: str) -> Snapshot:
    """The spec-decode values of one /metrics page: counters summed over their label sets,
    SGLang's gauges averaged over theirs."""
    snap: Snapshot = {}
    by_prefix: dict[str, Snapshot] = {}
    gauges: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            for key, counter in CPU_COUNTERS.items():
                if name == counter:
                    snap[key] = snap.get(key, 0.0) + sample.value
            if name in SGLANG_GAUGES.values():
                gauges.setdefault(name, []).append(sample.value)
                continue
            for prefix in PREFIXES:
                if not name.startswith(prefix):
                    continue
                base = name[len(prefix) :].removesuffix("_total")
                for key, family_name in FAMILIES.items():
                    if base != family_name:
                        continue
                    if key == "per_pos":
                        position = int(sample.labels.get("position", 0)) + 1 - FIRST_POSITION[prefix]
                        key = f"pos:{position}"
                    counts = by_prefix.setdefault(prefix, {})
                    counts[key] = counts.get(key, 0.0) + sample.value
    # a gauge per scheduler (one a data-parallel rank): their mean, not their sum, as each is
    # already a per-step average (the page does not say how many steps each rank ran)
    snap |= {name: sum(values) / len(values) for name, values in gauges.items()}
    prefix = next((p for p in PREFIXES if p in by_prefix), None)
    if prefix is not None:
        snap |= by_prefix[prefix]
        snap["prefix:" + prefix] = 1.0
    return snap


class MetricsPageError(ValueError):
    """A server's /metrics page (HTTP 200) that is not Prometheus text."""


def scrape(metrics_url: str, timeout: float = 10.0) -> Snapshot | None:
    """Snapshot a server's /metrics; None when it has none (no answer, or not HTTP 200).
    A page that is not Prometheus text raises MetricsPageError naming the URL and the fault.
    Redirects are followed: a Prometheus app mounted at /metrics under Starlette (vLLM's,
    SGLang's) answers `GET /metrics` with a 307 to `/metrics/`."""
    try:
        response = httpx.get(metrics_url, timeout=timeout, follow_redirects=True)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return parse(response.text)
    except ValueError as e:
        raise MetricsPageError(f"{metrics_url} is not Prometheus text: {str(e)[:200]}") from e


def _differences(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """The acceptance counters' differences over a run (SGLang's gauges and CPU time left out)."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if not k.startswith(("sglang", "cpu:"))}


def acceptance_from_counters(before: Snapshot | None, after: Snapshot | None) -> dict:
    """Acceptance metrics from counter differences (or SGLang gauges after the run)."""
    if before is None or after is None:
        return {}
    d = _differences(before, after)
    if any(v < 0 for v in d.values()):  # a counter that fell started again: a restart
        return {}
    drafts = d.get("drafts", 0.0)
    if drafts > 0:
        positions = sorted(int(k[4:]) for k in d if k.startswith("pos:"))
        return {
            "acceptance_length": 1.0 + d.get("accepted", 0.0) / drafts,
            "acceptance_rate": d.get("accepted", 0.0) / d["draft_tokens"]
            if d.get("draft_tokens")
            else float("nan"),
            "acceptance_per_position": [d[f"pos:{k}"] / drafts for k in positions],
            "acceptance_source": "prometheus",
        }
    gauges = {k: after[v] for k, v in SGLANG_GAUGES.items() if v in after}
    if gauges:
        return {**gauges, "acceptance_source": "sglang gauges (not differenced)"}
    return {}


def counter_contradictions(
    before: Snapshot | None, after: Snapshot | None, records: Sequence[RequestRecord]
) -> str:
    """Where a run's acceptance counter differences contradict each other or the tokens the run
    streamed (module docstring); "" when they agree or there are none."""
    if before is None or after is None:
        return ""
    d = _differences(before, after)
    drafts, accepted, draft_tokens = d.get("drafts", 0.0), d.get("accepted", 0.0), d.get("draft_tokens")
    if drafts <= 0 or any(v < 0 for v in d.values()):  # none, or a restart (acceptance_from_counters)
        return ""
    found = []
    if draft_tokens is not None and accepted > draft_tokens:
        found.append(f"{accepted:g} accepted tokens of {draft_tokens:g} drafted")
    positions = sorted(int(k[4:]) for k in d if k.startswith("pos:"))
    before_count = drafts
    for k in positions:
        count = d[f"pos:{k}"]
        if count > before_count:
            what = "drafts" if before_count == drafts and k == positions[0] else f"position {k - 1}'s"
            found.append(f"position {k} accepted {count:g} times, more than the {before_count:g} {what}")
            break
        before_count = count
    counted = sum(d[f"pos:{k}"] for k in positions)
    if counted > accepted:
        found.append(f"the positions' counts total {counted:g}, more than the {accepted:g} accepted tokens")
    # a failed stream (a timeout, a cut connection) may leave the server committing tokens that
    # never reached the client: the bound holds for runs whose requests all completed
    streamed = sum(sum(r.chunk_tokens) for r in records)
    started = sum(1 for r in records if r.chunk_tokens)
    block = math.ceil(draft_tokens / drafts) + 1 if draft_tokens else 1
    most = streamed - started + started * block
    if records and all(r.success for r in records) and drafts + accepted > most:
        found.append(
            f"the drafted steps committed {drafts + accepted:g} tokens ({drafts:g} drafts, {accepted:g} "
            f"accepted), more than the {streamed} tokens streamed to {started} requests allow "
            f"({most:g}: all but each first token, and a block of {block} a request over)"
        )
    return "; ".join(found)


def server_cpu(before: Snapshot | None, after: Snapshot | None, duration_s: float) -> dict:
    """The share of a core that the server's process (`server_cpu`) and our engine loop's
    thread (`engine_cpu`) were busy over a run, from their CPU counters' differences; only
    those the server exports. Near 1: that Python thread, not the GPU, set the pace."""
    if before is None or after is None or duration_s <= 0:
        return {}
    names = {"cpu:server": "server_cpu", "cpu:engine": "engine_cpu"}
    return {  # a counter that fell started again (a restarted server): no share from it
        column: round((after[key] - before[key]) / duration_s, 3)
        for key, column in names.items()
        if key in before and key in after and after[key] >= before[key]
    }


def acceptance_from_requests(records: Sequence[RequestRecord]) -> dict:
    """Acceptance metrics from per-request data: our server's `spec_decode`, or SGLang's
    `meta_info`. Also the acceptance-length histogram, which counters cannot give."""
    ours = [r.spec_decode for r in records if r.success and r.spec_decode]
    if ours:
        lengths = [n for s in ours for n in s["acceptance_lengths"]]
        steps = sum(s["steps"] for s in ours)
        proposed = sum(s["proposed"] for s in ours)
        return {
            "acceptance_length": sum(lengths) / steps if steps else float("nan"),
            "acceptance_rate": sum(s["accepted"] for s in ours) / proposed if proposed else float("nan"),
            "acceptance_histogram": dict(sorted(Tally(lengths).items())),
            "acceptance_source": "per-request",
        }
    sglang = [r.meta_info for r in records if r.success and r.meta_info and r.meta_info.get("spec_verify_ct")]
    if sglang:
        verify = sum(m["spec_verify_ct"] for m in sglang)
        tokens = sum(m["completion_tokens"] for m in sglang)
        return {"acceptance_length": tokens / verify, "acceptance_source": "sglang meta_info"}
    return {}
