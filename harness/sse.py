"""Server-sent events, split into events the way a real client splits them: the WHATWG
EventSource rules (html.spec.whatwg.org, "Parsing an event stream"), which the openai Python
client follows too. Both readers of a stream use it: `harness compare` (answer.py) and the
benchmark client (client.py), so neither sees an event a real client would not.

    a line ends at CRLF, LF or CR, nothing else: U+2028, U+2029, \\x85, \\x0b, \\x0c and
        \\x1c-\\x1e (str.splitlines' other line breaks) are text, as in a JSON string
    a blank line ends an event; an event with no `data:` line is not dispatched
    the `data:` lines of one event are joined with "\\n" (two JSON objects sent as two
        `data:` lines of one event are one invalid JSON text, as a client reads them)
    a line starting with ':' is a comment; `event:`, `id:`, `retry:` and unknown fields
        carry no data and are ignored here
    the field name runs to the first ':' (a line without one is a field with an empty
        value); one space after the colon is stripped, no more
    an event the stream leaves unended (no blank line after it) is discarded
    a byte order mark at the start of the stream is skipped; the bytes are UTF-8

    reader = EventReader()
    for chunk in response_bytes:
        for data in reader.feed(chunk):   # the data of each event the chunk completes
            ...
"""

from __future__ import annotations

import codecs
import re

_LINE_END = re.compile(r"\r\n|\r|\n")


class EventReader:
    """One stream's events, fed incrementally (bytes or text, in pieces of any size: a CRLF or
    a UTF-8 character may be split across two pieces)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""  # the start of a line whose end has not arrived
        self._after_cr = False  # the last piece ended in CR: an LF first in the next is its CRLF
        self._started = False  # past the first character (where a byte order mark is skipped)
        self._data: list[str] = []  # the `data:` values of the event being read

    def feed(self, piece: bytes | str) -> list[str]:
        """The data of every event that `piece` ends."""
        return [data for line in self.lines(piece) if (data := self.line(line)) is not None]

    def lines(self, piece: bytes | str) -> list[str]:
        """The lines that `piece` ends, without their line ends."""
        text = self._decoder.decode(piece) if isinstance(piece, bytes) else piece
        if not text:
            return []
        if not self._started:
            self._started = True
            text = text.removeprefix("\ufeff")
        if self._after_cr and text.startswith("\n"):
            text = text[1:]
        if not text:
            self._after_cr = False
            return []
        self._after_cr = text.endswith("\r")
        parts = _LINE_END.split(self._partial + text)
        self._partial = parts.pop()
        return parts

    def line(self, line: str) -> str | None:
        """Take one line (without its line end); the event's data when the line ends one."""
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))
        return None


def event_data(body: bytes | str) -> list[str]:
    """The data of every event of a whole stream (an unended last event discarded)."""
    return EventReader().feed(body)


def server_error(event: object) -> object | None:
    """The server's error an event (or a whole JSON body) carries: its `error` member when the
    body is an object and the member is not null (`"error": null` beside the tokens is no
    error); None otherwise. Both readers of a stream decide by this one rule."""
    return event.get("error") if isinstance(event, dict) else None
