"""Argument types for the command line: each refuses bad input with one line naming the value
and what was expected (argparse prints it after the usage line and exits 2)."""

from __future__ import annotations

import argparse
import math

import httpx


def _checked(parse, ok, expected: str):
    """An argparse type: `parse` the text, then require `ok(value)`; refusals say `expected`."""

    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return convert


positive_int = _checked(int, lambda v: v >= 1, "a whole number >= 1")
non_negative_int = _checked(int, lambda v: v >= 0, "a whole number >= 0")
positive_float = _checked(float, lambda v: v > 0, "a number > 0")  # inf allowed (a rate: all at once)
finite_positive_float = _checked(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
finite_non_negative_float = _checked(float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
rate = _checked(float, lambda v: 0.0 <= v <= 1.0, "a fraction in [0, 1]")  # a failure-rate threshold
# "auto" (kept as None) or a whole number >= 1
auto_or_positive_int = _checked(
    lambda text: None if text == "auto" else int(text),
    lambda v: v is None or v >= 1,
    "auto or a whole number >= 1",
)


def concurrency_list(text: str) -> list[int]:
    """ "1,4,8,16": each level a whole number >= 1."""
    levels = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated whole numbers >= 1, got {text!r}"
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"concurrency must be >= 1, got {value}")
        if value in levels:  # two runs of one level would share a run's name
            raise argparse.ArgumentTypeError(f"level {value} is named twice in {text!r}")
        levels.append(value)
    return levels


def base_url(text: str) -> str:
    """http(s)://host[:port] with a port in 1-65535."""
    try:
        url = httpx.URL(text)
    except (httpx.InvalidURL, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"not a valid URL: {text!r} ({exc})") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise argparse.ArgumentTypeError(f"expected http://HOST[:PORT] or https://HOST[:PORT], got {text!r}")
    if url.port is not None and not 1 <= url.port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 1-65535, got {url.port} in {text!r}")
    return text
