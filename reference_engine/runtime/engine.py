"""The continuous-batching engine: many requests, one step loop, plain or DFlash decoding.

    engine = Engine(target, draft, EngineConfig(max_num_seqs=8, block_size=16))
    engine.add_request("a", prompt_ids, SamplingParams(max_tokens=64))
    while engine.has_unfinished():
        for out in engine.step():        # each request's newly committed tokens
            ...

A step: schedule (admit waiting requests into free slots), prefill (one chunk per new
request, within the token budget when there is one; with CUDA graphs the first chunks of
several requests in one forward), decode (one batched forward for plain requests), speculate
(one batched draft forward and one batched verify forward for speculative requests; each row
accepts and commits its own count). Prefill and decode share the step as separate forwards,
not one fused one: a request that is decoding gets its tokens in every step while a long
prompt prefills beside it, one chunk a step.
Slots and state are preallocated; nothing grows during a run. The scheduler (scheduler.py)
decides who holds a slot, the model runner (model_runner.py) how each forward runs (a CUDA
graph or eager), the speculative step (speculative_step.py) what a DFlash step commits.

One request's failure is its own (outputs.py): an exception in its prefill (a batched
prefill that raises is retried row by row from reset slots) or in a forward, or a row whose
next-token distribution is not finite, ends that request with finish_reason "error"; the
other rows of the step commit what they would have committed anyway.
"""

from __future__ import annotations

import logging
import sys
import time
import weakref
from collections import Counter

import torch

from ..errors import ConfigError, RequestError
from ..kernels import Kernels, default_numerics, select
from ..models import CausalLM, fuse_projections
from ..models.dflash import DFlashDraft, DraftState
from .commit import verify_record
from .decode import context_length, stop_ids
from .engine_config import EngineConfig
from .graphs import PREFILL_BATCH_TOKENS, padded_end
from .host_memory import keep_freed_memory
from .kv_pool import CellAllocator, PoolLayout
from .memory import GiB, MemoryPlan, activation_peak, plan_memory, state_cost, weight_bytes
from .model_runner import ModelRunner, graphs_possible
from .oracle import Proposer
from .outputs import StepOutput, StepOutputs
from .prefill import Prefill
from .profiling import NvtxRanges
from .request import SamplingParams, new_generator, validate_request
from .scheduler import EngineFullError, Scheduler
from .sequence import Sequence
from .speculative_step import SpeculativeStep, StepCommit
from .state import TargetState, checkpoint_every
from .stats import PhaseTimer, SpecCounters
from .token_choice import choose_tokens
from .transfer import place_tokens, to_device
from .verify_width import StepCosts, VerifyWidth, width_candidates, width_spacing

