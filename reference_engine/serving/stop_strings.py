"""Incremental detokenisation of one request's output, cut at stop strings.

The rules, which make the result independent of how many tokens a chunk carries (a plain
server emits one token per step, a DFlash server several), so that the plain and the DFlash
server return the same text and ids for the same tokens:

- A stop token that ends the output (EOS, a `stop_token_ids` entry) adds its id and no text.
- Tokens are examined one at a time, in order. The first token whose text completes a stop
  string ends the output: the text is cut where the earliest stop string found in it begins,
  and the ids are kept up to and including that token (as OpenAI and vLLM report them).
- The text never contains any part of a stop string: the longest tail of the text that is
  still a prefix of some stop string is held back, and released only once it can no longer
  start a match (or the output ends without a match). A trailing incomplete UTF-8 character
  (decoded as U+FFFD) is held back until the next token completes it.

The text is the output's ids decoded as a whole (`decode(ids)`), read incrementally
(`IncrementalText`): each token decodes a window of the last few tokens, not the whole output,
so a request's detokenisation costs time linear in its length (decoding the whole output at
every step costs time growing with its square: at 128 tokens, a third of a plain server's
event-loop work on the H200). The window moves by tokens, one at a time, so the text does not
depend on the chunking either; the last push checks it against one decode of the whole output.
Each token's search for stop strings reads only the text since the search before (and the
longest stop string's length before it), so stop strings cost linear time too. The text
grows in blocks (`GrowingText`) and a push reads only its end (what it has not sent and the
longest stop string's length before that), so no push copies the whole output. Without stop
strings a chunk's tokens are decoded together (`IncrementalText.extend`: one
decode a chunk, not one a token, when their text settles at once), which gives the text that
pushing them one at a time would.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections.abc import Callable, Collection

REPLACEMENT = "\ufffd"
log = logging.getLogger(__name__)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that could still begin one of `stops`: the longest
    suffix of `text` that is a proper prefix of a stop string. Only the prefixes that end in
    the text's last character are compared (found by a search of the stop string), not every
    length down from the longest."""
    if not text:
        return 0
    last, longest = text[-1], 0
    for stop in stops:
        n = min(len(stop) - 1, len(text))  # stop[:n] ends at stop[n - 1]
        while n > longest:
            n = stop.rfind(last, 0, n) + 1  # the longest candidate prefix ending in `last`
            if n <= longest:
                break
            if text.endswith(stop[:n]):
                longest = n
                break
            n -= 1
    return longest


