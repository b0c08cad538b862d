"""Prefill: prompts into the target in chunks (and into the draft's context for a speculative
request), and each request's first token once its prompt is in.

A request runs one chunk of at most `chunk` tokens per step. With CUDA graphs the first chunks
of newly admitted requests share one captured forward where a bucket holds them; a batch that
raises is retried row by row from reset slots, so that a failing request fails alone.

A request's first token is the argmax (or a sample) of its last chunk's logits. Reading it
at once makes the host wait for the prefill's forward and everything queued before it, with
the device idle behind that wait while the host then lays out the step's other forwards.
With `defer_first` (on CUDA) a greedy request's first token stays on the device: the request
runs in this very step's decode or speculative step, which takes its input token from the
device (`transfer.place_tokens`), and the engine emits the token after that step's one read
(`Engine.emit_first`), without a wait of its own. Its output is the same: only when the
token is known on the host changes. A request that stops at its first token (max_tokens 1)
reads it at once; one whose first token is a stop token still runs that step, and the
step's tokens are dropped (a finished request emits nothing more).
"""

from __future__ import annotations

import logging
import time
import traceback

import torch

from .model_runner import ModelRunner
from .outputs import StepOutputs
from .sequence import Phase, Sequence
from .state import TargetState
from .stats import PhaseTimer
from .token_choice import choose_tokens
from .transfer import DeviceTokens, to_device

log = logging.getLogger("reference_engine.runtime.engine")


class Prefill:
    def __init__(
        self,
        runner: ModelRunner,
        state: TargetState,
        timer: PhaseTimer,
        chunk: int,
        defer_first: bool = False,
    ) -> None:
        self.runner, self.state, self.timer, self.chunk = runner, state, timer, chunk
        # greedy first tokens left on the device for the step's own read (module docstring)
        self.defer_first = defer_first

    def __call__(self, seqs: list[Sequence], outputs: StepOutputs) -> None:
        """One chunk of each request still prefilling."""
        for seq in self.batched(seqs, outputs):
            with outputs.failing([seq]):
                self.one(seq, outputs)

    def batched(self, seqs: list[Sequence], outputs: StepOutputs) -> list[Sequence]:
        """The first chunks of newly admitted requests, several to a captured prefill when
        the runner has them; returns the requests left to `one` (later chunks, chunks no graph
        holds, and the rows of a batch that raised)."""
        if not self.runner.captured:
            return seqs
        firsts = [s for s in seqs if s.prefilled == 0]
        rest = [s for s in seqs if s.prefilled != 0]
        groups = self.runner.prefill_groups([min(self.chunk, len(s.prompt_ids)) for s in firsts])
        for group in ([firsts[i] for i in g] for g in groups):
            chunks = [(s.prompt_ids[: self.chunk], 0, s.slot) for s in group]
            try:
                logits = self.runner.prefill_batch(chunks)
            except Exception:  # noqa: BLE001 - retried row by row below
                log.error(
                    "batched prefill failed; retrying its requests one by one:\n%s", traceback.format_exc()
                )
                for seq in group:
                    self.state.reset(seq.slot)
                rest.extend(group)
                continue
            if logits is None:
                rest.extend(group)
                continue
            self.recorded(group, [len(ids) for ids, _, _ in chunks], logits, outputs)
        return rest

    def one(self, seq: Sequence, outputs: StepOutputs) -> None:
        """One prompt chunk of one request; the first token after the last chunk."""
        start = seq.prefilled
        ids = seq.prompt_ids[start : start + self.chunk]
        logits = self.runner.prefill(ids, start, seq.slot, seq.speculative)  # [1, vocab]
        self.recorded([seq], [start + len(ids)], logits, outputs)

    def recorded(
        self, seqs: list[Sequence], ends: list[int], logits: torch.Tensor, outputs: StepOutputs
    ) -> None:
        """Record prefill chunks up to `ends`; the first token of each request whose prompt
        is done (logits [rows, vocab]: each chunk's last)."""
        done = []
        for i, (seq, end) in enumerate(zip(seqs, ends)):
            seq.prefilled = end
            self.state.lengths[seq.slot] = end
            if end == len(seq.prompt_ids):
                done.append(i)
        if not done:
            return
        with self.timer.phase("sample"):
            chosen = [seqs[i] for i in done]
            rows = logits if len(done) == logits.shape[0] else logits[to_device(done, logits.device)]
            if all(s.params.argmax_only for s in chosen):
                # the device argmax of every row at once (lowest id on a tie, as choose_tokens)
                # and one transfer, as decode does, instead of a few operations per row
                first = self.runner.ops.greedy(rows)
                if self.defer_first and all(s.params.max_tokens > 1 for s in chosen):
                    pending = DeviceTokens(first)
                    for j, seq in enumerate(chosen):
                        seq.phase, seq.pending = Phase.RUNNING, (pending, j)
                    return
                tokens, logprobs = [[t] for t in first.tolist()], [None] * len(done)
            else:
                tokens, logprobs = choose_tokens(rows, chosen)
        for i, token, lp in zip(done, tokens, logprobs):
            seqs[i].phase = Phase.RUNNING
            seqs[i].first_token_s = time.monotonic()
            outputs.emit(seqs[i], token, lp)
