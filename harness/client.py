"""The streaming client: one SSE timing loop for every endpoint kind.

Kinds: OpenAI `completions` (/v1/completions), OpenAI `chat` (/v1/chat/completions) and
SGLang's native `sglang` (/generate). Per request it records the send time, the arrival
time and token count of every token-bearing chunk, TTFT, E2E, output and prompt tokens,
success or the error. Token counts come from the server when it offers them (a chunk's
`token_ids`, the growth of `usage.completion_tokens` under `continuous_usage_stats`, or
SGLang's `meta_info.completion_tokens`); else from the model's tokenizer (`--tokenizer`)
applied to the text streamed so far; else a chunk with text counts as one token. Each
record's `count_source` says which (`server_ids`, `usage`, `meta_info`, `tokenizer`,
`estimated`), and the request is flagged `estimated_counts` in the last case.

Counts a server reports are checked against each other, since the throughput is made of them:
a request fails ("inconsistent token counts") when its final `usage.completion_tokens` is not
the number of token ids it streamed, when a running total (`usage` or `meta_info`) falls, or
when the server's counts come to more tokens than the request's `max_tokens`.

Only the extensions the server accepts are sent (`Endpoint.server`, see server_kind.py;
not given: our own server's). A stream that ends cleanly without `data: [DONE]` (plain
OpenAI servers such as `transformers serve` never send it) is accepted when a
`finish_reason` arrived, and the record says `done_marker: false`; a stream cut before
either is a failure.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

import httpx

from .server_kind import KNOWN, ServerKind
from .sse import EventReader, server_error
from .tokens import TextTokenizer
from .workloads import Prompt

ENDPOINT_KINDS = ("completions", "chat", "sglang")
SERVER_COUNTS = frozenset({"server_ids", "usage", "meta_info"})  # count sources the server reports
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "sglang": "/generate"}


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    model: str | None = None
    kind: str = "completions"
    api_key: str | None = None
    server: ServerKind | None = None  # the extensions it accepts; None: our server's
    tokenizer: TextTokenizer | None = field(default=None, compare=False)

    @property
    def accepts(self) -> ServerKind:
        return self.server or KNOWN["ours"]

    def __post_init__(self) -> None:
        if self.kind not in ENDPOINT_KINDS:
            raise ValueError(
                f"unknown endpoint kind '{self.kind}', expected one of {', '.join(ENDPOINT_KINDS)}"
            )

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + PATHS[self.kind]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestRecord:
    index: int
    send_s: float  # seconds since the start of the run
    success: bool = False
    error: str | None = None
    ttft_s: float | None = None  # send -> first token-bearing chunk
    e2e_s: float | None = None  # send -> last token-bearing chunk
    chunk_times_s: list[float] = field(default_factory=list)  # since send, token chunks only
    chunk_tokens: list[int] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    token_ids: list[int] | None = None
    estimated_counts: bool = False
    count_source: str | None = None  # where the token counts came from (see the module doc)
    usage_completion_tokens: int | None = None  # the server's own total, when it sends one
    done_marker: bool = False  # the stream ended with data: [DONE]
    spec_decode: dict | None = None  # the server's per-request speculative statistics
    meta_info: dict | None = None  # SGLang's per-request info (spec_verify_ct, ...)
    group: str | None = None  # the prompt's workload group (workloads.GROUPS), when it has one

    def as_row(self, **labels) -> dict:
        return {**labels, **asdict(self)}


def payload(
    endpoint: Endpoint,
    prompt: Prompt,
    max_tokens: int,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    extra: dict | None = None,
) -> dict:
    """The streaming request body for this endpoint kind."""
    if endpoint.kind == "sglang":
        body: dict = {
            "stream": True,
            "sampling_params": {
                "max_new_tokens": max_tokens,
                "temperature": temperature,
                "ignore_eos": ignore_eos,
            },
        }
        if prompt.token_ids is not None:
            body["input_ids"] = list(prompt.token_ids)
        else:
            body["text"] = prompt.text if prompt.text is not None else _flatten(prompt.messages)
    else:
        accepts = endpoint.accepts
        body = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": True,
            "stream_options": accepts.stream_options(),
            **accepts.extras(ignore_eos),
        }
        if endpoint.model:
            body["model"] = endpoint.model
        if endpoint.kind == "chat":
            text = prompt.text
            if prompt.messages is None and text is None and prompt.token_ids is not None:
                if endpoint.tokenizer is None:  # an empty message would be measured instead
                    raise ValueError(
                        "the chat endpoint takes messages, not token ids: send text (--text, "
                        "a dataset) or give --tokenizer to send the ids as their text"
                    )
                text = endpoint.tokenizer.decode(list(prompt.token_ids))
            messages = prompt.messages or ({"role": "user", "content": text or ""},)
            body["messages"] = list(messages)
        else:
            if prompt.token_ids is not None and accepts.prompt_ids:
                body["prompt"] = list(prompt.token_ids)
            elif prompt.token_ids is not None:
                if endpoint.tokenizer is None:
                    raise ValueError(
                        f"the server ({accepts.name}) takes no token-id prompts: "
                        "send text (--text, a dataset) or give --tokenizer"
                    )
                body["prompt"] = endpoint.tokenizer.decode(list(prompt.token_ids))
            else:
                body["prompt"] = prompt.text if prompt.text is not None else _flatten(prompt.messages)
    body.update(extra or {})
    return body


def _flatten(messages) -> str:
    return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in messages or ())


# the fields of a chat message (or delta) that carry generated reasoning text besides
# `content`: `reasoning_content` (vLLM, SGLang, DeepSeek) and `reasoning` (vLLM's newer name;
# a server moving between the names may send both, the same text)
REASONING_FIELDS = ("reasoning_content", "reasoning")


def _shape_error(event, kind: str) -> str | None:
    """What makes a stream event (JSON already) other than a chunk's shape, or None: an
    object whose choices are objects, with usage an object, token ids a list of integers,
    texts strings and token counts integers where they are given."""
    if not isinstance(event, dict):
        return f"an event is a JSON {type(event).__name__}, not an object"
    if kind == "sglang":
        meta = event.get("meta_info")
        if meta is not None and not isinstance(meta, dict):
            return "meta_info is not an object"
        for name in ("completion_tokens", "spec_verify_ct"):
            if meta and name in meta and not _is_int(meta[name]):
                return f"meta_info.{name} is not an integer"
        return None if event.get("text") is None or isinstance(event["text"], str) else "text is not a string"
    if "spec_decode" in event and _spec_decode_error(event["spec_decode"]):
        return f"spec_decode {_spec_decode_error(event['spec_decode'])}"
    usage = event.get("usage")
    if usage is not None:
        if not isinstance(usage, dict):
            return "usage is not an object"
        for name in ("prompt_tokens", "completion_tokens"):
            if usage.get(name) is not None and not _is_int(usage[name]):
                return f"usage.{name} is not an integer"
    choices = event.get("choices")
    if choices is None:
        return None
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        return "choices is not a list of objects"
    for choice in choices[:1]:  # the one read
        ids = choice.get("token_ids")
        if ids is not None and not (isinstance(ids, list) and all(_is_int(t) for t in ids)):
            return "token_ids is not a list of integers"
        delta = choice.get("delta")
        if delta is not None and not isinstance(delta, dict):
            return "delta is not an object"
        texts = [choice.get("text")] + [(delta or {}).get(k) for k in REASONING_FIELDS + ("content",)]
        if any(t is not None and not isinstance(t, str) for t in texts):
            return "a text is not a string"
    return None


def _spec_decode_error(stats) -> str | None:
    """What makes a per-request `spec_decode` other than its shape, or None: an object with
    integer `steps`, `proposed` and `accepted` and `acceptance_lengths` a list of integers."""
    if not isinstance(stats, dict):
        return "is not an object"
    for name in ("steps", "proposed", "accepted"):
        if not _is_int(stats.get(name)):
            return f"has no integer {name}"
    lengths = stats.get("acceptance_lengths")
    if not (isinstance(lengths, list) and all(_is_int(n) for n in lengths)):
        return "has no list of integer acceptance_lengths"
    return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Counter:
    """How many tokens a chunk carries, from what the server reports (or the tokenizer)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.cumulative = 0
        self.text = ""  # streamed so far, for the tokenizer
        self.endpoint = endpoint
        self.sources: list[str] = []
        self.finished = False  # a finish_reason arrived
        self.contradiction: str | None = None  # the first running total that fell

    def _running(self, name: str, total: int) -> int:
        """The tokens a running total adds since the last chunk (a total that falls adds none,
        and contradicts the server's own earlier count)."""
        new = total - self.cumulative
        if new < 0 and self.contradiction is None:
            self.contradiction = f"{name} fell from {self.cumulative} to {total}"
        self.cumulative = total
        return max(new, 0)

    def _source(self, name: str, record: RequestRecord) -> None:
        if name not in self.sources:
            self.sources.append(name)
            record.count_source = "+".join(self.sources)

    def tokens(self, event: dict, kind: str, record: RequestRecord) -> int:
        if kind == "sglang":
            meta = event.get("meta_info") or {}
            if meta.get("finish_reason"):  # a dict such as {"type": "length"}, or None
                self.finished = True
            if "completion_tokens" in meta:
                record.meta_info = meta
                record.prompt_tokens = meta.get("prompt_tokens", record.prompt_tokens)
                self._source("meta_info", record)
                return self._running("meta_info.completion_tokens", meta["completion_tokens"])
            return self._from_text(event.get("text"), record)
        choices = event.get("choices") or []
        usage = event.get("usage") or {}
        if usage.get("prompt_tokens") is not None:
            record.prompt_tokens = usage["prompt_tokens"]
        if usage.get("completion_tokens") is not None:
            record.usage_completion_tokens = usage["completion_tokens"]
        if "spec_decode" in event:
            record.spec_decode = event["spec_decode"]
        if not choices:
            return 0  # a usage-only chunk carries no token
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finished = True
        ids = choice.get("token_ids")
        if ids is not None:
            record.token_ids = (record.token_ids or []) + list(ids)
            self.cumulative += len(ids)
            self._source("server_ids", record)
            return len(ids)
        if usage.get("completion_tokens") is not None and self.endpoint.accepts.continuous_usage:
            self._source("usage", record)
            return self._running("usage.completion_tokens", usage["completion_tokens"])
        text = choice.get("text")
        if text is None:  # a chat delta: a reasoning model's reasoning text is tokens too
            delta = choice.get("delta") or {}
            reasoning = next((delta[k] for k in REASONING_FIELDS if delta.get(k)), "")
            text = reasoning + (delta.get("content") or "")
        return self._from_text(text, record)

    def _from_text(self, text, record: RequestRecord) -> int:
        if not text:
            return 0
        tokenizer = self.endpoint.tokenizer
        if tokenizer is not None:
            self.text += text
            total = tokenizer.count(self.text)
            new, self.cumulative = total - self.cumulative, total
            self._source("tokenizer", record)
            return max(new, 0)
        record.estimated_counts = True
        self._source("estimated", record)
        self.cumulative += 1
        return 1


