"""The scheduler: which requests hold a slot, which wait, and which are done.

Slots are preallocated (the engine's state has `max_num_seqs` of them); a request waits in
arrival order until a slot is free at the start of a step, holds it through prefill and
decode, and gives it back when it finishes or is aborted. Admission policy `wait` queues up
to `max_waiting` requests beyond the free slots; `reject` refuses a request that would have
to wait (no free slot, or with a pooled KV cache no free run of cells for it). A
speculative request falls back to plain decode for good when it asks for
something the speculative path does not serve (logprobs, penalties) or, when enabled, when
its mean acceptance length stays low; `fallbacks` counts the reasons.

Prompts prefill in chunks in the same steps as running requests decode (engine.py), so a long
prompt does not stall the others' tokens. Without a token budget every prefilling request runs
one chunk per step; with one (`max_num_batched_tokens`, vLLM's name) a step runs the chunks
that fit what the running requests' decode and verify tokens leave of it, oldest first, and
always the oldest one's, so that every prompt makes progress. Chunks are never cut to fit:
their boundaries stay on the fixed grid of the prefill chunk.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from ..errors import RequestError
from .kv_pool import CellAllocator
from .sequence import (
    FALLBACK_LOGPROBS,
    FALLBACK_LOW_ACCEPTANCE,
    FALLBACK_PENALTIES,
    FALLBACK_SAMPLING,
    Phase,
    Sequence,
)


class EngineFullError(RequestError):
    """No room for a request (admission policy `reject`, or the waiting queue is full)."""


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        admission: str,
        max_waiting: int,
        fallback_min_acceptance: float | None,
        fallback_after_steps: int,
        prefill_chunk: int,
        max_num_batched_tokens: int | None = None,
        block_size: int = 0,
        cells: CellAllocator | None = None,
        cells_needed: Callable[[Sequence], int] | None = None,
    ) -> None:
        """`block_size`: the DFlash block size (0 without a draft), the target tokens a
        speculative request's verify adds to a step at most. `cells`: a pooled KV cache's
        allocator (kv_pool.py), from which a request takes `cells_needed(seq)` consecutive
        cells at admission and gives them back when it ends."""
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk, self.max_num_batched_tokens = prefill_chunk, max_num_batched_tokens
        self.block_size = block_size
        self.admission, self.max_waiting = admission, max_waiting
        self.fallback_min_acceptance = fallback_min_acceptance
        self.fallback_after_steps = fallback_after_steps
        self.free_slots = list(range(max_num_seqs))
        self.cells, self.cells_needed = cells, cells_needed
        self.waiting: deque[Sequence] = deque()
        self.active: dict[str, Sequence] = {}  # with a slot
        self.known: dict[str, Sequence] = {}  # every live request (waiting or active)
        self.finished: dict[str, Sequence] = {}  # done, until the caller collects them
        self.fallbacks: dict[str, int] = {}
        self.finished_requests = 0

    # ------------------------------------------------------------------ requests
    def check_new(self, request_id: str) -> None:
        """Raise RequestError for a duplicate id, EngineFullError when the policy refuses."""
        if request_id in self.known or request_id in self.finished:
            raise RequestError(f"duplicate request id {request_id!r}")
        # queued requests take the free slots first, at the next step
        if self.admission == "reject" and len(self.waiting) >= len(self.free_slots):
            raise EngineFullError(
                f"no free slot for request {request_id!r}: all {self.max_num_seqs} "
                "are busy or promised (admission policy 'reject')"
            )
        if len(self.waiting) - len(self.free_slots) >= self.max_waiting:
            raise EngineFullError(f"waiting queue full ({self.max_waiting} requests); retry later")

    def check_room(self, seq: Sequence) -> None:
        """Under `reject` with a pooled KV cache: EngineFullError when the request would wait
        for a run of cells, the requests queued before it taking theirs first (a free slot
        alone does not admit it: `admit`)."""
        if self.admission != "reject" or self.cells is None:
            return
        trial = CellAllocator(self.cells.cells)
        trial.runs = dict(self.cells.runs)
        for queued in (*self.waiting, seq):
            need = self.cells_needed(queued)
            if trial.allocate(need) is None:
                raise EngineFullError(
                    f"no free run of {need} KV cache cells for request {seq.request_id!r} "
                    f"({trial.free_cells} of {trial.cells} free, the largest run "
                    f"{trial.largest_free_run}; admission policy 'reject')"
                )

    def queue(self, seq: Sequence) -> None:
        """Take a new request; a speculative one that asks for what only plain decode serves
        falls back at once."""
        params = seq.params
        if seq.speculative:
            if params.logprobs is not None:
                self.fall_back(seq, FALLBACK_LOGPROBS)
            elif params.repetition_penalty != 1.0:
                self.fall_back(seq, FALLBACK_SAMPLING)
            elif params.penalised:
                self.fall_back(seq, FALLBACK_PENALTIES)
        self.known[seq.request_id] = seq
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Give free slots (and with a pooled cache, a run of free cells) to waiting requests,
        in arrival order; returns those admitted. A request whose run is not free yet stops
        admission at the head of the queue until finished requests free one."""
        admitted = []
        while self.waiting and self.free_slots:
            seq = self.waiting[0]
            if self.cells is not None:
                seq.cell = self.cells.allocate(self.cells_needed(seq))
                if seq.cell is None:
                    break
            self.waiting.popleft()
            seq.slot = self.free_slots.pop(0)
            seq.phase = Phase.PREFILL
            self.active[seq.request_id] = seq
            admitted.append(seq)
        return admitted

    def abort(self, request_id: str) -> Sequence:
        """Drop a request wherever it is; its slot is free for the next step."""
        seq = self.known.pop(request_id, None)
        if seq is None:
            raise RequestError(f"unknown request id {request_id!r}")
        if seq.phase is Phase.WAITING:
            self.waiting.remove(seq)
        else:
            self._release(seq)
        seq.phase, seq.finish_reason = Phase.FINISHED, "abort"
        return seq

    def finish(self, seq: Sequence) -> None:
        self._release(seq)
        seq.phase = Phase.FINISHED
        seq.finished_s = time.monotonic()
        self.finished_requests += 1
        self.known.pop(seq.request_id, None)
        self.finished[seq.request_id] = seq

    def get(self, request_id: str) -> Sequence:
        if request_id in self.known:
            return self.known[request_id]
        if request_id in self.finished:
            return self.finished[request_id]
        raise RequestError(f"unknown request id {request_id!r}")

    def collect(self, request_id: str) -> Sequence:
        """Hand over a finished request and forget it."""
        if request_id not in self.finished:
            raise RequestError(f"request {request_id!r} is not finished")
        return self.finished.pop(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.active)

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None and self.active.pop(seq.request_id, None) is not None:
            self.free_slots.append(seq.slot)
            self.free_slots.sort()
            if seq.cell is not None:
                self.cells.free(seq.cell)
                seq.cell = None

    # ------------------------------------------------------------------ the step's rows
    def prefilling(self) -> list[Sequence]:
        """The requests that run a prompt chunk this step, in admission order: every one still
        prefilling, or within the token budget (the module docstring)."""
        seqs = [s for s in self.active.values() if s.phase is Phase.PREFILL]
        if self.max_num_batched_tokens is None:
            return seqs
        left = self.max_num_batched_tokens - sum(self.decode_tokens(s) for s in self.running())
        chosen = []
        for seq in seqs:
            tokens = min(self.prefill_chunk, len(seq.prompt_ids) - seq.prefilled)
            if seq.prefilled + tokens == len(seq.prompt_ids):
                tokens += self.decode_tokens(seq)  # its first decode runs in the same step
            if chosen and tokens > left:
                continue  # a later, shorter chunk may still fit
            chosen.append(seq)
            left -= tokens
        return chosen

    def may_join_next(self) -> bool:
        """Whether a request may join the running ones at the next step: one is waiting and a
        slot is free for it (or freed at this step's end by a request already finished; one
        that finishes in the step changes the rows anyway), or one's prompt has at most a chunk
        left to prefill."""
        active = self.active.values()
        free = len(self.free_slots) + sum(s.finish_reason is not None for s in active)
        return (bool(self.waiting) and free > 0) or any(
            s.phase is Phase.PREFILL and len(s.prompt_ids) - s.prefilled <= self.prefill_chunk for s in active
        )

    def decode_tokens(self, seq: Sequence) -> int:
        """Target tokens a running request adds to a step: its verify block (at most B), or
        one plain decode token."""
        return self.block_size if seq.speculative else 1

    def running(self) -> list[Sequence]:
        """Requests past prefill that still decode, in slot-admission order."""
        return [s for s in self.active.values() if s.phase is Phase.RUNNING and s.finish_reason is None]

    def finish_done(self) -> None:
        """Finish every active request whose finish reason the step set."""
        for seq in list(self.active.values()):
            if seq.finish_reason is not None:
                self.finish(seq)

    # ------------------------------------------------------------------ fallbacks
    def fall_back(self, seq: Sequence, reason: str) -> None:
        """Move a speculative request to plain decode for the rest of its life."""
        seq.speculative = False
        seq.fallback_reason = reason
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def check_low_acceptance(self, seq: Sequence) -> None:
        """Move `seq` to plain decode once its first `fallback_after_steps` speculative steps
        (or more) accept below the threshold on average; a request that has just finished
        has nothing left to decode and is not counted as falling back."""
        threshold = self.fallback_min_acceptance
        if threshold is None or seq.finish_reason is not None or seq.spec.steps < self.fallback_after_steps:
            return
        if seq.spec.mean_acceptance_length < threshold:
            self.fall_back(seq, FALLBACK_LOW_ACCEPTANCE)

    def reset_stats(self) -> None:
        self.finished_requests = 0
        self.fallbacks = {}
