"""The continuous-batching engine: many requests, one step loop, plain or DFlash decoding.

    engine = Engine(target, draft, EngineConfig(max_num_seqs=8, block_size=16))
    engine.add_request("a", prompt_ids, SamplingParams(max_tokens=64))
    while engine.has_unfinished():
        for out in engine.step():        # each request's newly committed tokens
            ...

A step: schedule (admit waiting requests into free slots), prefill (one chunk per new
request; with CUDA graphs the first chunks of several requests in one forward), decode (one
batched forward for plain requests), speculate (one batched draft forward and one batched
verify forward for speculative requests; each row accepts and commits its own count).
Slots and state are preallocated; nothing grows during a run.

One request's failure is its own: an exception in its prefill (a batched prefill that raises
is retried row by row from reset slots), or a row whose next-token distribution is not
finite (NaN or inf logits, an overflowed sampling arithmetic), ends that request with
finish_reason "error" and the reason in `Sequence.error`; the other rows of the same batch
commit what they would have committed anyway. An exception inside a batched
forward cannot be pinned on one row, so it fails the rows of that forward, and only them.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..errors import ConfigError, RequestError
from ..kernels import NUMERICS, default_numerics, select
from ..models import CausalLM, fuse_projections
from ..models.dflash import DFlashDraft, DraftState
from .commit import check_strategy, verify_record
from .decode import context_length, stop_ids
from .graphs import EngineGraphs
from .profiling import NvtxRanges
from .request import SamplingParams, validate_prompt
from .sequence import (
    FALLBACK_LOGPROBS,
    FALLBACK_LOW_ACCEPTANCE,
    FALLBACK_PENALTIES,
    FALLBACK_SAMPLING,
    Phase,
    Sequence,
)
from .speculate import SpeculativeStep, StepCommit
from .state import TargetState
from .stats import PhaseTimer, SpecCounters
from .token_choice import choose_tokens
from .transfer import to_device

ADMISSION_POLICIES = ("wait", "reject")
log = logging.getLogger(__name__)


class EngineFullError(RequestError):
    """No room for a request (admission policy `reject`, or the waiting queue is full)."""


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8  # slots, preallocated
    max_model_len: int | None = None  # default: the target's max_position_embeddings
    block_size: int | None = None  # DFlash block size; None with a draft: the draft's
    commit_strategy: str = "replay"
    prefill_chunk: int = 512
    admission: str = "wait"  # "wait": queue; "reject": refuse when no slot is free
    max_waiting: int = 1024  # queued requests beyond the free slots
    # fallback to plain decode when a request's mean acceptance length stays below this
    # after `fallback_after_steps` steps; None disables it (the default, as in the gates)
    fallback_min_acceptance: float | None = None
    fallback_after_steps: int = 8
    # kernels: "exact" (batch- and verify-invariant, bit-exact DFlash in bf16 on CUDA) or
    # "fast" (cuBLAS GEMMs, kernels/triton_ops.VENDOR); None: exact on CUDA. On the CPU the
    # PyTorch references run.
    numerics: str | None = None
    # run every forward eagerly; by default the decode, draft, verify and commit of both
    # numerics on CUDA replay CUDA graphs captured at start-up (graphs.py)
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.prefill_chunk <= 0:
            raise ConfigError(f"prefill_chunk must be positive, got {self.prefill_chunk}")
        if self.admission not in ADMISSION_POLICIES:
            raise ConfigError(
                f"admission must be one of {', '.join(ADMISSION_POLICIES)}, got {self.admission!r}"
            )
        if self.block_size is not None and self.block_size < 2:
            raise ConfigError(f"block size must be >= 2, got {self.block_size}")
        check_strategy(self.commit_strategy)
        if self.fallback_after_steps <= 0:
            raise ConfigError(
                f"fallback_after_steps must be positive, got {self.fallback_after_steps}"
            )
        if self.max_waiting < 0:
            raise ConfigError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.numerics is not None and self.numerics not in NUMERICS:
            raise ConfigError(
                f"numerics must be one of {', '.join(NUMERICS)}, got {self.numerics!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request: its newly committed tokens."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    time_s: float  # time.monotonic() when the tokens were committed
    new_logprobs: list[dict[int, float]] | None = None
    error: str | None = None  # set when the engine failed this request (finish_reason "error")


class Engine:
    def __init__(
        self,
        target: CausalLM,
        draft: DFlashDraft | None = None,
        config: EngineConfig | None = None,
        ranges: NvtxRanges | None = None,
    ) -> None:
        config = config or EngineConfig()
        self.target, self.draft, self.config = target, draft, config
        weight = target.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.numerics = config.numerics or default_numerics(self.device, self.dtype)
        self.ops = select(self.numerics, self.device, self.dtype)
        self.context_len = context_length(target, config.max_model_len)
        self.block_size = 0
        if draft is not None:
            draft.config.check_target(target.config)
            self.block_size = config.block_size or draft.config.block_size
            if self.block_size > draft.config.block_size:
                raise ConfigError(
                    f"block size {self.block_size} is larger than the draft supports "
                    f"({draft.config.block_size})"
                )
        if self.device.type == "cuda":  # one matmul per group of projections that share an input
            fuse_projections(target)
            if draft is not None:
                fuse_projections(draft)
        room = self.context_len + self.block_size  # a verify may run past the last token
        use_graphs = self.device.type == "cuda" and self.ops.capturable and not config.enforce_eager
        # CUDA graphs pad a batch to its bucket with rows on one spare slot that no request owns
        slots = config.max_num_seqs + int(use_graphs)
        self.state = TargetState(target.config, slots, room, self.dtype,
                                 self.device, self.block_size, config.commit_strategy)
        self.draft_state = (
            DraftState(draft.config, slots, room, self.dtype, self.device)
            if draft is not None else None
        )
        self.free_slots = list(range(config.max_num_seqs))
        self.waiting: deque[Sequence] = deque()
        self.active: dict[str, Sequence] = {}  # with a slot
        self.known: dict[str, Sequence] = {}  # every live request (waiting or active)
        self.finished: dict[str, Sequence] = {}  # done, until the caller collects them
        self.ranges = ranges or NvtxRanges()
        self.timer = PhaseTimer(self.device, self.ranges)
        self.spec_totals = SpecCounters()
        self.fallbacks: dict[str, int] = {}
        self.graphs = None
        if use_graphs:
            self.graphs = EngineGraphs(
                target, draft, self.state, self.draft_state, self.ops, config.max_num_seqs,
                pad_slot=config.max_num_seqs, block_size=self.block_size,
                capture_layers=draft.config.target_layer_ids if draft is not None else (),
                record=verify_record(config.commit_strategy, target) if draft is not None else None,
                prefill_chunk=config.prefill_chunk)
            self.graphs.capture()
        self.speculative_step = (
            SpeculativeStep(target, draft, self.state, self.draft_state, self.block_size,
                            config.commit_strategy, self.timer, self.ops, self.graphs)
            if draft is not None else None
        )
        if self.speculative_step is not None:
            self.speculative_step.capture_commit()
        self.finished_requests = 0
        # called as observer(seq, state, length) after each speculative commit
        # (the state-equality gates); None in normal use
        self.commit_observer = None

    # ------------------------------------------------------------------ lifecycle
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        oracle: object | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        """Queue a request. Raises RequestError on bad input (other requests unaffected)
        and EngineFullError when the admission policy refuses it."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.known or request_id in self.finished:
            raise RequestError(f"duplicate request id {request_id!r}")
        validate_prompt(prompt_ids, self.target.config.vocab_size, self.context_len,
                        params.max_tokens)
        vocab = self.target.config.vocab_size
        outside = [t for t, _ in params.logit_bias if t >= vocab]
        if outside:
            raise RequestError(f"logit_bias token id(s) {outside[:5]} outside the vocabulary "
                               f"[0, {vocab})")
        if oracle is not None and not params.greedy:
            raise RequestError("the oracle proposer is greedy-only (temperature 0)")
        # queued requests take the free slots first, at the next step
        if self.config.admission == "reject" and len(self.waiting) >= len(self.free_slots):
            raise EngineFullError(
                f"no free slot for request {request_id!r}: all {self.config.max_num_seqs} "
                "are busy or promised (admission policy 'reject')"
            )
        if len(self.waiting) - len(self.free_slots) >= self.config.max_waiting:
            raise EngineFullError(
                f"waiting queue full ({self.config.max_waiting} requests); retry later"
            )
        seq = Sequence(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            stops=stop_ids(self.target, params),
            arrival_s=time.monotonic(),
            speculative=self.draft is not None,
            oracle=oracle,
        )
        if not params.greedy:
            if generator is None:
                generator = torch.Generator(device=self.device)
                if params.seed is None:
                    generator.seed()  # this generator only; the global one stays untouched
                else:
                    try:
                        generator.manual_seed(params.seed)
                    except (RuntimeError, OverflowError) as exc:
                        raise RequestError(f"seed {params.seed} is outside the generator's "
                                           f"range: {exc}") from None
            seq.generator = generator
        if seq.speculative:
            if params.logprobs is not None:
                self._fall_back(seq, FALLBACK_LOGPROBS)
            elif params.repetition_penalty != 1.0:
                self._fall_back(seq, FALLBACK_SAMPLING)
            elif params.penalised:
                self._fall_back(seq, FALLBACK_PENALTIES)
        self.known[request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is; its slot is free for the next step."""
        seq = self.known.pop(request_id, None)
        if seq is None:
            raise RequestError(f"unknown request id {request_id!r}")
        if seq.phase is Phase.WAITING:
            self.waiting.remove(seq)
        else:
            self._release(seq)
        seq.phase, seq.finish_reason = Phase.FINISHED, "abort"

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.active)

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

    # ------------------------------------------------------------------ the step
    def step(self) -> list[StepOutput]:
        # no autograd bookkeeping in the forwards (a few us per op, on every op of the step);
        # what leaves the step is host values, never an inference tensor
        with self.ranges.range("step"), torch.inference_mode():
            return self._step()

    def _step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        with self.timer.phase("schedule"):
            self._admit()
        with self.timer.phase("prefill"):
            pending = [s for s in self.active.values() if s.phase is Phase.PREFILL]
            if self.graphs is not None:
                pending = self._prefill_batched(pending, outputs)
            for seq in pending:
                with self._failing([seq], outputs):
                    self._prefill(seq, outputs)
        running = [s for s in self.active.values()
                   if s.phase is Phase.RUNNING and s.finish_reason is None]
        plain = [s for s in running if not s.speculative]
        spec = [s for s in running if s.speculative]
        if plain:
            with self.timer.phase("decode"), self._failing(plain, outputs):
                self._decode(plain, outputs)
        if spec:
            commits: list[StepCommit] = []
            with self._failing(spec, outputs):
                commits = self.speculative_step(spec)
            for seq, commit in zip(spec, commits):
                self._record_speculative(seq, commit, outputs)
        for seq in list(self.active.values()):
            if seq.finish_reason is not None:
                self._finish(seq)
        self.timer.flush()
        return outputs

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop(0)
            seq.phase = Phase.PREFILL
            self.state.reset(seq.slot)
            self.active[seq.request_id] = seq

    def _prefill_batched(self, seqs: list[Sequence], outputs: list[StepOutput]) -> list[Sequence]:
        """The first prompt chunks of newly admitted requests, several to a captured prefill
        graph; returns the requests left to `_prefill` (later chunks, chunks no graph holds,
        and the rows of a batch that raised, each retried alone from a reset slot so that a
        failing request fails alone)."""
        chunk = self.config.prefill_chunk
        firsts = [s for s in seqs if s.prefilled == 0]
        rest = [s for s in seqs if s.prefilled != 0]
        groups: list[list[Sequence]] = []
        for seq in firsts:
            group = groups[-1] if groups else None
            longest = min(chunk, max(len(s.prompt_ids) for s in [*(group or []), seq]))
            if group is not None and self.graphs.prefill_fits(len(group) + 1, longest):
                group.append(seq)
            else:
                groups.append([seq])
        for group in groups:
            chunks = [(s.prompt_ids[:chunk], 0, s.slot) for s in group]
            try:
                replayed = self.graphs.prefill(chunks)
            except Exception:  # noqa: BLE001 - retried row by row below
                log.error("batched prefill failed; retrying its requests one by one:\n%s",
                          traceback.format_exc())
                for seq in group:
                    self.state.reset(seq.slot)
                rest.extend(group)
                continue
            if replayed is None:
                rest.extend(group)
                continue
            self._prefilled(group, [len(ids) for ids, _, _ in chunks], replayed["logits"], outputs)
        return rest

    def _prefilled(self, seqs: list[Sequence], ends: list[int], logits: torch.Tensor,
                   outputs: list[StepOutput]) -> None:
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
            tokens, logprobs = choose_tokens(logits[done], [seqs[i] for i in done])
        for i, token, lp in zip(done, tokens, logprobs):
            seqs[i].phase = Phase.RUNNING
            seqs[i].first_token_s = time.monotonic()
            self._emit(seqs[i], token, outputs, lp)

    def _prefill(self, seq: Sequence, outputs: list[StepOutput]) -> None:
        """One prompt chunk of one request; the first token after the last chunk."""
        start = seq.prefilled
        ids = seq.prompt_ids[start : start + self.config.prefill_chunk]
        end = start + len(ids)
        replayed = (self.graphs.prefill([(ids, start, seq.slot)])
                    if self.graphs is not None else None)
        if replayed is not None:
            logits = replayed["logits"]  # [1, vocab]
        else:
            slots = to_device([seq.slot], self.device)
            positions = torch.arange(start, end, device=self.device)[None]
            capture = self.draft.config.target_layer_ids if seq.speculative else ()
            out = self.target(to_device([ids], self.device), positions, slots,
                              self.state, kv_len=end, capture_layers=capture, last_only=True,
                              ops=self.ops)
            if seq.speculative:
                self.draft.append_context(out.features, positions, slots, self.draft_state,
                                          self.ops)
            logits = out.logits[:, -1]
        self._prefilled([seq], [end], logits, outputs)

    def _decode(self, seqs: list[Sequence], outputs: list[StepOutput]) -> None:
        """One token for each plain request, in one forward."""
        lengths = [self.state.lengths[s.slot] for s in seqs]
        # one copy for the three, queued without waiting for the device (transfer.py)
        ids, positions, slots = to_device(
            [[s.output_ids[-1] for s in seqs], lengths, [s.slot for s in seqs]], self.device)
        ids, positions = ids[:, None], positions[:, None]
        replayed = self.graphs.decode(ids, positions, slots) if self.graphs is not None else None
        if replayed is not None:
            logits = replayed["logits"]  # [b, vocab]
        else:
            out = self.target(ids, positions, slots, self.state, kv_len=max(lengths) + 1,
                              ops=self.ops)
            logits = out.logits[:, -1]
        for seq, n in zip(seqs, lengths):
            self.state.lengths[seq.slot] = n + 1
        with self.timer.phase("sample"):
            if all(s.params.greedy and s.params.logprobs is None
                   and s.params.repetition_penalty == 1.0 and not s.params.penalised
                   for s in seqs):
                # the device argmax (lowest id on a tie, as choose_tokens), one transfer
                chosen = replayed["tokens"] if replayed is not None else self.ops.greedy(logits)
                tokens, logprobs = [[t] for t in chosen.tolist()], [None] * len(seqs)
            else:
                tokens, logprobs = choose_tokens(logits, seqs)
        for seq, token, lp in zip(seqs, tokens, logprobs):
            self._emit(seq, token, outputs, lp)

    def _record_speculative(self, seq: Sequence, commit: StepCommit,
                            outputs: list[StepOutput]) -> None:
        if self.commit_observer is not None:
            self.commit_observer(seq, self.state, self.state.lengths[seq.slot])
        before = len(seq.output_ids)
        if not self._emit(seq, commit.tokens, outputs):
            return
        committed = len(seq.output_ids) - before
        seq.record_step(commit.proposed, commit.accepted, committed, commit.drafted)
        self.spec_totals.record(commit.proposed, commit.accepted, committed)
        self._check_low_acceptance(seq)

    # ------------------------------------------------------------------ helpers
    def _emit(self, seq: Sequence, tokens: list[int], outputs: list[StepOutput],
              logprobs: list[dict[int, float]] | None = None) -> bool:
        """Commit a request's new tokens; False (and the request failed) when one of them is
        not a token: its row's distribution was not finite (greedy gives `vocab` for a NaN
        row, sampling NOT_A_DISTRIBUTION)."""
        vocab = self.target.config.vocab_size
        if not all(0 <= t < vocab for t in tokens):
            self._fail(seq, "numerical failure: the next-token distribution is not finite "
                            "(NaN or inf logits or probabilities)", outputs)
            return False
        kept = seq.append(tokens)
        if logprobs is not None:
            logprobs = logprobs[: len(kept)]
            seq.logprobs.extend(logprobs)
        outputs.append(StepOutput(seq.request_id, kept, seq.finish_reason is not None,
                                  seq.finish_reason, time.monotonic(), logprobs))
        return True

    def _fail(self, seq: Sequence, reason: str, outputs: list[StepOutput]) -> None:
        """End one request with finish_reason "error"; its slot is freed at the step's end."""
        if seq.finish_reason is not None:
            return
        seq.finish_reason, seq.error = "error", reason
        outputs.append(StepOutput(seq.request_id, [], True, "error", time.monotonic(),
                                  error=reason))

    @contextmanager
    def _failing(self, seqs: list[Sequence], outputs: list[StepOutput]) -> Iterator[None]:
        """An exception inside the block fails `seqs` (the rows it was computing) and no
        other request; the traceback goes to the log."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - contained to these requests on purpose
            ids = ", ".join(s.request_id for s in seqs)
            log.error("engine step failed for request(s) %s:\n%s", ids, traceback.format_exc())
            for seq in seqs:
                self._fail(seq, f"engine error: {type(exc).__name__}: {exc}", outputs)

    def _fall_back(self, seq: Sequence, reason: str) -> None:
        seq.speculative = False
        seq.fallback_reason = reason
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def _check_low_acceptance(self, seq: Sequence) -> None:
        threshold = self.config.fallback_min_acceptance
        if threshold is None or seq.spec.steps < self.config.fallback_after_steps:
            return
        if seq.spec.mean_acceptance_length < threshold:
            self._fall_back(seq, FALLBACK_LOW_ACCEPTANCE)

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None and self.active.pop(seq.request_id, None) is not None:
            self.free_slots.append(seq.slot)
            self.free_slots.sort()

    def _finish(self, seq: Sequence) -> None:
        self._release(seq)
        seq.phase = Phase.FINISHED
        seq.finished_s = time.monotonic()
        self.finished_requests += 1
        self.known.pop(seq.request_id, None)
        self.finished[seq.request_id] = seq

    def reset_stats(self) -> None:
        """Start the statistics afresh (finished-request count, acceptance counters, fallbacks,
        phase times), e.g. between benchmark runs on one engine; needs an idle engine."""
        if self.has_unfinished():
            raise RequestError("reset_stats needs an idle engine: requests are still running")
        self.finished_requests = 0
        self.spec_totals = SpecCounters()
        self.fallbacks = {}
        self.timer.reset()

    def stats(self) -> dict:
        """Engine-wide statistics since the engine started or `reset_stats()` (see stats.py
        for the definitions)."""
        return {
            "requests_finished": self.finished_requests,
            "running": len(self.active),
            "waiting": len(self.waiting),
            "spec": self.spec_totals.as_dict(),
            "fallbacks": dict(self.fallbacks),
            "phases": self.timer.as_dict(),
        }