def earliest(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Where the first of `stops` found in text[start:] begins (an index into `text`); None
    when none is there."""
    found = [at for at in (text.find(stop, start) for stop in stops) if at >= 0]
    return min(found) if found else None


class GrowingText:
    """A string that grows at its end, read from its end (`tail`), without copying all of it
    at every append: closed blocks of at least BLOCK characters and an open one, which an
    append copies (at most BLOCK characters and the new ones) until it is full. A string
    that grows by `+` copies all of itself at every append: time growing with its length
    squared over a long output, on the event loop every request shares."""

    BLOCK = 4096

    def __init__(self, text: str = "") -> None:
        self.blocks: list[str] = []
        self.starts: list[int] = []  # where each closed block begins
        self.open = ""
        self.length = 0
        self.append(text)

    def append(self, text: str) -> None:
        self.open += text
        self.length += len(text)
        if len(self.open) >= self.BLOCK:
            self.starts.append(self.length - len(self.open))
            self.blocks.append(self.open)
            self.open = ""

    def tail(self, start: int) -> str:
        """The characters from `start` on (the string's [start:])."""
        opened = self.length - len(self.open)
        if start >= opened:
            return self.open[max(start - opened, 0) :]
        i = max(bisect_right(self.starts, start) - 1, 0)
        return "".join([self.blocks[i][max(start - self.starts[i], 0) :], *self.blocks[i + 1 :], self.open])

    def endswith(self, text: str) -> bool:
        return len(text) <= self.length and self.tail(self.length - len(text)) == text

    def __str__(self) -> str:
        return self.tail(0)


class IncrementalText:
    """`decode(ids)` of a growing list of ids, fed one token at a time, each decoding a short
    window rather than the whole output.

    The settled text (`settled_text`) is the decode of the ids before `read`; a new token decodes
    the ids from `window` (a few tokens before `read`, so that a decoder that treats the start
    of its input or a token's neighbours specially sees the same context) and takes what its
    text adds past the window's settled part. A token whose text ends in an incomplete UTF-8
    character (U+FFFD) is not settled yet: `text()` then ends with the pending part, as a
    decode of the whole output would. A window whose text does not begin with its settled
    part (a decoder that rewrites earlier text) is settled by one decode of the whole output.
    A window whose settled ids decode to nothing (special tokens, which decode skips) or to
    text that is not the settled text's end (byte tokens cut from the bytes before them)
    reaches further back: a decoder that strips the space a text starts with would otherwise
    strip one the whole output keeps. The window moves forward in steps of CONTEXT tokens (it
    starts 4 to 8 settled tokens back), so that a token's push reuses the text the push
    before it decoded: one decode a token.

    `skipped`: ids that `decode` drops wherever they stand (a tokenizer's special tokens,
    which its decode skips), so that decode(ids) is the decode of the other ids. They are
    kept in `ids` but never decoded: a run of them (a model that repeats its end-of-text
    token, say) costs nothing to detokenise, where decoding it would reach back through the
    run at every token."""

    CONTEXT = 4  # settled tokens a window starts at least before the first unsettled one
    PENDING_LIMIT = 8  # tokens an incomplete character may hold unsettled

    def __init__(self, decode: Callable[[list[int]], str], skipped: Collection[int] = ()) -> None:
        self.decode, self.skipped = decode, frozenset(skipped)
        self.ids: list[int] = []  # every id pushed
        self.text_ids: list[int] = []  # those decode reads: the ids less the skipped ones
        # the positions below index text_ids
        self.settled_text = GrowingText()  # decode(text_ids[:read])
        self.window = 0  # first id of the window
        self.read = 0  # first id not settled
        self.pending = ""  # the unsettled ids' text (an incomplete character)
        self.window_text: str | None = None  # decode(text_ids[window:read]), when known
        self.rewrites = 0  # times the settled text was replaced rather than extended

    def push(self, token: int) -> None:
        self.ids.append(token)
        if token not in self.skipped:
            self._push(token)

    def _push(self, token: int) -> None:
        self.text_ids.append(token)
        before = self._window_before()
        now = self.decode(self.text_ids[self.window :])
        if not now.startswith(before):  # the decoder rewrote earlier text: settle it all at once
            self.rewrites += 1
            self._settle(self.decode(self.text_ids), rewrite=True)
            return
        added = now[len(before) :]
        # an incomplete character: wait for its next bytes (a character spans at most 4 bytes,
        # so at most 4 tokens: past PENDING_LIMIT the replacement characters are for good)
        if added.endswith(REPLACEMENT) and len(self.text_ids) - self.read < self.PENDING_LIMIT:
            self.pending = added
            return
        self._settle(added, now)

    def extend(self, tokens: list[int]) -> None:
        """`push` each of `tokens`: the same text, with one decode for the whole run when its
        text settles at once (it ends in a complete character and the decoder did not rewrite
        the window), as a DFlash step's several tokens mostly do; otherwise one push a token."""
        self.ids.extend(tokens)
        if self.skipped:
            tokens = [t for t in tokens if t not in self.skipped]
        if len(tokens) > 1:
            known = len(self.text_ids)
            if self._settle_run(tokens):
                return
            del self.text_ids[known:]  # the window may have reached back: as the first push's would
        for token in tokens:
            self._push(token)

    def _settle_run(self, tokens: list[int]) -> bool:
        """Append `tokens` and settle their text (with any pending before them) in one
        decode; False (the ids appended) when it does not settle that way."""
        self.text_ids.extend(tokens)
        before = self._window_before()
        now = self.decode(self.text_ids[self.window :])
        if not now.startswith(before) or now.endswith(REPLACEMENT):
            return False
        self._settle(now[len(before) :], now)
        return True

    def _window_before(self) -> str:
        """decode(ids[window:read]), the window reaching back while its settled ids decode
        to nothing (special tokens, which decode skips) or to other than the settled text's
        end (bytes it cut from their group)."""
        before = self.window_text
        if before is None:
            before = self.decode(self.text_ids[self.window : self.read]) if self.read > self.window else ""
        while self.window > 0 and not (before and self.settled_text.endswith(before)):
            self.window = max(0, self.window - self.CONTEXT)
            before = self.decode(self.text_ids[self.window : self.read])
        self.window_text = before
        return before

    def _settle(self, text: str, window_text: str | None = None, rewrite: bool = False) -> None:
        """Settle every id pushed: `text` is what their text adds to the settled text (with
        `rewrite`, the whole settled text, which replaces it). `window_text`: the decode of
        the window through the last id (what the push just decoded). The window then stays
        where it is, and that text is the next push's settled part, until it holds 2 x
        CONTEXT settled ids, or for as long as pushes add no text (a run of ids that decode to
        nothing): a window moved on into such a run would reach back through it at every
        push."""
        if rewrite:
            added = text != str(self.settled_text)
            self.settled_text = GrowingText(text)
        else:
            added = bool(text)
            self.settled_text.append(text)
        self.pending = ""
        self.read = len(self.text_ids)
        if window_text is not None and (not added or self.read - self.window <= 2 * self.CONTEXT):
            self.window_text = window_text
        else:
            self.window = max(0, self.read - self.CONTEXT)
            self.window_text = None

    def text(self) -> str:
        """The text of every id pushed so far (all of it, copied)."""
        return self.tail(0)

    def tail(self, start: int) -> str:
        """text()[start:], reading only those characters."""
        settled = self.settled_text.length
        if start >= settled:
            return self.pending[start - settled :]
        return self.settled_text.tail(start) + self.pending


class StopStringText:
    """Feed each step's new token ids; get back the text and ids that are settled.
    `skipped`: ids that `decode` drops (IncrementalText)."""

    def __init__(
        self, decode: Callable[[list[int]], str], stops: tuple[str, ...] = (), skipped: Collection[int] = ()
    ) -> None:
        self.decode, self.stops = decode, tuple(stops)
        self.incremental = IncrementalText(decode, skipped)
        self.sent = 0  # characters of text already emitted
        self.stopped = False  # a stop string ended the output
        # the settled text searched for stop strings so far (its length, and the rewrites then):
        # a stop string that no earlier search found ends past it, so it starts at most `reach`
        # characters before it (the longest stop string less one): each search reads the new
        # text and that much before it, not the whole output
        self.searched, self.searched_rewrites = 0, 0
        self.reach = max((len(stop) for stop in self.stops), default=1) - 1

    @property
    def ids(self) -> list[int]:
        return self.incremental.ids

    def push(self, new_ids: list[int], final: bool, stop_token: bool = False) -> tuple[str, list[int]]:
        """(new text, new ids) to emit. After a stop string, nothing more is taken.
        `stop_token`: the last of `new_ids` is the stop token that ended the output (EOS or a
        stop_token_ids entry): its id is emitted, its text is not (as vLLM leaves it out)."""
        if self.stopped:
            return "", []
        if stop_token and new_ids:
            text, taken = self.push(new_ids[:-1], final)
            if not self.stopped:  # a stop string before it ended the output first
                self.incremental.ids.append(new_ids[-1])  # kept, never decoded
                taken = [*taken, new_ids[-1]]
            return text, taken
        if not self.stops:  # nothing to cut: the chunk's tokens settle together
            self.incremental.extend(new_ids)
            return self._release(final), list(new_ids)
        taken: list[int] = []
        for token in new_ids:
            self.incremental.push(token)
            taken.append(token)
            at = self._first_stop()
            if at is not None:
                self.stopped = True
                out = self.incremental.tail(self.sent)[: max(at - self.sent, 0)]
                self.sent = at
                return out, taken
        return self._release(final), taken

    def _first_stop(self) -> int | None:
        """Where the earliest stop string in the incremental text begins; None when none is
        in it. Reads the text a stop string could end in since the last search, and `reach`
        characters before it; all of it when the settled text was rewritten since."""
        incremental = self.incremental
        if incremental.rewrites != self.searched_rewrites:
            self.searched, self.searched_rewrites = 0, incremental.rewrites
        start = max(0, self.searched - self.reach)
        at = earliest(incremental.tail(start), self.stops, 0)
        self.searched = incremental.settled_text.length
        return None if at is None else start + at

    def _checked(self, text: str) -> str:
        """The output's text decoded whole, once, at its end: what the incremental reads
        should equal. A decoder for which they differ is logged, and the rest of the output
        follows the whole decode."""
        whole = self.decode(self.ids)
        if whole != text:
            log.warning(
                "incremental detokenisation differed from decoding the whole output (%d ids); "
                "the rest of the text follows the whole decode",
                len(self.ids),
            )
        return whole

    def _release(self, final: bool) -> str:
        """The text to emit now: the text past what was emitted, less (unless `final`) an
        incomplete character at its end and the end that could still begin a stop string.
        Reads the text from `reach` characters before what was emitted (what `held_back`
        looks at), not the whole output; the final push reads it whole (`_checked`)."""
        if final:
            start, text = 0, self._checked(self.incremental.text())
        else:
            # held_back reads the last `reach` characters; where fewer than that are left
            # from `start`, the text ends before what was sent, and nothing is released
            start = max(0, self.sent - self.reach - 1)
            text = self.incremental.tail(start).rstrip(REPLACEMENT)
            text = text[: len(text) - held_back(text, self.stops)]
        out = text[self.sent - start :]
        self.sent = max(self.sent, start + len(text))
        return out
