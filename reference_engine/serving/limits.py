"""What the server accepts from an untrusted client before any parsing: a body declared as
JSON, bounded, and JSON that is plain data (bounded nesting, bounded integers, finite numbers,
valid Unicode, no key twice in one object).

Each refusal is a ProtocolError the server turns into an OpenAI-style error body: 415 for a
body not declared as JSON, 413 for a body over the limit, 400 for the rest. Decoding runs off
the event loop (the server calls `decode_json` in a worker thread), so a large body never
stalls other streams.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from ..errors import ConfigError
from .protocol import ProtocolError

MiB = 1024 * 1024


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int = 4 * MiB  # request body; more gets HTTP 413
    max_depth: int = 32  # nested arrays/objects; an OpenAI request needs about 5
    max_int_digits: int = 32  # an int64 seed has 19 digits

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ConfigError(f"the body size limit must be positive, got {self.max_bytes} bytes")


async def read_body(request: Request, limits: BodyLimits) -> bytes:
    """The request body, refused before it is read when it is not declared as JSON (415), and
    as soon as it is known to pass the limit (413): from Content-Length before reading, or
    while streaming it in."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        # a browser sends text/plain, a form or multipart across origins without asking first
        # (no CORS preflight): only a JSON body proves the client meant to call the API
        raise ProtocolError(
            f"the request body must be sent as 'Content-Type: application/json', "
            f"got {request.headers.get('content-type', 'no Content-Type')!r}",
            None,
            415,
        )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
        raise _too_large(int(declared), limits)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_bytes:
                raise _too_large(size, limits)
            chunks.append(chunk)
    except ClientDisconnect:
        # connections.py has answered (408: too slow; 400: cut short) and closed the connection:
        # this error reaches no client, it only ends the route quietly
        raise ProtocolError("the connection closed before the request body was complete") from None
    return b"".join(chunks)


def _too_large(size: int, limits: BodyLimits) -> ProtocolError:
    return ProtocolError(
        f"the request body has {size} bytes or more; this server accepts at most "
        f"{limits.max_bytes} (--max-body-mb)",
        None,
        413,
    )


def decode_json(raw: bytes, limits: BodyLimits) -> Any:
    """Parse a body as strict JSON within the limits; ProtocolError (400) otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(
            f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None

    def parse_int(digits: str) -> int:
        if len(digits.lstrip("-")) > limits.max_int_digits:
            raise ProtocolError(
                f"an integer in the request has {len(digits.lstrip('-'))} digits; "
                f"at most {limits.max_int_digits} are accepted"
            )
        return int(digits)

    def parse_constant(name: str) -> float:
        raise ProtocolError(f"{name} is not valid JSON")

    def parse_float(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):  # 1e999: a number JSON can write but no float holds
            raise ProtocolError(f"the number {literal[:32]} is out of range")
        return value

    def unique_keys(pairs: list[tuple[str, Any]]) -> dict:
        # json.loads keeps the last of two equal keys: which one the client meant is a guess
        body = {}
        for key, value in pairs:
            if key in body:
                raise ProtocolError(f"the key {key!r} appears twice in one object of the request body")
            body[key] = value
        return body

    try:
        body = json.loads(
            text,
            parse_int=parse_int,
            parse_float=parse_float,
            parse_constant=parse_constant,
            object_pairs_hook=unique_keys,
        )
    except RecursionError:
        raise _too_deep(limits) from None
    except json.JSONDecodeError as exc:
        raise ProtocolError(
            f"the request body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    _check_plain(body, limits)
    return body


def _too_deep(limits: BodyLimits) -> ProtocolError:
    return ProtocolError(f"the request body nests arrays or objects more than {limits.max_depth} levels deep")


def _check_plain(body: Any, limits: BodyLimits) -> None:
    """Nesting depth and Unicode, without recursion: every string must be encodable (a lone
    surrogate such as "\\ud800" is valid JSON syntax but not text)."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limits.max_depth:
                raise _too_deep(limits)
            items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
            for key, item in items:
                if key is not None:
                    _check_text(key)
                if isinstance(item, str):
                    _check_text(item)
                elif isinstance(item, (dict, list)):
                    stack.append((item, depth + 1))
        elif isinstance(value, str):
            _check_text(value)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ProtocolError(
            f"a string in the request holds an invalid character ({exc.object[exc.start]!a}: {exc.reason})"
        ) from None
