"""Incremental detokenisation of one request's output, cut at stop strings.

The rules, which make the result independent of how many tokens a chunk carries (a plain
server emits one token per step, a DFlash server several), so that the plain and the DFlash
server return the same text and ids for the same tokens:

- Tokens are examined one at a time, in order. The first token whose text completes a stop
  string ends the output: the text is cut where the earliest stop string found in it begins,
  and the ids are kept up to and including that token (as OpenAI and vLLM report them).
- The text never contains any part of a stop string: the longest tail of the text that is
  still a prefix of some stop string is held back, and released only once it can no longer
  start a match (or the output ends without a match). A trailing incomplete UTF-8 character
  (decoded as U+FFFD) is held back until the next token completes it.

Each token decodes the whole output so far, so the cost grows with the output's length
squared; the reference server keeps it simple, since stop strings end outputs early.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that could still begin one of `stops`: the longest
    suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class StopStringText:
    """Feed each step's new token ids; get back the text and ids that are settled."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...] = ()) -> None:
        self.decode, self.stops = decode, tuple(stops)
        self.ids: list[int] = []
        self.sent = 0  # characters of text already emitted
        self.stopped = False  # a stop string ended the output

    def push(self, new_ids: list[int], final: bool) -> tuple[str, list[int]]:
        """(new text, new ids) to emit. After a stop string, nothing more is taken."""
        if self.stopped:
            return "", []
        if not self.stops:
            self.ids.extend(new_ids)
            return self._release(self.decode(self.ids), final), list(new_ids)
        taken: list[int] = []
        text = self.decode(self.ids)
        for token in new_ids:
            self.ids.append(token)
            taken.append(token)
            text = self.decode(self.ids)
            found = [text.find(s) for s in self.stops if s in text]
            if found:
                at = min(found)
                self.stopped = True
                out = text[self.sent : at]
                self.sent = at
                return out, taken
        return self._release(text, final), taken

    def _release(self, text: str, final: bool) -> str:
        if not final:
            text = text.rstrip(REPLACEMENT)
            text = text[: len(text) - held_back(text, self.stops)]
        out = text[self.sent :]
        self.sent = max(self.sent, len(text))
        return out