class StreamReader:
    """Reads one SSE response into the request's record: its events as a real client splits
    them (sse.py), each timed at the arrival of the blank line that ends it (seconds since the
    request was sent). Kept apart from the socket so that the timing rules can be checked
    against a scripted clock."""

    def __init__(self, endpoint: Endpoint, record: RequestRecord, max_tokens: int | None = None) -> None:
        """`max_tokens`: what the request asked for at most (the server's counts are checked
        against it; None: not checked)."""
        self.endpoint, self.record = endpoint, record
        self.max_tokens = max_tokens
        self.counter = _Counter(endpoint)
        self.events = EventReader()
        self.done = False  # data: [DONE] arrived

    def feed_bytes(self, piece: bytes, now: float) -> bool:
        """Take the next bytes of the body; True when the stream is over."""
        return any(self.feed(line, now) for line in self.events.lines(piece))

    def feed(self, line: str, now: float) -> bool:
        """Take one line (without its line end); True when the stream is over (the [DONE]
        marker or an error)."""
        data = self.events.line(line)
        return False if data is None else self.event(data, now)

    def event(self, data: str, now: float) -> bool:
        """Take one event's data; True when the stream is over."""
        record = self.record
        if data.strip() == "[DONE]":  # padded with spaces: still the end
            self.done = True
            return True
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            record.error = f"malformed SSE event: {data[:200]!r}"
            return True
        error = server_error(event)
        if error is not None:
            record.error = f"server error in stream: {str(error)[:300]}"
            return True
        shape = _shape_error(event, self.endpoint.kind)
        if shape is not None:
            record.error = f"malformed SSE event ({shape}): {data[:200]!r}"
            return True
        n = self.counter.tokens(event, self.endpoint.kind, record)
        if n > 0:
            record.chunk_times_s.append(now)
            record.chunk_tokens.append(n)
            if record.ttft_s is None:
                record.ttft_s = now
            record.e2e_s = now
        return False

    def finish(self) -> RequestRecord:
        """Settle the record once the stream has ended (or stopped being read)."""
        record = self.record
        if record.error:
            return record
        record.output_tokens = sum(record.chunk_tokens)
        record.done_marker = self.done  # a clean end without [DONE] is plain OpenAI; accepted
        if not self.done and not self.counter.finished:
            record.error = (
                f"the stream ended before [DONE] or a finish_reason after {record.output_tokens} tokens"
            )
            return record
        if record.output_tokens == 0:
            record.error = "the stream ended without a token"
            return record
        problem = self.counter.contradiction or self.count_problem()
        if problem is not None:
            record.error = f"inconsistent token counts: {problem}"
            return record
        record.success = True
        return record

    def count_problem(self) -> str | None:
        """Where the server's own counts contradict each other or the request; None when they
        agree. Counts made on this side (the tokenizer's, the estimate) are not checked: text
        tokenized again may legitimately come to other counts than the server's ids."""
        record = self.record
        sources = set(self.counter.sources)
        ids = record.token_ids
        if sources == {"server_ids"} and record.usage_completion_tokens not in (None, len(ids or ())):
            return (
                f"usage.completion_tokens is {record.usage_completion_tokens} for {len(ids or ())} token ids"
            )
        if (
            self.max_tokens is not None
            and sources
            and sources <= SERVER_COUNTS
            and record.output_tokens > self.max_tokens
        ):
            return f"{record.output_tokens} tokens ({record.count_source}) for max_tokens {self.max_tokens}"
        return None


