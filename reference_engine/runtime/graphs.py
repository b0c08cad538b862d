"""CUDA graphs for the engine's fixed-shape work: the plain decode step, and the draft forward,
the verify forward and the commit of a speculative step, one graph per batch bucket (the
draft at the block size, the verify and the commit at each verify width the engine may
choose, verify_width.py); and prefill chunks, one graph per (rows, tokens) bucket. The commit graph
(commit strategy, the draft's new context) reads the verify graph's static buffers and
replays only right after that verify replayed; it is captured from the reference phase
methods of `SpeculativeStep`, and a step whose methods were replaced (a planted fault)
commits eagerly.

A step of the launch-bound engine is hundreds of small kernels; replaying them as one graph
removes the launch gaps. Each graph reads its inputs from static buffers (token ids,
positions, slots, valid lengths) and leaves its outputs in static buffers (logits, greedy
tokens, context features), which the step consumes before the next replay. A batch of b
rows runs in the smallest bucket >= b; the padding rows point at a spare slot that no request
owns (the state keeps one), so their writes land nowhere that matters. Shapes outside the
buckets (a last block shorter than B, more rows than the largest bucket) run eagerly.

Graphs are captured for kernel tables whose kernels take positions and lengths from device
tensors and read the cache in place (`Kernels.capturable`: the exact and the fast numerics on
CUDA; the PyTorch references bound attention by a host-side length). A replay gives the same
bits as the eager forward in the exact numerics: the same kernels on the same inputs (a gate
checks it).

Prefill chunks run as a batch of rows in a (rows, tokens) bucket: rows a batch bucket,
tokens the smallest token bucket >= the longest chunk (16, 32, 64, ... up to the engine's
prefill chunk), at most PREFILL_BATCH_TOKENS in all (one row takes any chunk). A row's tokens
after its chunk are padding (`valid`): the Gated DeltaNet and conv states skip them, the
logits are those of the chunk's last token, and their attention (and draft context) rows
land past the request's length, where the next tokens overwrite them before any query reads
them. A chunk whose bucket would reach past its slot's rows runs eagerly.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..kernels import Kernels
from ..models import CausalLM
from ..models.dflash import DFlashDraft, DraftState
from .forwards import DraftHidden, Logits, Proposals, StepInputs, Verified
from .state import TargetState
from .transfer import to_pinned
from .verify_width import timing_ids

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SMALLEST_PREFILL = 16  # tokens; prefill buckets double from here up to the prefill chunk
PREFILL_BATCH_TOKENS = 2048  # rows x tokens of a batched prefill bucket, at most


def packed_inputs(packed: torch.Tensor, rows: int, width: int) -> StepInputs:
    """A graph's static inputs as views of one buffer `packed` [2 x rows x width + 2 x rows]:
    ids [rows, width], positions [rows, width], slots [rows], valid [rows], in that order."""
    n = rows * width
    return StepInputs(
        ids=packed[:n].view(rows, width),
        positions=packed[n : 2 * n].view(rows, width),
        slots=packed[2 * n : 2 * n + rows],
        valid=packed[2 * n + rows :],
        packed=packed,
    )


def buckets_up_to(max_rows: int) -> tuple[int, ...]:
    """The buckets a batch of at most `max_rows` rows needs (the largest covers max_rows)."""
    out = [b for b in BUCKETS if b < max_rows]
    return (*out, max_rows) if max_rows not in out else tuple(out)


def token_buckets(chunk: int, room: int) -> tuple[int, ...]:
    """The prefill buckets of an engine whose prefill chunk is `chunk` tokens and whose
    slots hold `room` positions: 16, 32, 64, ... below `chunk`, then `chunk`; none > room."""
    out, tokens = [], SMALLEST_PREFILL
    while tokens < chunk:
        out.append(tokens)
        tokens *= 2
    out.append(chunk)
    return tuple(t for t in out if t <= room)


def padded_end(length: int, chunk: int, room: int) -> int:
    """The position after the last one a prompt of `length` tokens, prefilled alone in chunks
    of `chunk`, writes when its last chunk is padded to its token bucket (a captured prefill
    writes the padding's keys and values too); a chunk that no bucket within the room holds
    runs eagerly, unpadded."""
    full, rest = divmod(length, chunk)
    if not rest:
        return length
    start = full * chunk
    fits = [b for b in token_buckets(chunk, room) if rest <= b <= room - start]
    return start + (fits[0] if fits else rest)


def prefill_shapes(
    row_buckets: tuple[int, ...], token_buckets: tuple[int, ...], chunk: int
) -> list[tuple[int, int]]:
    """The (rows, tokens) prefill buckets: one row of any token bucket, more rows while they
    hold at most PREFILL_BATCH_TOKENS (or one chunk) in all."""
    budget = max(PREFILL_BATCH_TOKENS, chunk)
    return [
        (rows, tokens)
        for tokens in token_buckets
        for rows in row_buckets
        if rows == 1 or rows * tokens <= budget
    ]


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused around a capture: a collection that runs
    inside one (any allocation of the capture's Python work can start it) frees whatever
    garbage is due, an earlier engine's CUDA graphs among it, and destroying a graph while a
    stream captures is not permitted: the capture is invalidated ("operation failed due to a
    previous error during capture", with CUDAGraph reset warnings)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class SharedLogits:
    """Logits buffers shared by the graphs of one bucket whose replays never overlap in use
    (the verify widths: a step replays one and reads its logits before the next verify): a
    flat [rows x capacity, vocab] buffer per bucket, of which a block of W + 1 tokens takes
    the first rows x (W + 1) rows. A graph copies its logits in (one pass over them, about
    0.05 ms at 64 x 6 rows of a 152K vocabulary), and its own logits are then a temporary
    that the capture frees, for the next graph of the pool to reuse. The buffer is made at
    the first (widest) graph's warm-up run, outside any capture."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # block tokens of the widest graph
        self.buffers: dict[int, torch.Tensor] = {}  # rows -> [rows x capacity, vocab]

    def hold(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [rows, T, vocab] copied into the bucket's buffer; returns the copy's view."""
        rows, tokens, vocab = logits.shape
        if tokens > self.capacity:
            raise ValueError(f"a block of {tokens} tokens in logits buffers of {self.capacity}")
        buffer = self.buffers.get(rows)
        if buffer is None or buffer.shape[1] != vocab or buffer.dtype != logits.dtype:
            buffer = torch.empty((rows * self.capacity, vocab), dtype=logits.dtype, device=logits.device)
            self.buffers[rows] = buffer
        view = buffer[: rows * tokens].view(rows, tokens, vocab)
        view.copy_(logits)
        return view


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: StepInputs  # static input buffers
    # static output buffers (None: the commit; the accept's table a tensor)
    outputs: Logits | Proposals | Verified | torch.Tensor | None


class EngineGraphs:
    """Captured decode, draft and verify forwards of one engine."""

    def __init__(
        self,
        target: CausalLM,
        draft: DFlashDraft | None,
        state: TargetState,
        draft_state: DraftState | None,
        ops: Kernels,
        max_rows: int,
        pad_slot: int,
        block_size: int,
        capture_layers: tuple[int, ...],
        raw_last_layer: bool,
        record: str | None,
        prefill_chunk: int,
        verify_widths: tuple[int, ...] = (),
    ) -> None:
        """`verify_widths`: the draft tokens a verify may check (B-1 when empty)."""
        self.target, self.draft, self.state, self.draft_state = target, draft, state, draft_state
        self.ops, self.pad_slot = ops, pad_slot
        self.block_size, self.capture_layers, self.record = block_size, capture_layers, record
        self.raw_last_layer = raw_last_layer
        self.buckets = buckets_up_to(max_rows)
        self.prefill_buckets = token_buckets(prefill_chunk, state.max_len)
        self.prefill_shapes = prefill_shapes(self.buckets, self.prefill_buckets, prefill_chunk)
        self.verify_widths = verify_widths or (block_size - 1,)
        self.device = state.device
        self.pool = torch.cuda.graph_pool_handle()
        # each by (bucket, block tokens): decode 1, draft B, verify and commit W + 1
        self.decode_graphs: dict[tuple[int, int], _Graph] = {}
        self.draft_graphs: dict[tuple[int, int], _Graph] = {}  # the draft's layers over the block
        # the draft's LM head (and a DFlash2 selector) over the hidden states the bucket's
        # draft graph left, by (bucket, W): the proposals of draft slots 1..W, each verify
        # width's own (a verify of W proposals needs no other)
        self.draft_head_graphs: dict[tuple[int, int], _Graph] = {}
        self.drafted: int | None = None  # the bucket of the last draft replayed (None: eager)
        self.verify_graphs: dict[tuple[int, int], _Graph] = {}
        # the commit of a speculative step: it reads the verify graph's static inputs and
        # outputs, so it replays only after the verify of the same key replayed
        self.commit_graphs: dict[tuple[int, int], _Graph] = {}
        # the accept of a speculative step (greedy rows): it reads the verify graph's static
        # inputs and outputs and writes the commit graph's `processed`, so it replays between
        # the two (SpeculativeStep.accept_replayed)
        self.accept_graphs: dict[tuple[int, int], _Graph] = {}
        # the inputs of the next step's draft, queued ahead (SpeculativeStep.ahead_body), by the
        # accept's key: they read the accept's table, the verify's static inputs and
        # `remaining` (each row's tokens left before the step), and write the draft graph's
        # static inputs, so they replay only right after that accept replayed
        self.ahead_graphs: dict[tuple[int, int], _Graph] = {}
        self.remaining: torch.Tensor | None = None  # [largest bucket]
        self.accepted: tuple[int, int] | None = None  # the key of this step's replayed accept
        self.prefill_graphs: dict[tuple[int, int], _Graph] = {}  # by (rows, tokens)
        # one logits buffer per bucket that every verify width's graph writes (the first
        # rows x (W + 1) rows of it, SharedLogits): a step replays one verify, so the widths
        # need not each keep their own [rows, W + 1, vocab] (Qwen3-8B at 64 rows: 0.3 GiB for
        # a block of 16 alone)
        self.verify_logits = SharedLogits(max(self.verify_widths) + 1)
        self.draft_logits = SharedLogits(block_size)  # the draft heads' likewise
        self.verified: tuple[int, int] | None = None  # the key of this step's replayed verify
        self._paddings: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # by (rows, width)

    # ------------------------------------------------------------------ capture
    def capture(self, progress: bool = True) -> None:
        """Capture every bucket, largest first (one memory pool serves them all); with
        `progress`, one line on stderr when done."""
        kinds = ["decode"] + (["draft", "verify"] if self.draft is not None else [])
        start = time.perf_counter()
        for shape in sorted(self.prefill_shapes, key=lambda s: s[0] * s[1], reverse=True):
            self.prefill_graphs[shape] = self._capture_prefill(*shape)
        for b in sorted(self.buckets, reverse=True):
            self.decode_graphs[b, 1] = self._capture(b, 1, self._decode_body)
            if self.draft is not None:
                body = self._capture(b, self.block_size, self._draft_body)
                self.draft_graphs[b, self.block_size] = body
                for w in sorted((w for w in self.verify_widths if w > 0), reverse=True):
                    self.draft_head_graphs[b, w] = self._capture(
                        b, self.block_size, self._draft_head_body(body.outputs.hidden, w), inputs=body.inputs
                    )
                for w in sorted(self.verify_widths, reverse=True):
                    self.verify_graphs[b, w + 1] = self._capture(b, w + 1, self._verify_body)
        if progress:
            widths = f", verify widths {', '.join(map(str, self.verify_widths))}" if self.draft else ""
            print(
                f"captured CUDA graphs ({', '.join(kinds)}) for batch sizes "
                f"{', '.join(map(str, self.buckets))}{widths} and prefill for "
                f"{', '.join(map(str, self.prefill_buckets))} tokens a row "
                f"in {time.perf_counter() - start:.1f} s",
                file=sys.stderr,
                flush=True,
            )

    def capture_commit(
        self,
        body: Callable[[StepInputs, Verified], None],
        accept: Callable[[StepInputs, Verified], torch.Tensor] | None = None,
    ) -> None:
        """Capture `body` per bucket, after the verify graphs: it gets the verify graph's
        static inputs, with its own `processed` [rows] (block tokens each row keeps), and
        outputs. `accept`, when given, is captured beside it on the same inputs: it returns
        the step's table (what the host reads) and writes `processed` itself."""
        start = time.perf_counter()
        for (b, width), verify in sorted(self.verify_graphs.items(), reverse=True):
            processed = torch.ones((b,), dtype=torch.int64, device=self.device)
            inputs = StepInputs(
                verify.inputs.ids,
                verify.inputs.positions,
                verify.inputs.slots,
                verify.inputs.valid,
                processed=processed,
            )
            if accept is not None:
                # the table in a buffer of its own, outside the graphs' pool: a buffer the
                # capture allocated could be memory an earlier capture's graph (the commit,
                # which replays after it) uses for its temporaries
                table = torch.zeros((b, 2 + width), dtype=torch.int64, device=self.device)
                self.accept_graphs[b, width] = self._capture(
                    b,
                    width,
                    lambda x, out=verify.outputs, into=table: into.copy_(accept(x, out)),
                    inputs=inputs,
                )
            self.commit_graphs[b, width] = self._capture(
                b, width, lambda x, out=verify.outputs: body(x, out), inputs=inputs
            )
        print(
            f"captured CUDA graphs (commit) in {time.perf_counter() - start:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    def capture_ahead(self, body: Callable[[StepInputs, torch.Tensor, torch.Tensor], StepInputs]) -> None:
        """Capture `body` per accept graph: from the verify's static inputs, the accept's table
        and `remaining`, the next draft's inputs, written into the bucket's draft graph's static
        inputs, with the bucket's padding rows (those on the spare slot) put back to the
        padding's inputs (`_padding`)."""
        if self.draft is None or not self.accept_graphs:
            return
        # outside the graphs' pool, as the accept's table: the host writes it before a replay
        self.remaining = torch.ones((max(self.buckets),), dtype=torch.int64, device=self.device)
        B = self.block_size
        for (b, width), accept in sorted(self.accept_graphs.items(), reverse=True):
            draft = self.draft_graphs[b, B].inputs

            def write(x, table=accept.outputs, remaining=self.remaining[:b], into=draft) -> None:
                nxt = body(x, table, remaining)
                pad = x.slots == self.pad_slot
                into.ids.copy_(nxt.ids.masked_fill(pad[:, None], 0))
                arange = torch.arange(B, device=self.device).expand(x.slots.shape[0], B)
                into.positions.copy_(torch.where(pad[:, None], arange, nxt.positions))
                into.slots.copy_(nxt.slots)
                into.valid.copy_(nxt.valid.masked_fill(pad, 1))

            self.ahead_graphs[b, width] = self._capture(b, width, write, inputs=accept.inputs)

    def propose_ahead(self, remaining: torch.Tensor, width: int) -> tuple[StepInputs, Proposals] | None:
        """Right after a replayed accept and its commit: replay the inputs of the next draft
        (`capture_ahead`), the bucket's draft and its head for draft slots 1..`width`. Returns
        (the draft's inputs for the `rows` rows: views of its graph's static inputs, blocks
        [rows, B], and the proposals), or None when this step's accept did not replay."""
        key = self.accepted
        g = self.ahead_graphs.get(key) if key is not None else None
        if g is None:
            return None
        rows = remaining.shape[0]
        self.remaining[:rows].copy_(remaining)
        g.graph.replay()
        draft = self.draft_graphs[key[0], self.block_size]
        draft.graph.replay()
        self.drafted = key[0]
        x = draft.inputs
        inputs = StepInputs(x.ids[:rows], x.positions[:rows], x.slots[:rows], x.valid[:rows])
        return inputs, self._head(rows, width, draft.outputs.head(rows), inputs.ids[:, 0])

    def static_inputs(self, rows: int, width: int) -> StepInputs:
        """The input buffers of a decode, draft or verify graph of `rows` x `width` tokens:
        views of one buffer (`packed_inputs`), which a replay writes in one operation."""
        packed = torch.empty(2 * rows * width + 2 * rows, dtype=torch.int64, device=self.device)
        x = packed_inputs(packed, rows, width)
        x.ids.zero_()
        x.positions.copy_(torch.arange(width, device=self.device)[None].repeat(rows, 1))
        x.slots.fill_(self.pad_slot)
        x.valid.fill_(width)
        return x

    def _capture(self, rows: int, width: int, body, inputs: StepInputs | None = None) -> _Graph:
        """`body` run twice outside the capture (compilation, autotuning), then captured."""
        inputs = inputs or self.static_inputs(rows, width)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):  # compile and autotune outside the capture
                body(inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's unsafe calls (a sync, a host allocation) break the
        # capture; under the default, one from any other thread of the process (a client's
        # pinned copy, a library's helper thread) invalidates it mid-way
        with (
            collector_paused(),
            torch.no_grad(),
            torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"),
        ):
            outputs = body(inputs)
        return _Graph(graph, inputs, outputs)

    def _capture_prefill(self, rows: int, tokens: int) -> _Graph:
        return self._capture(rows, tokens, self._prefill_body, inputs=self._prefill_inputs(rows, tokens))

    def _prefill_inputs(self, rows: int, tokens: int) -> StepInputs:
        """One buffer holds every input (a replay's inputs are one host-to-device copy)."""
        return self.static_inputs(rows, tokens)

    def _prefill_body(self, x: StepInputs) -> Logits:
        # kv_len: the capturable kernels bound each query by its position and ignore it; the
        # references read every row, masked by position
        out = self.target(
            x.ids,
            x.positions,
            x.slots,
            self.state,
            self.state.max_len,
            capture_layers=self.capture_layers,
            raw_last_layer=self.raw_last_layer,
            last_only=True,
            valid_len=x.valid,
            ops=self.ops,
        )
        if self.draft is not None:  # the draft's context (unused if the request decodes plainly)
            self.draft.append_context(out.features, x.positions, x.slots, self.draft_state, self.ops)
        return Logits(out.logits[:, -1])

    def _decode_body(self, x: StepInputs) -> Logits:
        out = self.target(x.ids, x.positions, x.slots, self.state, 1, ops=self.ops)
        logits = out.logits[:, -1]
        return Logits(logits, self.ops.greedy(logits))

    def _draft_body(self, x: StepInputs) -> DraftHidden:
        dcfg = self.draft.config
        embeds = self.target.embed(x.ids) * dcfg.input_embedding_scale
        return DraftHidden(
            self.draft(embeds, x.positions, x.slots, self.draft_state, 1, valid_len=x.valid, ops=self.ops)
        )

    def _draft_head_body(self, hidden: torch.Tensor, width: int) -> Callable[[StepInputs], Proposals]:
        """The head of draft slots 1..`width` over `hidden` [rows, B, hidden] (a draft graph's
        static output), its logits in the bucket's shared buffer."""

        def body(x: StepInputs) -> Proposals:
            head = self.target.lm_head_weight
            hold = self.draft_logits.hold
            return Proposals(
                *self.draft.proposals(hidden, head, self.ops, x.ids[:, 0], width=width, hold=hold)
            )

        return body

    def _verify_body(self, x: StepInputs) -> Verified:
        out = self.target(
            x.ids,
            x.positions,
            x.slots,
            self.state,
            1,
            capture_layers=self.capture_layers,
            raw_last_layer=self.raw_last_layer,
            valid_len=x.valid,
            record=self.record,
            ops=self.ops,
        )
        return Verified(self.verify_logits.hold(out.logits), out.features, self.ops.greedy(out.logits))

    def step_seconds(self, repeats: int = 3) -> dict[tuple[int, int], float]:
        """Device seconds of a speculative step's replayed draft, verify and commit, by (bucket,
        verify width): the median of `repeats` timed replays after one untimed, on the static
        inputs of the capture (every row on the spare slot), so before any request runs, with
        the draft's and the verify's token ids `timing_ids` (a different token at every
        position: a mixture of experts routes them as it routes text, verify_width.py) and
        put back to zeros after. A verify of the anchor alone (width 0, a plain step) runs no
        draft."""
        out = {}
        vocab = self.target.config.vocab_size
        for (b, width), verify in sorted(self.verify_graphs.items()):
            fed = (
                [self.draft_graphs[b, self.block_size], self.draft_head_graphs[b, width - 1]]
                if width > 1
                else []
            )
            fed.append(verify)
            for g in fed:
                g.inputs.ids.copy_(timing_ids(*g.inputs.ids.shape, vocab, self.device))
            after = (self.accept_graphs, self.commit_graphs)
            graphs = fed + [kind[b, width] for kind in after if (b, width) in kind]
            times = []
            for r in range(repeats + 1):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for g in graphs:
                    g.graph.replay()
                end.record()
                end.synchronize()
                if r:
                    times.append(start.elapsed_time(end) / 1000.0)
            out[b, width - 1] = statistics.median(times)
            for g in fed:
                g.inputs.ids.zero_()
        return out

    # ------------------------------------------------------------------ replay
    def _bucket(self, rows: int) -> int | None:
        return next((b for b in sorted(self.buckets) if b >= rows), None)

    def _replay(
        self,
        graphs: dict[tuple[int, int], _Graph],
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        valid: torch.Tensor | None,
    ):
        rows, width = ids.shape
        bucket = self._bucket(rows)
        g = graphs.get((bucket, width))
        if g is None:
            return None
        # one operation writes the inputs into the graph's packed buffer, with the padding
        # rows (the spare slot, from position 0) after each input's rows; a decode's valid
        # (the buffer's end) is left as captured
        pieces = [ids, positions, slots] + ([] if valid is None else [valid])
        padding = self._padding(bucket - rows, width) if rows < bucket else None
        flat = []
        for k, piece in enumerate(pieces):
            flat.append(piece.reshape(-1))
            if padding is not None:
                flat.append(padding[k])
        packed = g.inputs.packed
        out = packed[: packed.shape[0] - (bucket if valid is None else 0)]
        if sum(t.numel() for t in flat) != out.numel():  # cat would resize its output, not refuse
            raise ValueError(
                f"inputs of {[tuple(t.shape) for t in pieces]} for a graph of {bucket} x {width}"
            )
        torch.cat(flat, out=out)
        g.graph.replay()
        return g.outputs.head(rows)

    def _padding(self, rows: int, width: int) -> tuple[torch.Tensor, ...]:
        """What `rows` padding rows of `width` tokens hold, flat: ids 0, positions from 0, the
        spare slot, valid 1 (made once per shape)."""
        key = (rows, width)
        padding = self._paddings.get(key)
        if padding is None:
            padding = self._paddings[key] = (
                torch.zeros(rows * width, dtype=torch.int64, device=self.device),
                torch.arange(width, device=self.device).repeat(rows),
                torch.full((rows,), self.pad_slot, dtype=torch.int64, device=self.device),
                torch.ones(rows, dtype=torch.int64, device=self.device),
            )
        return padding

    def token_bucket(self, tokens: int) -> int | None:
        """The token bucket a chunk of `tokens` is padded to (None: longer than every bucket)."""
        return next((t for t in sorted(self.prefill_buckets) if t >= tokens), None)

    def prefill_fits(self, rows: int, longest: int) -> bool:
        """Whether a bucket holds `rows` chunks of at most `longest` tokens."""
        return any(r >= rows and t >= longest for r, t in self.prefill_graphs)

    def prefill(self, chunks: list[tuple[list[int], int, int]]) -> Logits | None:
        """Prefill chunks (ids, start position, slot), one per row, in the smallest bucket
        that holds them, each padded to the bucket's tokens: the logits [rows, vocab] of
        each chunk's last token (a view of a static buffer), or None when no bucket fits
        (the chunks run eagerly)."""
        n, longest = len(chunks), max(len(ids) for ids, _, _ in chunks)
        room = self.state.max_len - max(start for _, start, _ in chunks)
        shape = next(
            (
                s
                for s in sorted(self.prefill_graphs, key=lambda s: (s[1], s[0]))
                if s[0] >= n and longest <= s[1] <= room
            ),
            None,
        )
        if shape is None:
            return None
        rows, tokens = shape
        g = self.prefill_graphs[shape]
        pad = rows - n
        host = [t for ids, _, _ in chunks for t in (*ids, *[0] * (tokens - len(ids)))]
        host += [0] * (pad * tokens)
        host += [p for _, start, _ in chunks for p in range(start, start + tokens)]
        host += [*range(tokens)] * pad
        host += [slot for _, _, slot in chunks] + [self.pad_slot] * pad
        host += [len(ids) for ids, _, _ in chunks] + [1] * pad
        g.inputs.packed.copy_(to_pinned(host), non_blocking=True)
        g.graph.replay()
        return g.outputs.head(n)

    def decode(self, ids, positions, slots) -> Logits | None:
        """ids, positions: [b, 1]; slots: [b]. Returns logits [b, vocab] and greedy tokens
        [b] (views of static buffers), or None when no graph fits."""
        return self._replay(self.decode_graphs, ids, positions, slots, None)

    def propose(self, ids, positions, slots, valid, width: int) -> Proposals | None:
        """The draft forward over full blocks [b, B] and its head for draft slots 1..`width`
        (a captured verify width): draft logits [b, width, vocab] and greedy proposals
        [b, width], or None (nothing replayed)."""
        hidden = self._replay(self.draft_graphs, ids, positions, slots, valid)
        self.drafted = None if hidden is None else self._bucket(ids.shape[0])
        if hidden is None:
            return None
        return self._head(ids.shape[0], width, hidden, ids[:, 0])

    def _head(self, rows: int, width: int, hidden: DraftHidden, anchors: torch.Tensor) -> Proposals:
        """The head over the last replayed draft: its graph at `width`, or when none was
        captured at that width, eagerly on the layers' output."""
        out = self.draft_head(rows, width)
        if out is None:
            head = self.target.lm_head_weight
            out = Proposals(*self.draft.proposals(hidden.hidden, head, self.ops, anchors, width=width))
        return out

    def draft_head(self, rows: int, width: int) -> Proposals | None:
        """The head of draft slots 1..`width` over what the last replayed draft left (its
        first `rows` rows), or None when the last draft ran eagerly or `width` was not
        captured."""
        g = self.draft_head_graphs.get((self.drafted, width)) if self.drafted is not None else None
        if g is None:
            return None
        g.graph.replay()
        return g.outputs.head(rows)

    def verify(self, ids, positions, slots, valid) -> Verified | None:
        """The verify forward over blocks [b, W + 1] of a captured verify width: logits
        [b, W + 1, vocab], features, greedy target tokens [b, W + 1], or None."""
        out = self._replay(self.verify_graphs, ids, positions, slots, valid)
        self.verified = None if out is None else (self._bucket(ids.shape[0]), ids.shape[1])
        self.accepted = None
        return out

    def accept(self, rows: int) -> torch.Tensor | None:
        """Replay the captured accept of this step's verify: the step's table [rows, 3 + W]
        (a view of a static buffer, valid until the next replay of the same key), its
        `processed` written into the commit's input; None when the verify ran eagerly or no
        accept was captured (the caller accepts eagerly)."""
        g = self.accept_graphs.get(self.verified) if self.verified is not None else None
        if g is None:
            return None
        g.graph.replay()
        self.accepted = self.verified
        return g.outputs[:rows]

    def commit(self, processed: torch.Tensor | None, replay: bool = True) -> bool:
        """Replay the commit of this step's verify (its bucket, rows and outputs), with
        `processed` [b] (None: the captured accept wrote it); False when the verify ran
        eagerly, no commit was captured, or the caller commits eagerly (`replay` False).
        Either way the step's verify is used up."""
        key, self.verified = self.verified, None
        if not replay or key is None or key not in self.commit_graphs:
            return False
        g = self.commit_graphs[key]
        if processed is not None:
            rows = processed.shape[0]
            g.inputs.processed[:rows].copy_(processed)
            g.inputs.processed[rows:].fill_(1)  # padding rows keep their anchor, on the spare slot
        g.graph.replay()
        return True
