"""The streaming client: one SSE timing loop for every endpoint kind.

Kinds: OpenAI `completions` (/v1/completions), OpenAI `chat` (/v1/chat/completions) and
SGLang's native `sglang` (/generate). Per request it records the send time, the arrival
time and token count of every token-bearing chunk, TTFT, E2E, output and prompt tokens,
success or the error. Token counts come from the server (a chunk's `token_ids`, the growth
of `usage.completion_tokens`, or SGLang's `meta_info.completion_tokens`), never from
re-tokenising text; a chunk with text but no count is counted as one token and the
request is flagged `estimated_counts`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import httpx

from .workloads import Prompt

ENDPOINT_KINDS = ("completions", "chat", "sglang")
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "sglang": "/generate"}


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    model: str | None = None
    kind: str = "completions"
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ENDPOINT_KINDS:
            raise ValueError(f"unknown endpoint kind '{self.kind}', expected one of "
                             f"{', '.join(ENDPOINT_KINDS)}")

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
    spec_decode: dict | None = None  # the server's per-request speculative statistics
    meta_info: dict | None = None  # SGLang's per-request info (spec_verify_ct, ...)

    def as_row(self, **labels) -> dict:
        return {**labels, **asdict(self)}


def payload(endpoint: Endpoint, prompt: Prompt, max_tokens: int, ignore_eos: bool = True,
            temperature: float = 0.0, extra: dict | None = None) -> dict:
    """The streaming request body for this endpoint kind."""
    if endpoint.kind == "sglang":
        body: dict = {"stream": True, "sampling_params": {
            "max_new_tokens": max_tokens, "temperature": temperature, "ignore_eos": ignore_eos}}
        if prompt.token_ids is not None:
            body["input_ids"] = list(prompt.token_ids)
        else:
            body["text"] = prompt.text if prompt.text is not None else _flatten(prompt.messages)
    else:
        body = {"max_tokens": max_tokens, "temperature": temperature, "stream": True,
                "ignore_eos": ignore_eos,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if endpoint.model:
            body["model"] = endpoint.model
        if endpoint.kind == "chat":
            messages = prompt.messages or ({"role": "user", "content": prompt.text or ""},)
            body["messages"] = list(messages)
        else:
            if prompt.token_ids is not None:
                body["prompt"] = list(prompt.token_ids)
            else:
                body["prompt"] = prompt.text if prompt.text is not None else \
                    _flatten(prompt.messages)
    body.update(extra or {})
    return body


def _flatten(messages) -> str:
    return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in messages or ())


class _Counter:
    """How many tokens a chunk carries, from what the server reports."""

    def __init__(self) -> None:
        self.cumulative = 0

    def tokens(self, event: dict, kind: str, record: RequestRecord) -> int:
        if kind == "sglang":
            meta = event.get("meta_info") or {}
            if "completion_tokens" in meta:
                record.meta_info = meta
                new = meta["completion_tokens"] - self.cumulative
                self.cumulative = meta["completion_tokens"]
                record.prompt_tokens = meta.get("prompt_tokens", record.prompt_tokens)
                return max(new, 0)
            return self._estimate(event.get("text"), record)
        choices = event.get("choices") or []
        usage = event.get("usage") or {}
        if usage.get("prompt_tokens") is not None:
            record.prompt_tokens = usage["prompt_tokens"]
        if "spec_decode" in event:
            record.spec_decode = event["spec_decode"]
        if not choices:
            return 0  # a usage-only chunk carries no token
        choice = choices[0]
        ids = choice.get("token_ids")
        if ids is not None:
            record.token_ids = (record.token_ids or []) + list(ids)
            self.cumulative += len(ids)
            return len(ids)
        if usage.get("completion_tokens") is not None:
            new = usage["completion_tokens"] - self.cumulative
            self.cumulative = usage["completion_tokens"]
            return max(new, 0)
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        return self._estimate(text, record)

    def _estimate(self, text, record: RequestRecord) -> int:
        if text:
            record.estimated_counts = True
            self.cumulative += 1
            return 1
        return 0


async def send(client: httpx.AsyncClient, endpoint: Endpoint, body: dict, index: int,
               run_start: float, timeout: float) -> RequestRecord:
    """Send one streaming request and time it. Never raises: failures are recorded."""
    sent = time.perf_counter()
    record = RequestRecord(index=index, send_s=sent - run_start)
    counter = _Counter()
    done = False
    try:
        async with client.stream("POST", endpoint.url, json=body, headers=endpoint.headers(),
                                 timeout=timeout) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:300]}"
                return record
            async for line in response.aiter_lines():
                now = time.perf_counter() - sent
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    record.error = f"malformed SSE line: {data[:200]!r}"
                    return record
                if isinstance(event, dict) and "error" in event:
                    record.error = f"server error in stream: {str(event['error'])[:300]}"
                    return record
                n = counter.tokens(event, endpoint.kind, record)
                if n > 0:
                    record.chunk_times_s.append(now)
                    record.chunk_tokens.append(n)
                    if record.ttft_s is None:
                        record.ttft_s = now
                    record.e2e_s = now
    except httpx.TimeoutException:
        record.error = f"timed out after {timeout} s"
        return record
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.output_tokens = sum(record.chunk_tokens)
    if not done:
        record.error = f"the stream ended before [DONE] after {record.output_tokens} tokens"
        return record
    if record.output_tokens == 0:
        record.error = "the stream ended without a token"
        return record
    record.success = True
    return record
