"""The model runner: every forward of the engine's steps (prefill, decode, draft, verify,
commit), each run from a captured CUDA graph when one fits and eagerly otherwise. This is the
one place that makes that choice; callers get the same typed outputs (forwards.py) either way.

Graphs exist on CUDA for the kernel tables that can be captured (graphs.py says which and
why), unless the engine was told to run eagerly (`graphs_possible`). A shape no graph
holds (a last block shorter than B, more rows than the largest bucket, a chunk past its
slot's room) runs eagerly, and gives the same bits in the exact numerics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels import Kernels
from ..models import CausalLM
from ..models.dflash import DFlashDraft, DraftState
from ..models.layers import Phase, untimed
from .commit import verify_record
from .forwards import Logits, Proposals, StepInputs, Verified
from .graphs import EngineGraphs
from .state import TargetState
from .transfer import to_device


def graphs_possible(device: torch.device, ops: Kernels, enforce_eager: bool) -> bool:
    """Whether the engine's forwards can be captured as CUDA graphs: on CUDA, for kernels that
    take positions, lengths and a mixture of experts' routing from device tensors (the
    references' expert loop asks the host which experts have tokens), unless told to run
    eagerly."""
    return device.type == "cuda" and ops.capturable and not enforce_eager


class ModelRunner:
    def __init__(
        self,
        target: CausalLM,
        draft: DFlashDraft | None,
        state: TargetState,
        draft_state: DraftState | None,
        ops: Kernels,
        commit_strategy: str,
        max_rows: int,
        block_size: int,
        prefill_chunk: int,
        use_graphs: bool,
        verify_widths: tuple[int, ...] = (),
    ) -> None:
        """`verify_widths`: the draft tokens a verify may check, each captured (B-1 when empty)."""
        self.target, self.draft = target, draft
        self.state, self.draft_state = state, draft_state
        self.ops = ops
        self.device = state.device
        self.max_rows, self.block_size = max_rows, block_size
        self.capture_layers = draft.config.target_layer_ids if draft is not None else ()
        self.raw_last_layer = draft is not None and draft.config.raw_last_layer
        # what the verify keeps for the commit strategy (per-token states, inputs)
        self.record = verify_record(commit_strategy, target) if draft is not None else None
        self.graphs: EngineGraphs | None = None
        if use_graphs:
            # graphs pad a batch to its bucket with rows on the state's spare slot, max_rows
            self.graphs = EngineGraphs(
                target,
                draft,
                state,
                draft_state,
                ops,
                max_rows,
                pad_slot=max_rows,
                block_size=block_size,
                capture_layers=self.capture_layers,
                raw_last_layer=self.raw_last_layer,
                record=self.record,
                prefill_chunk=prefill_chunk,
                verify_widths=verify_widths,
            )
            self.graphs.capture()

    @property
    def captured(self) -> bool:
        """Whether forwards replay CUDA graphs where a shape fits."""
        return self.graphs is not None

    # ------------------------------------------------------------------ prefill
    def prefill_groups(self, lengths: list[int]) -> list[list[int]]:
        """First chunks of these lengths, in order, grouped so that each group fits one
        captured prefill (indices into `lengths`); each alone without graphs. With a pooled
        KV cache a group's chunks share one token bucket: a row padded past its own bucket
        would write past the cells its request holds (kv_pool.py)."""
        groups: list[list[int]] = []
        pooled = self.state.pool is not None
        for i, n in enumerate(lengths):
            group = groups[-1] if groups else None
            longest = max([n, *(lengths[j] for j in group or [])])
            if (
                group is not None
                and self.graphs is not None
                and self.graphs.prefill_fits(len(group) + 1, longest)
                and (not pooled or self.graphs.token_bucket(n) == self.graphs.token_bucket(lengths[group[0]]))
            ):
                group.append(i)
            else:
                groups.append([i])
        return groups

    def prefill_batch(self, chunks: list[tuple[list[int], int, int]]) -> torch.Tensor | None:
        """First chunks (ids, start, slot) of several requests in one captured prefill: the
        logits of each chunk's last token [rows, vocab], or None when no graph holds them."""
        out = self.graphs.prefill(chunks) if self.graphs is not None else None
        return None if out is None else out.logits

    def prefill(self, ids: list[int], start: int, slot: int, speculative: bool) -> torch.Tensor:
        """One prompt chunk of one request (and the draft's context from it, for a speculative
        request): the logits of its last token [1, vocab]."""
        replayed = self.graphs.prefill([(ids, start, slot)]) if self.graphs is not None else None
        if replayed is not None:
            return replayed.logits
        end = start + len(ids)
        slots = to_device([slot], self.device)
        positions = torch.arange(start, end, device=self.device)[None]
        out = self.target(
            to_device([ids], self.device),
            positions,
            slots,
            self.state,
            kv_len=end,
            capture_layers=self.capture_layers if speculative else (),
            raw_last_layer=self.raw_last_layer,
            last_only=True,
            ops=self.ops,
        )
        if speculative:
            self.draft.append_context(out.features, positions, slots, self.draft_state, self.ops)
        return out.logits[:, -1]

    # ------------------------------------------------------------------ decode
    def decode(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv_len: int) -> Logits:
        """One plain step: ids, positions [b, 1], slots [b]; logits [b, vocab] (and the greedy
        tokens [b] when a graph took them)."""
        replayed = self.graphs.decode(ids, positions, slots) if self.graphs is not None else None
        if replayed is not None:
            return replayed
        out = self.target(ids, positions, slots, self.state, kv_len=kv_len, ops=self.ops)
        return Logits(out.logits[:, -1])

    # ------------------------------------------------------------------ speculative step
    def propose(
        self,
        block: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        valid: torch.Tensor,
        kv_len: int,
        phase: Phase = untimed,
        width: int | None = None,
    ) -> Proposals:
        """The draft's forward over every row's block [b, N + 1] (anchor and mask tokens):
        its logits and greedy proposals for draft slots 1..`width` (all N when None; the
        slots after them change none of theirs, DFlashDraft.proposals). `phase` times a
        DFlash2 draft's convolution and selector in an eager forward; a replayed one is one
        graph, whose parts the host cannot time."""
        N = block.shape[1] - 1
        width = N if width is None else width
        replayed = (
            self.graphs.propose(block, positions, slots, valid, width) if self.graphs is not None else None
        )
        if replayed is not None:
            return replayed
        if self.graphs is not None:
            self.graphs.drafted = None  # the draft graphs' buffers do not hold this block
        embeds = self.target.embed(block) * self.draft.config.input_embedding_scale
        hidden = self.draft(
            embeds, positions, slots, self.draft_state, kv_len, valid_len=valid, ops=self.ops, phase=phase
        )
        head = self.target.lm_head_weight
        return Proposals(*self.draft.proposals(hidden, head, self.ops, block[:, 0], phase=phase, width=width))

    def repropose(self, rows: int, width: int) -> Proposals | None:
        """The proposals of draft slots 1..`width` of the blocks the last draft forward ran
        (its first `rows` rows), from the hidden states it left in its graph, or None when it
        ran eagerly (nothing kept)."""
        return self.graphs.draft_head(rows, width) if self.graphs is not None else None

    def verify(
        self,
        block: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        valid: torch.Tensor | None,  # real tokens a row; None: every token of every row
        kv_len: int,
        record: bool = True,
    ) -> Verified:
        """The target's forward over every block [b, N + 1], keeping the draft's context
        features and what the commit strategy needs (an eager one without `record`: nothing,
        the state moving past the whole block as in decode)."""
        replayed = self.graphs.verify(block, positions, slots, valid) if self.graphs is not None else None
        if replayed is not None:
            return replayed
        out = self.target(
            block,
            positions,
            slots,
            self.state,
            kv_len,
            capture_layers=self.capture_layers,
            raw_last_layer=self.raw_last_layer,
            valid_len=valid,
            record=self.record if record else None,
            ops=self.ops,
        )
        return Verified(out.logits, out.features)

    def step_seconds(self) -> dict[tuple[int, int], float] | None:
        """Measured seconds of a speculative step by (rows, verify width), from the captured
        graphs; None without them (SpeculativeStep.seconds times eager steps)."""
        if self.graphs is not None and self.graphs.verify_graphs:
            return self.graphs.step_seconds()
        return None

    def capture_commit(
        self,
        body: Callable[[StepInputs, Verified], None],
        accept: Callable[[StepInputs, Verified], torch.Tensor] | None = None,
    ) -> None:
        """Capture the commit `body` (and the greedy `accept` that feeds it) per batch bucket,
        reading the verify graphs' buffers."""
        if self.graphs is not None:
            self.graphs.capture_commit(body, accept)

    def capture_ahead(self, body: Callable[[StepInputs, torch.Tensor, torch.Tensor], StepInputs]) -> None:
        """Capture `body`, the inputs of a draft queued ahead, beside each captured accept
        (EngineGraphs.capture_ahead)."""
        if self.graphs is not None:
            self.graphs.capture_ahead(body)

    def propose_ahead(self, remaining: torch.Tensor, width: int) -> tuple[StepInputs, Proposals] | None:
        """The next step's draft from this step's replayed accept, its inputs written by a
        graph: (its inputs, blocks [b, B] among them, its proposals for draft slots
        1..`width`); None when this step's accept did not replay (the caller queues it from
        eager operations)."""
        return self.graphs.propose_ahead(remaining, width) if self.graphs is not None else None

    def accept(self, rows: int) -> torch.Tensor | None:
        """Replay the captured accept of this step's verify: the step's table [rows, 3 + W];
        None when the verify ran eagerly or none was captured (the caller accepts eagerly)."""
        return self.graphs.accept(rows) if self.graphs is not None else None

    def commit(self, processed: torch.Tensor | None, replay: bool) -> bool:
        """Replay the captured commit of this step's verify with `processed` [b] (block tokens
        each row keeps; None: the captured accept wrote them); False when the verify ran
        eagerly or `replay` is False, and the caller commits eagerly. Either way the step's
        verify is used up."""
        return self.graphs is not None and self.graphs.commit(processed, replay=replay)