def requested_tokens(body: dict) -> int | None:
    """The most tokens a request body asks for (`max_tokens`, chat's `max_completion_tokens`,
    SGLang's `max_new_tokens`), or None when it names none."""
    for value in (
        body.get("max_completion_tokens"),
        body.get("max_tokens"),
        (body.get("sampling_params") or {}).get("max_new_tokens"),
    ):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


# how long the rest of a body may take once its stream has ended ([DONE] or an error event)
DRAIN_S = 1.0


async def drain(pieces: AsyncIterator[bytes]) -> None:
    """Read a response's body to its end after its stream has ended, unread (what follows
    [DONE] is the chunked encoding's last chunk): a response closed before its end closes its
    connection, so every request then opened a new one where a real client reuses it (and
    the server under test paid for a new connection a request). A server that goes on
    sending past DRAIN_S is cut there, its connection closed."""

    async def rest() -> None:
        async for _ in pieces:
            pass

    try:
        await asyncio.wait_for(rest(), DRAIN_S)
    except (asyncio.TimeoutError, httpx.HTTPError):
        pass


async def send(
    client: httpx.AsyncClient, endpoint: Endpoint, body: dict, index: int, run_start: float, timeout: float
) -> RequestRecord:
    """Send one streaming request and time it. Never raises: failures are recorded. `timeout`
    bounds the whole request, from sending to the stream's end (a server that keeps a stream
    alive with a token now and then still runs out of it), and each wait for a byte."""
    sent = time.perf_counter()
    record = RequestRecord(index=index, send_s=sent - run_start)
    reader = StreamReader(endpoint, record, requested_tokens(body))

    async def exchange() -> RequestRecord:
        async with client.stream(
            "POST", endpoint.url, json=body, headers=endpoint.headers(), timeout=timeout
        ) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:300]}"
                return record
            pieces = response.aiter_bytes()
            async for piece in pieces:
                if reader.feed_bytes(piece, time.perf_counter() - sent):
                    await drain(pieces)  # the connection goes back to the pool
                    break
        return reader.finish()

    try:
        return await asyncio.wait_for(exchange(), timeout)
    except (httpx.TimeoutException, asyncio.TimeoutError):
        record.error = f"timed out after {timeout} s"
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record
