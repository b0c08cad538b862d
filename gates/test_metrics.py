"""Gate: the server's Prometheus metrics count what happened, read over real HTTP.

Our DFlash server on the shipped demo pair (block size 8, float32), on loopback, with an
engine failure planted (gates/poisoned_serve.py). Every figure is a difference of /metrics
snapshots (Prometheus text) taken around one phase of requests:

- each request is counted once: in `dflash:request_success_total{finish_reason}` under the
  reason its client got (stop: a stop string or a stop token; length; abort: the client hung up
  mid-stream) or in `dflash:request_failure_total` (the engine failed it); once in the e2e
  latency histogram, once in TTFT when it got a token; no other reason moves;
- prompt and generation tokens equal the requests' usage, and each output token after the
  first is one inter-token latency;
- the spec-decode counters equal the sums of the per-request `spec_decode` figures the server
  returned, and so does the acceptance computed from them as the harness computes it
  (harness/prometheus.py: acceptance length = 1 + d(accepted) / d(drafts), rate = d(accepted)
  / d(draft tokens), per position k = d(accepted_per_pos{k}) / d(drafts));
- accepted never includes the bonus: every step but a request's last committed exactly its
  accepted draft tokens + 1, the last at least that many less what a stop or max_tokens cut,
  and each step proposed min(B - 1, tokens left) draft tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.prometheus import acceptance_from_counters
from harness.prometheus import parse as spec_snapshot
from reference_engine.demo import DEMO_DRAFT, DEMO_TARGET, demo_prompts
from tests.poison import KILL, POISON
from tests.server_process import ServerProcess

from .poisoned_serve import serving_here

BLOCK_SIZE = 8
MAX_TOKENS = 24
TIMEOUT = 60
SERVE = (
    "--model",
    str(DEMO_TARGET),
    "--dflash-draft-model-path",
    str(DEMO_DRAFT),
    "--block-size",
    str(BLOCK_SIZE),
    "--dtype",
    "float32",
    "--threads",
    "1",
)
SUCCESS, FAILURE = "dflash:request_success_total", "dflash:request_failure_total"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def metrics_server():
    """Our server as users run it, a subprocess, with the engine failure planted."""
    server = ServerProcess("none", *SERVE, module="gates.poisoned_serve", timeout=120)
    yield server
    server.stop()


def prompts() -> list[list[int]]:
    """Held-out demo prompts, 20 tokens each, none that starts the planted failure."""
    return [p["prompt_ids"][:20] for p in demo_prompts() if p["prompt_ids"][0] not in (POISON, KILL)]


# ------------------------------------------------------------------ HTTP
@dataclass
class Reply:
    status: int
    finish: str | None = None
    ids: list[int] | None = None
    text: str = ""
    usage: dict | None = None
    spec: dict | None = None  # the per-request spec_decode figures
    error: dict | None = None


async def complete(client: httpx.AsyncClient, url: str, body: dict) -> Reply:
    """One completion, streamed (with usage) or not, as its client saw it."""
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **body}
    if not body.get("stream"):
        r = await client.post(url + "/v1/completions", json=body)
        data = r.json()
        if r.status_code != 200:
            return Reply(r.status_code, error=data["error"])
        choice = data["choices"][0]
        return Reply(
            200,
            choice["finish_reason"],
            choice["token_ids"],
            choice["text"],
            data["usage"],
            data.get("spec_decode"),
        )
    reply = Reply(0, ids=[])
    body["stream_options"] = {"include_usage": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        reply.status = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                reply.error = event["error"]
            elif event.get("choices"):
                choice = event["choices"][0]
                reply.ids += choice["token_ids"]
                reply.text += choice["text"]
                reply.finish = choice["finish_reason"] or reply.finish
            else:
                reply.usage, reply.spec = event["usage"], event.get("spec_decode")
    return reply


def run(url: str, bodies: list[dict]) -> list[Reply]:
    async def main() -> list[Reply]:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            return await asyncio.gather(*(complete(client, url, b) for b in bodies))

    return asyncio.run(main())


def scrape(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=TIMEOUT).text


def samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class Diff:
    """Differences of two /metrics pages."""

    def __init__(self, before: str, after: str) -> None:
        self.texts = before, after
        self.before, self.after = samples(before), samples(after)

    def __call__(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return self.after.get(key, 0.0) - self.before.get(key, 0.0)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """The nonzero differences of one family's samples, by one label's value."""
        keys = {k for k in (*self.before, *self.after) if k[0] == name}
        moved = {dict(k[1])[label]: self(name, **dict(k[1])) for k in keys}
        return {k: v for k, v in moved.items() if v}


def assert_counted(d: Diff, finishes: Counter, failures: int, with_token: int, what: str) -> None:
    """Each request once, in its finish reason or the failures, and in the histograms."""
    got = Counter({k: int(v) for k, v in d.by_label(SUCCESS, "finish_reason").items()})
    assert got == finishes and d(FAILURE) == failures, (
        f"{what}: request_success_total moved by {dict(got)} and request_failure_total by "
        f"{d(FAILURE):g}; the requests ended {dict(finishes)} with {failures} failed"
    )
    total = sum(finishes.values()) + failures
    e2e = d("dflash:e2e_request_latency_seconds_count")
    ttft = d("dflash:time_to_first_token_seconds_count")
    assert e2e == total, f"{what}: {total} requests, {e2e:g} e2e latencies observed"
    assert ttft == with_token, f"{what}: {with_token} requests got a token, {ttft:g} TTFTs observed"


# ------------------------------------------------------------------ acceptance
def step_acceptance(reply: Reply, stop_token: bool) -> list[int]:
    """The accepted draft tokens of each step of one request, from its spec_decode figures,
    checked against the rule that accepted never includes the bonus."""
    spec, B = reply.spec, BLOCK_SIZE
    lengths = spec["acceptance_lengths"]  # committed tokens per step, bonus included
    assert len(lengths) == spec["steps"] and all(1 <= n <= B for n in lengths), spec
    left = [MAX_TOKENS - 1 - sum(lengths[:i]) for i in range(len(lengths))]  # before each step
    proposed = sum(min(B - 1, n) for n in left)
    assert spec["proposed"] == proposed, (
        f"{spec['steps']} steps with {left} tokens left propose {proposed} draft tokens, "
        f"spec_decode says {spec['proposed']}"
    )
    accepted = [n - 1 for n in lengths[:-1]]  # no cut before a request's last step
    last = spec["accepted"] - sum(accepted)
    low = lengths[-1] - 1
    if stop_token:  # the stop token may sit anywhere in the accepted block
        high = min(B - 1, left[-1])
    elif lengths[-1] == left[-1]:  # max_tokens reached: the bonus, or one draft token, cut
        high = low + 1
    else:
        high = low
    assert low <= last <= high, (
        f"accepted {spec['accepted']} over steps committing {lengths}: the last step accepted "
        f"{last}, expected {low}..{high} (is the bonus counted as accepted?)"
    )
    return accepted + [last]


def assert_acceptance_from_counters(d: Diff, replies: list[Reply], stop_tokens: set[int]) -> None:
    assert all(r.spec is not None for r in replies), "a DFlash reply without spec_decode"
    per_step = [a for i, r in enumerate(replies) for a in step_acceptance(r, i in stop_tokens)]
    steps, accepted = len(per_step), sum(per_step)
    proposed = sum(r.spec["proposed"] for r in replies)
    counters = {
        "drafts": d("dflash:spec_decode_num_drafts_total"),
        "draft tokens": d("dflash:spec_decode_num_draft_tokens_total"),
        "accepted": d("dflash:spec_decode_num_accepted_tokens_total"),
    }
    summed = {"drafts": steps, "draft tokens": proposed, "accepted": accepted}
    assert counters == summed, f"counter differences {counters} != per-request sums {summed}"
    positions = {
        int(k): v
        for k, v in d.by_label("dflash:spec_decode_num_accepted_tokens_per_pos_total", "position").items()
    }
    expected = {k: sum(a >= k for a in per_step) for k in range(1, BLOCK_SIZE)}
    expected = {k: v for k, v in expected.items() if v}
    assert positions == expected, (
        f"accepted_per_pos differences {positions} != steps accepting position k (1-based) {expected}"
    )
    harness = acceptance_from_counters(*(spec_snapshot(t) for t in d.texts))
    assert harness["acceptance_length"] == pytest.approx(1 + accepted / steps)
    assert harness["acceptance_rate"] == pytest.approx(accepted / proposed)
    assert harness["acceptance_per_position"] == pytest.approx(
        [v / steps for _, v in sorted(expected.items())]
    )


# ------------------------------------------------------------------ the phases
def stop_string(text: str) -> tuple[str, int] | None:
    """A clean two-character stop string from the middle of `text`, and where it starts."""
    for at in range(len(text) // 3, len(text) - 2):
        stop = text[at : at + 2]
        if stop.strip() and "\ufffd" not in stop and text.find(stop) == at:
            return stop, at
    return None


def finish_reasons_and_acceptance(url: str) -> None:
    """Length, stop strings and a stop token: counted once each, tokens and acceptance exact."""
    first = prompts()[:6]
    before = scrape(url)
    lengths = run(url, [{"prompt": p, "stream": i == 2} for i, p in enumerate(first[:3])])
    assert all(r.status == 200 and r.finish == "length" for r in lengths), lengths
    cuts = [stop_string(r.text) for r in lengths[:2]]
    assert all(cuts), f"no clean stop string in {[r.text for r in lengths[:2]]}"
    ids = lengths[2].ids
    stop_id = next(t for i, t in enumerate(ids[8:], 8) if t not in ids[:i])
    bodies = [{"prompt": first[i], "stop": [cuts[i][0]], "stream": i == 1} for i in range(2)]
    bodies.append({"prompt": first[2], "stop_token_ids": [stop_id], "stream": False})
    bodies += [{"prompt": p, "stream": False} for p in first[3:5]]
    bodies.append({"prompt": first[5], "stream": True})
    replies = run(url, bodies)
    after = scrape(url)
    assert all(r.status == 200 for r in replies), [r.error for r in replies]
    for reply, (stop, at), full in zip(replies, cuts, lengths):
        assert (reply.finish, reply.text) == ("stop", full.text[:at]), (stop, reply)
    assert replies[2].finish == "stop" and replies[2].ids == ids[: ids.index(stop_id) + 1]
    everything = lengths + replies
    d = Diff(before, after)
    assert_counted(d, Counter(r.finish for r in everything), 0, len(everything), "phase 1")
    usage = {
        "prompt": sum(r.usage["prompt_tokens"] for r in everything),
        "generation": sum(r.usage["completion_tokens"] for r in everything),
        "inter-token latencies": sum(r.usage["completion_tokens"] - 1 for r in everything),
    }
    counted = {
        "prompt": d("dflash:prompt_tokens_total"),
        "generation": d("dflash:generation_tokens_total"),
        "inter-token latencies": d("dflash:inter_token_latency_seconds_count"),
    }
    assert counted == usage, f"token counters moved by {counted}, the requests' usage says {usage}"
    assert all(len(r.ids) == r.usage["completion_tokens"] for r in everything)
    assert_acceptance_from_counters(d, everything, stop_tokens={len(lengths) + 2})


def engine_failures(url: str) -> None:
    """Requests the engine fails, streamed and not: counted as failures, nowhere else."""
    poisoned = [POISON, 40, 41]
    before = scrape(url)
    replies = run(url, [{"prompt": poisoned, "stream": True}, {"prompt": poisoned, "stream": False}])
    after = scrape(url)
    assert replies[0].error is not None and replies[0].ids, replies[0]
    assert replies[1].status == 500, replies[1]
    d = Diff(before, after)
    # both had tokens before the engine failed them (the non-streamed one's never sent)
    assert_counted(d, Counter(), 2, 2, "engine failures")
    assert d("dflash:generation_tokens_total") >= len(replies[0].ids)


def client_abort(url: str) -> None:
    """A client that hangs up mid-stream: counted once, as abort, once it is noticed, and its
    request leaves the engine (the running gauge back to 0 long before the 3000 tokens it
    asked for could be made)."""
    before = scrape(url)
    body = {"prompt": prompts()[6], "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
    events = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leaving the block closes the connection
    deadline = time.monotonic() + 30
    while True:
        after = scrape(url)
        d = Diff(before, after)
        if d(SUCCESS, finish_reason="abort") or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert_counted(d, Counter({"abort": 1}), 0, 1, "a client gone mid-stream")
    assert d("dflash:generation_tokens_total") >= events
    deadline = time.monotonic() + 10
    while (running := samples(scrape(url)).get(("dflash:num_requests_running", ()))) != 0:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the engine still runs the request of a client gone mid-stream ({running} running)"
            )
        time.sleep(0.05)


def stop_string_ends_the_request(url: str) -> None:
    """A stop string cuts a request that asked for 3000 tokens: the reply ends at it, and its
    request leaves the engine (the running gauge back to 0 long before 3000 tokens)."""
    prompt = prompts()[7]
    full = run(url, [{"prompt": prompt, "stream": False}])[0]
    cut = stop_string(full.text)
    assert full.status == 200 and cut, f"no clean stop string in {full}"
    body = {"prompt": prompt, "max_tokens": 3000, "stop": [cut[0]], "stream": True}

    async def one() -> Reply:  # long before 3000 tokens could be made
        async with httpx.AsyncClient(timeout=15) as client:
            return await complete(client, url, body)

    try:
        reply = asyncio.run(one())
    except httpx.TimeoutException as exc:
        raise AssertionError(
            f"the engine still runs a request a stop string ended: its reply waits ({exc!r})"
        ) from exc
    assert (reply.finish, reply.text) == ("stop", full.text[: cut[1]]), reply
    deadline = time.monotonic() + 10
    while (running := samples(scrape(url)).get(("dflash:num_requests_running", ()))) != 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine still runs a request a stop string ended ({running} running)")
        time.sleep(0.05)


PHASES: dict[str, Callable[[str], None]] = {
    "finish reasons and acceptance": finish_reasons_and_acceptance,
    "engine failures": engine_failures,
    "client abort": client_abort,
    "stop string": stop_string_ends_the_request,
}


def assert_metrics_count_what_happened(url: str) -> None:
    """Every phase; one AssertionError naming each phase whose metrics were wrong."""
    failures = []
    for name, phase in PHASES.items():
        try:
            phase(url)
        except AssertionError as exc:
            failures.append(f"[{name}] {exc}")
    if failures:
        raise AssertionError("metrics wrong:\n" + "\n".join(failures))


# ------------------------------------------------------------------ the gate
def test_finish_reasons_tokens_and_acceptance_counters_equal_the_per_request_figures(metrics_server) -> None:
    finish_reasons_and_acceptance(metrics_server.url)


def test_a_request_the_engine_fails_is_counted_once_as_a_failure(metrics_server) -> None:
    engine_failures(metrics_server.url)


def test_a_client_that_hangs_up_mid_stream_is_counted_once_as_abort(metrics_server) -> None:
    client_abort(metrics_server.url)


def test_a_request_a_stop_string_ends_leaves_the_engine(metrics_server) -> None:
    stop_string_ends_the_request(metrics_server.url)


# the faults of this gate's class: a request, a token or a draft token counted wrong, each
# with what the gate says about it
CAUGHT_AS = {
    "stop_counted_twice": "[finish reasons and acceptance] phase 1: request_success_total",
    "abort_not_in_e2e": "[client abort] a client gone mid-stream: 1 requests, 0 e2e",
    "hangup_not_aborted": "[client abort] the engine still runs the request of a client gone",
    # the engine's totals count through SpecCounters.record, a request's spec_decode sums its
    # step records: the two disagree
    "accepted_counts_bonus": "[finish reasons and acceptance] counter differences",
    "positions_off_by_one": "accepted_per_pos differences",
    "generation_tokens_per_delivery": "token counters moved",
    "stop_string_leaves_request_running": "[stop string] the engine still runs a request a stop string ended",
}
CATCHES = tuple(CAUGHT_AS)


@pytest.mark.parametrize("fault", CATCHES)
def test_the_gate_catches_a_metric_counted_wrong(fault: str) -> None:
    # in this process: a subprocess per fault would spend most of its time importing
    with serving_here(fault, SERVE) as url, pytest.raises(AssertionError, match="metrics wrong") as caught:
        assert_metrics_count_what_happened(url)
    assert CAUGHT_AS[fault] in str(caught.value), str(caught.value)
