"""The two replies to a completion request, both made from its one event stream
(generation.py): the SSE stream and the whole response (or its error, 500 or 503)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from fastapi.responses import StreamingResponse

from .generation import Failed, Generation, Tokens
from .protocol import (
    ParsedRequest,
    ProtocolError,
    chunk,
    error_body,
    full_response,
    logprobs_body,
    spec_summary,
    usage,
)

if TYPE_CHECKING:
    from .service import Server


async def respond(server: Server, parsed: ParsedRequest, arrival_s: float) -> dict | EventStream:
    """Start the generation and reply: streamed, or whole once it has ended."""
    generation = await Generation.start(server, parsed, arrival_s)
    if parsed.stream:
        return EventStream(sse_reply(server, generation), generation.close)
    try:
        return await full_reply(server, generation)
    finally:
        generation.close()


async def sse_reply(server: Server, generation: Generation) -> AsyncIterator[str]:
    """The SSE events: a chunk per `Tokens`; then the usage chunk (when asked for) or an
    error event; then `[DONE]`."""
    request_id, parsed = generation.request_id, generation.parsed
    prompt_tokens, emitted, first = len(parsed.prompt_ids), 0, True
    text_offset = 0  # characters of the token texts streamed so far (completions' text_offset)
    created = None  # the first chunk's time, which every later chunk repeats (OpenAI's chunk object)
    async for event in generation.events():
        if isinstance(event, Tokens):
            emitted += len(event.ids)
            lp = None
            if parsed.logprobs is not None and event.logprobs:
                lp = _logprobs(server, parsed, event.ids, event.logprobs, text_offset)
                text_offset += sum(len(text) for text in lp.get("tokens", ()))
            body = chunk(
                request_id,
                server.name,
                parsed.chat,
                event.text,
                event.ids,
                event.finish_reason,
                lp,
                role=first,
                created=created,
            )
            first, created = False, body["created"]
            if parsed.continuous_usage:
                body["usage"] = usage(prompt_tokens, emitted)
            elif parsed.include_usage:
                body["usage"] = None  # OpenAI: null on every chunk but the last
            yield _sse(body)
        elif isinstance(event, Failed):
            yield _sse(error_json(event.error))
        elif parsed.include_usage:
            body = chunk(request_id, server.name, parsed.chat, "", [], None, created=created)
            body["choices"] = []
            body["usage"] = usage(prompt_tokens, emitted)
            spec = spec_summary(event.sequence)
            if spec is not None:
                body["spec_decode"] = spec
            yield _sse(body)
    yield "data: [DONE]\n\n"


async def full_reply(server: Server, generation: Generation) -> dict:
    """The whole response; raises the request's ProtocolError when it failed."""
    parsed = generation.parsed
    texts, ids, entries, finish, sequence = [], [], [], None, None
    async for event in generation.events():
        if isinstance(event, Tokens):
            texts.append(event.text)
            ids.extend(event.ids)
            entries.extend(event.logprobs)
            finish = event.finish_reason
        elif isinstance(event, Failed):
            raise event.error
        else:
            sequence = event.sequence
    lp = _logprobs(server, parsed, ids, entries) if parsed.logprobs is not None else None
    return full_response(
        generation.request_id,
        server.name,
        parsed.chat,
        "".join(texts),
        ids,
        finish or "abort",
        lp,
        usage(len(parsed.prompt_ids), len(ids)),
        spec_summary(sequence),
        parsed.prompt_ids,
    )


def error_json(exc: ProtocolError) -> dict:
    """The OpenAI-style error body of `exc`, as a response or as an SSE error event."""
    return error_body(str(exc), exc.kind, exc.param, exc.code)


class EventStream(StreamingResponse):
    """An SSE response that calls `close` however it ends: streamed to the end, or cut short
    by a client that went away (mid-stream, or before the first event was sent)."""

    def __init__(self, events: AsyncIterator[str], close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.close = close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.close()


def _logprobs(
    server: Server,
    parsed: ParsedRequest,
    ids: list[int],
    entries: list[dict[int, float]],
    text_offset: int = 0,
) -> dict:
    def token_text(token: int) -> str:
        return server.detokenize([token])

    tokens = [token_text(t) for t in ids]
    return logprobs_body(
        parsed.chat, tokens, ids, entries, token_text, parsed.logprobs, text_offset, server.token_bytes
    )


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
