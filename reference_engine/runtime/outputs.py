"""What a step hands back: each request's newly committed tokens, or its failure.

One request's failure is its own: a row whose next-token distribution was not finite, or
an exception inside a forward that computed it (`failing`), ends that request with
finish_reason "error" and the reason; the other rows of the step keep what they committed.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .sequence import Sequence

log = logging.getLogger("reference_engine.runtime.engine")


@dataclass
class StepOutput:
    """What one step produced for one request: its newly committed tokens. Not frozen: one is
    made for every row of every step, and a frozen dataclass sets each field through
    object.__setattr__ (2.7 times a plain one's time for these 7 fields on the 2-core CPU)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    time_s: float  # time.monotonic() when the tokens were committed
    new_logprobs: list[dict[int, float]] | None = None
    error: str | None = None  # set when the engine failed this request (finish_reason "error")


class StepOutputs:
    """The outputs of one step, in the order they happened."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.items: list[StepOutput] = []

    def emit(self, seq: Sequence, tokens: list[int], logprobs: list[dict[int, float]] | None = None) -> bool:
        """Commit a request's new tokens; False (and the request failed) when one of them is
        not a token: its row's distribution was not finite (greedy gives `vocab` for a row
        holding a NaN or +inf or -inf throughout, sampling NOT_A_DISTRIBUTION). The tokens
        before that one are committed first, as plain decode would have produced them before
        it failed: one of them may end the request (a stop token, max_tokens), and then it
        ends so, not in error."""
        if tokens and (min(tokens) < 0 or max(tokens) >= self.vocab_size):
            good = next(i for i, t in enumerate(tokens) if not 0 <= t < self.vocab_size)
            if good:
                self._append(seq, tokens[:good], logprobs)
            if seq.finish_reason is not None:
                return True
            self.fail(
                seq,
                "numerical failure: the next-token distribution is not finite "
                "(NaN or inf logits or probabilities)",
            )
            return False
        self._append(seq, tokens, logprobs)
        return True

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[dict[int, float]] | None) -> None:
        kept = seq.append(tokens)
        if logprobs is not None:
            logprobs = logprobs[: len(kept)]
            seq.logprobs.extend(logprobs)
        self.items.append(
            StepOutput(
                seq.request_id,
                kept,
                seq.finish_reason is not None,
                seq.finish_reason,
                time.monotonic(),
                logprobs,
            )
        )

    def fail(self, seq: Sequence, reason: str) -> None:
        """End one request with finish_reason "error"; its slot is freed at the step's end."""
        if seq.finish_reason is not None:
            return
        seq.finish_reason, seq.error = "error", reason
        self.items.append(StepOutput(seq.request_id, [], True, "error", time.monotonic(), error=reason))

    @contextmanager
    def failing(self, seqs: list[Sequence]) -> Iterator[None]:
        """An exception inside the block fails `seqs` (the rows it was computing) and no
        other request; the traceback goes to the log."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - contained to these requests on purpose
            ids = ", ".join(s.request_id for s in seqs)
            log.error("engine step failed for request(s) %s:\n%s", ids, traceback.format_exc())
            for seq in seqs:
                self.fail(seq, f"engine error: {type(exc).__name__}: {exc}")