__all__ = ["Engine", "EngineConfig", "EngineFullError", "StepOutput"]

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        target: CausalLM,
        draft: DFlashDraft | None = None,
        config: EngineConfig | None = None,
        ranges: NvtxRanges | None = None,
        step_costs: StepCosts | None = None,
    ) -> None:
        """`step_costs`: what a speculative step costs by (rows, verify width), for the verify
        width `auto` (verify_width.py); by default measured from the CUDA graphs, and without
        them flat, or timed from whole eager steps with `config.measure_step_costs`
        (SpeculativeStep.seconds)."""
        config = config or EngineConfig()
        self.target, self.draft, self.config = target, draft, config
        weight = target.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.numerics = config.numerics or default_numerics(self.device, self.dtype)
        ops = select(self.numerics, self.device, self.dtype)
        if self.device.type == "cpu":  # a step's freed activations reused, not unmapped (host_memory.py)
            keep_freed_memory()
        self.context_len = context_length(target, config.max_model_len)
        self.block_size = config.block_size_for(target, draft)
        if self.device.type == "cuda":  # one matmul per group of projections that share an input
            fuse_projections(target)
            if draft is not None:
                fuse_projections(draft)
        room = self.context_len + self.block_size  # a verify may run past the last token
        use_graphs = graphs_possible(self.device, ops, config.enforce_eager)
        if use_graphs and draft is not None and config.draft_span != "block":
            raise ConfigError(
                f"draft span {config.draft_span!r} runs eager forwards only: the captured drafts run "
                "whole blocks (add --enforce-eager, or keep --draft-span block)"
            )
        # CUDA graphs pad a batch to its bucket with rows on one spare slot that no request owns
        slots = config.max_num_seqs + int(use_graphs)
        self.pool = (
            PoolLayout.for_tokens(config.kv_cache_tokens, config.kv_cell_tokens, room)
            if config.kv_cache_tokens is not None
            else None
        )
        self.memory: MemoryPlan | None = None
        if self.device.type == "cuda" and config.gpu_memory_utilization is not None:
            self.memory = self._plan_memory(ops, slots, room, use_graphs)
        before = torch.cuda.memory_allocated(self.device) if self.memory is not None else 0
        self.state, self.draft_state = self.build_states(slots, room, self.device, self.pool)
        # the scheduler asks for cells through a weak reference: the bound method would tie
        # the engine into a reference cycle, and its device memory would then wait for the
        # garbage collector after the engine is dropped (a second engine in the same process
        # could run out of memory meanwhile)
        cells_needed = weakref.WeakMethod(self.cells_needed)
        self.scheduler = Scheduler(
            config.max_num_seqs,
            config.admission,
            config.max_waiting,
            config.fallback_min_acceptance,
            config.fallback_after_steps,
            config.prefill_chunk,
            config.max_num_batched_tokens,
            self.block_size,
            CellAllocator(self.pool.cells) if self.pool is not None else None,
            lambda seq: cells_needed()(seq),
        )
        self.ranges = ranges or NvtxRanges()
        self.timer = PhaseTimer(self.device, self.ranges, device_times=config.device_phase_times)
        self.spec_totals = SpecCounters()
        self.stats_epoch = 0  # how many times reset_stats started the statistics afresh
        self.steps = 0  # steps that ran (prefill, plain decode, speculative, or a mix)
        # a plain step (verify width 0) runs on the CPU only: on CUDA neither its captured
        # graphs nor its eager forwards (a verify of one token) have run on a device yet
        plain_step = self.device.type == "cpu"
        # with CUDA graphs the widths are captured and timed by replay: every width up to
        # EVERY_WIDTH_ROWS rows, spaced by halves past them; eager engines time whole steps, so
        # they keep a small set
        spacing = width_spacing(use_graphs, config.max_num_seqs)
        widths = (
            width_candidates(self.block_size, config.verify_width, plain_step, spacing)
            if draft is not None
            else ()
        )
        self.runner = ModelRunner(
            target,
            draft,
            self.state,
            self.draft_state,
            ops,
            config.commit_strategy,
            config.max_num_seqs,
            self.block_size,
            config.prefill_chunk,
            use_graphs,
            widths,
        )
        self.speculative_step = (
            SpeculativeStep(
                target,
                draft,
                self.state,
                self.draft_state,
                self.block_size,
                config.commit_strategy,
                self.timer,
                self.runner,
                draft_span=config.draft_span,
            )
            if draft is not None
            else None
        )
        self.verify_width: VerifyWidth | None = None
        self.verify_widths: Counter = Counter()  # verify width -> speculative steps
        if self.speculative_step is not None:
            self.speculative_step.capture_commit()
            measured, unpadded = None, False
            if step_costs is None and len(widths) > 1:
                measured = self.runner.step_seconds()
                if measured is None and config.measure_step_costs and not use_graphs:
                    # eager steps run their own rows: costs between the timed counts interpolate
                    measured, unpadded = self.speculative_step.seconds(widths, config.max_num_seqs), True
            if measured:
                step_costs = StepCosts(measured, measured=True, unpadded=unpadded)
            if getattr(target, "tensor_parallel", None) is not None:
                # every rank chooses widths from rank 0's costs: widths chosen from each rank's
                # own timings could differ, and the ranks' collectives would stop matching
                shared = [step_costs]
                torch.distributed.broadcast_object_list(shared, src=0)
                step_costs = shared[0]
            self.verify_width = VerifyWidth(
                config.verify_width, self.block_size, step_costs, plain_step, spacing
            )
        # on CUDA a greedy request's first token is read with its first step's results
        defer_first = self.device.type == "cuda"
        self.prefill = Prefill(self.runner, self.state, self.timer, config.prefill_chunk, defer_first)
        if self.memory is not None:
            graphs = torch.cuda.memory_allocated(self.device) - before - self.memory.state
            line = f"{self.memory.describe()}; CUDA graphs {graphs / GiB:.2f} GiB"
            print(line, file=sys.stderr, flush=True)
        # called as observer(seq, state, length) after each speculative commit
        # (the state-equality gates); None in normal use
        self.commit_observer = None

    def build_states(
        self, slots: int, room: int, device: torch.device, pool: PoolLayout | None = None
    ) -> tuple[TargetState, DraftState | None]:
        """The target's and the draft's state for `slots` slots of `room` tokens each, or with
        a `pool` their attention caches pooled (on the meta device: what they would take, for
        the memory plan)."""
        config = self.config
        # the engine's device decides, also for a state measured on the meta device
        every = config.checkpoint_every or checkpoint_every(self.device, self.dtype)
        state = TargetState(
            self.target.config,
            slots,
            room,
            self.dtype,
            device,
            self.block_size,
            config.commit_strategy,
            pool,
            every,
        )
        draft_state = None
        if self.draft is not None:
            draft_state = DraftState(self.draft.config, slots, room, self.dtype, device, pool, state.cell_of)
        return state, draft_state

    def kv_cache_usage(self) -> float:
        """The share of the KV cache the running requests hold: a pooled cache's cells taken,
        or the slots taken (each holds a whole room)."""
        scheduler = self.scheduler
        if scheduler.cells is not None:
            return 1.0 - scheduler.cells.free_cells / scheduler.cells.cells
        return len(scheduler.active) / scheduler.max_num_seqs

    def cells_needed(self, seq: Sequence) -> int:
        """Cells of a pooled KV cache a request takes: its prompt, its max_tokens (the context
        without a limit) and one block, which a verify may write past its last token, or, if
        further, where a captured prefill of its prompt writes its last chunk's padding."""
        prompt = len(seq.prompt_ids)
        tokens = min(prompt + (seq.params.max_tokens or self.context_len), self.context_len) + self.block_size
        padded = padded_end(prompt, self.config.prefill_chunk, self.pool.room)
        return self.pool.cells_for(max(tokens, padded))

    def _plan_memory(self, ops: Kernels, slots: int, room: int, use_graphs: bool) -> MemoryPlan:
        """Whether `slots` x `room` tokens of state fit the device's budget (memory.py), from
        the device's size, the weights and a measured activation peak; ConfigError if not."""
        config = self.config
        # the largest prefill: one chunk eagerly, a batched bucket's tokens with graphs
        prefill_tokens = min(max(config.prefill_chunk, PREFILL_BATCH_TOKENS * use_graphs), self.context_len)
        record = verify_record(config.commit_strategy, self.target) if self.draft is not None else None
        activations = activation_peak(
            self.target,
            self.draft,
            ops,
            self.build_states,
            config.max_num_seqs,
            max(self.block_size, 1),
            prefill_tokens,
            record,
        )
        return plan_memory(
            torch.cuda.get_device_properties(self.device).total_memory,
            config.gpu_memory_utilization,
            weight_bytes(self.target, self.draft),
            activations,
            state_cost(self.build_states),
            slots,
            room,
            config.max_num_seqs,
            self.context_len,
            self.pool.rows if self.pool is not None else None,
            self.pool.cell_tokens if self.pool is not None else 1,
        )

    @property
    def ops(self) -> Kernels:
        """The kernel table every forward runs with."""
        return self.runner.ops

    # ------------------------------------------------------------------ lifecycle
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        oracle: Proposer | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        """Queue a request. Raises RequestError on bad input (other requests unaffected)
        and EngineFullError when the admission policy refuses it."""
        validate_request(
            prompt_ids, params, self.target.config.vocab_size, self.context_len, oracle is not None
        )
        self.scheduler.check_new(request_id)
        seq = Sequence(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            stops=stop_ids(self.target, params),
            arrival_s=time.monotonic(),
            speculative=self.draft is not None,
            oracle=oracle,
        )
        self.scheduler.check_room(seq)
        if not params.greedy:
            seq.generator = generator or new_generator(self.device, params.seed)
        self.scheduler.queue(seq)

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is; its slot is free for the next step, and what its
        plain steps deferred for the draft is dropped with it."""
        seq = self.scheduler.abort(request_id)
        if self.speculative_step is not None:
            self.speculative_step.drop_context([seq])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def get(self, request_id: str) -> Sequence:
        return self.scheduler.get(request_id)

    def collect(self, request_id: str) -> Sequence:
        """Hand over a finished request and forget it."""
        return self.scheduler.collect(request_id)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[StepOutput]:
        # no autograd bookkeeping in the forwards (a few us per op, on every op of the step);
        # what leaves the step is host values, never an inference tensor
        with self.ranges.range("step"), torch.inference_mode():
            outputs = self._step()
        self.steps += 1
        return outputs

    def _step(self) -> list[StepOutput]:
        outputs = StepOutputs(self.target.config.vocab_size)
        with self.timer.phase("schedule"):
            admitted = self.scheduler.admit()
            self.state.reset_slots([seq.slot for seq in admitted])
            for seq in admitted:
                if seq.cell is not None:
                    self.state.place(seq.slot, seq.cell)
        with self.timer.phase("prefill"):
            self.prefill(self.scheduler.prefilling(), outputs)
        running = self.scheduler.running()
        plain = [s for s in running if not s.speculative]
        spec = [s for s in running if s.speculative]
        if plain:
            with self.timer.phase("decode"), outputs.failing(plain):
                self._decode(plain, outputs)
        if spec:
            turn: list[list[StepCommit]] = []
            with outputs.failing(spec):
                # the draft tokens a row can commit: a step commits at most what it has left,
                # its accepted draft tokens and the target's own token after them
                width = self.verify_width.choose(
                    [min(self.block_size - 1, max(s.remaining - 1, 0)) for s in spec],
                    [s.recent for s in spec],
                    self.spec_totals,
                )
                # the next step's draft may be queued behind this one's commit when no
                # request is about to join these rows (speculative_step.DraftAhead)
                same_rows = not self.scheduler.may_join_next()
                # one step when a turn would hold back others' tokens (a plain request's, a
                # chunked prompt's) or an observer must see the state after each step's commit
                several = not plain and not self.scheduler.prefilling() and self.commit_observer is None
                steps = self.config.steps_per_turn if several else 1
                turn = self.speculative_step.turn(spec, width, steps, same_rows_next=same_rows)
                self.verify_widths[width] += len(turn)  # steps that ran (one that raised is not counted)
                self.steps += len(turn) - 1
            for commits in turn:  # a turn of several steps: each step's tokens in turn
                for seq, commit in zip(spec, commits):
                    if seq.finish_reason is not None:  # it ended at an earlier step of the turn
                        continue
                    if seq.pending is None or self.emit_first(seq, outputs):
                        self._record_speculative(seq, commit, outputs, drafted=width > 0)
            if self.speculative_step.deferred:  # a request that ended never drafts again
                self.speculative_step.drop_context([s for s in spec if s.finish_reason is not None])
        for seq in running:  # a step that raised read nothing: a first token it left is dropped
            seq.pending = None
        self.scheduler.finish_done()
        self.timer.flush()
        return outputs.items

    def _decode(self, seqs: list[Sequence], outputs: StepOutputs) -> None:
        """One token for each plain request, in one forward."""
        lengths = [self.state.lengths[s.slot] for s in seqs]
        # one copy for the three, queued without waiting for the device (transfer.py)
        ids, positions, slots = to_device(
            [[s.output_ids[-1] if s.pending is None else 0 for s in seqs], lengths, [s.slot for s in seqs]],
            self.device,
        )
        pending = [(i, *s.pending) for i, s in enumerate(seqs) if s.pending is not None]
        if pending:  # first tokens still on the device (prefill.py)
            place_tokens(ids, pending)
        out = self.runner.decode(ids[:, None], positions[:, None], slots, max(lengths) + 1)
        for seq, n in zip(seqs, lengths):
            self.state.lengths[seq.slot] = n + 1
        with self.timer.phase("sample"):
            if all(s.params.argmax_only for s in seqs):
                # the device argmax (lowest id on a tie, as choose_tokens), one transfer
                chosen = out.tokens if out.tokens is not None else self.ops.greedy(out.logits)
                tokens, logprobs = [[t] for t in chosen.tolist()], [None] * len(seqs)
            else:
                tokens, logprobs = choose_tokens(out.logits, seqs)
        for seq, token, lp in zip(seqs, tokens, logprobs):
            if seq.pending is None or self.emit_first(seq, outputs):
                outputs.emit(seq, token, lp)

    def emit_first(self, seq: Sequence, outputs: StepOutputs) -> bool:
        """Emit a first token that the prefill left on the device (prefill.py), now that the
        step has read its results; whether the request goes on (its first token may end it,
        and then the step's tokens for it are dropped)."""
        tokens, index = seq.pending
        seq.pending = None
        seq.first_token_s = time.monotonic()
        return outputs.emit(seq, [tokens.value(index)]) and seq.finish_reason is None

    def _record_speculative(
        self, seq: Sequence, commit: StepCommit, outputs: StepOutputs, drafted: bool = True
    ) -> None:
        """Emit a speculative step's tokens and count its acceptance; a plain step of a
        speculative request (verify width 0, `drafted` False) verified nothing and counts none."""
        if self.commit_observer is not None:
            self.commit_observer(seq, self.state, self.state.lengths[seq.slot])
        before = len(seq.output_ids)
        if not outputs.emit(seq, commit.tokens) or not drafted:
            return
        committed = len(seq.output_ids) - before
        seq.record_step(commit.proposed, commit.accepted, committed, commit.drafted)
        self.spec_totals.record(commit.proposed, commit.accepted, committed)
        self.scheduler.check_low_acceptance(seq)

    # ------------------------------------------------------------------ statistics
    def reset_stats(self) -> None:
        """Start the statistics afresh (finished-request count, acceptance counters, fallbacks,
        phase times), e.g. between benchmark runs on one engine; needs an idle engine."""
        if self.has_unfinished():
            raise RequestError("reset_stats needs an idle engine: requests are still running")
        self.scheduler.reset_stats()
        self.stats_epoch += 1  # readers of the totals (serving/metrics.py) start their differences afresh
        self.spec_totals = SpecCounters()
        self.steps = 0
        self.verify_widths = Counter()
        if self.verify_width is not None:
            self.verify_width.reset()
        if self.speculative_step is not None:
            self.speculative_step.ahead = None
            self.speculative_step.ahead_queued = self.speculative_step.ahead_used = 0
            self.speculative_step.ahead_widened = 0
        self.timer.reset()

    def stats(self) -> dict:
        """Engine-wide statistics since the engine started or `reset_stats()` (see stats.py
        for the definitions)."""
        return {
            "requests_finished": self.scheduler.finished_requests,
            "running": len(self.scheduler.active),
            "waiting": len(self.scheduler.waiting),
            "spec": self.spec_totals.as_dict(),
            # speculative steps by the draft tokens each row verified (at most: fewer near max_tokens)
            "verify_widths": dict(sorted(self.verify_widths.items())),
            "fallbacks": dict(self.scheduler.fallbacks),
            "steps": self.steps,
            "draft_ahead": self.draft_ahead(),
            "phases": self.timer.as_dict(),
        }

    def draft_ahead(self) -> dict[str, int]:
        """Drafts queued behind a step's commit (speculative_step.DraftAhead), those the next
        step took (the others it drafted afresh: its rows had changed), and of those the ones
        whose head it ran again for a wider verify."""
        step = self.speculative_step
        if step is None:
            return {"queued": 0, "used": 0, "widened": 0}
        return {"queued": step.ahead_queued, "used": step.ahead_used, "widened": step.ahead_widened}
