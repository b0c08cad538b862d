"""One batched DFlash step for the engine's speculative requests: draft -> verify -> accept
-> commit, read top to bottom in `SpeculativeStep.__call__`.

Vocabulary (docs/design.md): a row's block holds the anchor (its last committed token, not yet
run through the target) followed by B-1 draft slots. The draft proposes a token for each
slot in one forward; the target verifies the whole block in one forward; `accepted` (a) is
the longest prefix of proposals equal to the target's own choices (greedy) or kept by
speculative sampling; the `bonus` is the target's token after that prefix. A step commits
a + 1 tokens per row (its acceptance length, bonus included); the target then holds the
anchor and the a accepted tokens, and the bonus is the next anchor.

Rows are requests at different positions with different remaining budgets: row i drafts
n_i = min(B - 1, remaining_i) tokens; shorter rows are padded to the longest, and padding
never counts: the draft's block attention stops at each row's last real token, the verify
forward leaves the Gated DeltaNet state alone on padded tokens (`valid_len`), and a row
never accepts past n_i. No value reaches the host until the one transfer after accept.

Each phase is a method so that a test can replace one of them (gates/faults.py plants
deliberate faults that way); the engine sees only `__call__`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..kernels import Kernels
from ..models import CausalLM
from ..models.dflash import DFlashDraft, DraftState
from .commit import commit_hybrid, needs_snapshot
from .forwards import Proposals, StepInputs, Verified
from .model_runner import ModelRunner
from .request import SamplingParams
from .sampling import accept_greedy, accept_sampled, probabilities, sample
from .sequence import Sequence
from .state import TargetState
from .stats import PhaseTimer
from .transfer import HostCopy, HostReader, place_tokens, to_device
from .verify_width import timing_ids
from .walk import sample_walk


class StepCommit(NamedTuple):
    """What one step committed for one row (before the request's stop and max_tokens cuts); a
    named tuple, made for every row of every step."""

    proposed: int  # n_i: draft tokens in the row's block
    accepted: int  # a
    drafted: list[int]  # the n_i proposed tokens
    tokens: list[int]  # the a accepted draft tokens followed by the bonus


@dataclass
class Rows:
    """The rows of one step and where their blocks sit."""

    seqs: list[Sequence]
    slot_ids: list[int]
    slots: torch.Tensor  # [b]
    starts: list[int]  # position of each row's anchor
    n: list[int]  # draft tokens per row (B - 1, fewer near max_tokens)
    n_t: torch.Tensor  # [b] the same on the device
    anchors: torch.Tensor  # [b] each row's last committed token, on the device
    remaining_t: torch.Tensor  # [b] tokens each row may still produce, on the device
    positions: torch.Tensor  # [b, N + 1] anchor and draft slots, N = max(n)
    kv_len: int  # attention rows a forward of this step may read
    # the draft slots whose proposals the step takes (the verify's width when it checks fewer
    # than N: the slots after them change none of theirs); None: all N
    draft_width: int | None = None
    valid_t: torch.Tensor | None = None  # [b] n_t + 1, when copied with the rest (`valid`)

    @property
    def valid(self) -> torch.Tensor:
        """[b] the block tokens of each row that count: its anchor and its draft tokens."""
        return self.valid_t if self.valid_t is not None else self.n_t + 1


@dataclass
class DraftAhead:
    """The next step's draft, queued right behind a step's captured commit (before the host
    has read the step's results): the host's work between two steps then overlaps the
    draft's forward instead of leaving the device idle. Its inputs come from the device (each
    row's bonus token as the next anchor, at its start + processed tokens), so it is the very
    forward the next step would run for the rows that go on, each where this one left it:
    `rows_for` checks that on the host and picks those rows (the draft is batch-invariant, so
    a row's proposals do not depend on the others'), and the next step drafts afresh when a
    row of its own is not among them."""

    seqs: list[Sequence]
    block: torch.Tensor  # [b, N + 1] the bonus tokens, then mask tokens
    drafted: Proposals  # views of the draft graph's outputs, valid until its next replay
    width: int  # the draft slots its head ran for (the queuing step's; a wider step runs it again)
    starts: list[int] | None = None  # each row's next anchor position (set once read)
    n: list[int] | None = None  # each row's next draft tokens

    def rows_for(self, rows: Rows) -> list[int] | None:
        """The queued rows that are `rows`, in their order: each the same request, at the
        start and with the draft tokens the queued draft assumed; None when one is not (or
        the blocks differ in width)."""
        if self.starts is None or rows.positions.shape[1] != self.block.shape[1]:
            return None
        queued = {id(seq): i for i, seq in enumerate(self.seqs)}
        out = []
        for seq, start, n in zip(rows.seqs, rows.starts, rows.n):
            i = queued.get(id(seq))
            if i is None or self.seqs[i] is not seq or self.starts[i] != start or self.n[i] != n:
                return None
            out.append(i)
        return out


@dataclass
class DeferredContext:
    """The draft context a request's plain steps owe its draft: the verify's features of each
    anchor they committed, at consecutive positions from `first`. A plain step (verify width
    0, the CPU only) drafts nothing, so nothing reads the draft's context until the request
    drafts again; the features wait here and are appended in one batch before its next draft
    forward (`SpeculativeStep.flush_context`), instead of one small append a step (about 1 ms
    of host work a step at 16 rows on the demo pair). A request that ends before it drafts
    again never needs them, and they are dropped (`SpeculativeStep.drop_context`)."""

    seq: Sequence
    slot: int
    first: int  # position of the first feature
    features: list[torch.Tensor]  # [n * hidden] each, of positions first, first + 1, ...


class TimingProposals:
    """A placeholder request's proposals while the step is timed (SpeculativeStep.seconds):
    fixed tokens, compared with the target's choices as a draft's would be."""

    forced = False

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def scheduled(self, step: int, n: int) -> int:
        return 0

    def propose(self, step: int, generated: int, n: int) -> list[int]:
        return self.tokens[:n]


class SpeculativeStep:
    def __init__(
        self,
        target: CausalLM,
        draft: DFlashDraft,
        state: TargetState,
        draft_state: DraftState,
        block_size: int,
        commit_strategy: str,
        timer: PhaseTimer,
        runner: ModelRunner,
        draft_span: str = "block",
    ) -> None:
        self.target, self.draft = target, draft
        # "verify": a drafted step's draft runs the anchor and as many mask tokens as its verify
        # checks, not the whole block (EngineConfig.draft_span; eager forwards only)
        self.span_verify = draft_span == "verify"
        self.state, self.draft_state = state, draft_state
        self.block_size = block_size
        self.commit_strategy = commit_strategy
        self.timer = timer
        self.runner = runner  # the forwards, replayed from CUDA graphs where they fit
        self.ops: Kernels = runner.ops  # the kernels every forward and the argmax run with
        # every block padded to B tokens (padding never counts, see the module docstring), so
        # that a last, shorter block still replays the captured full-block graphs
        self.pad_blocks = runner.captured
        self.device = state.device
        # queue the next step's draft behind the captured commit (DraftAhead); on by default
        # with graphs, where it overlaps the host's work; eager, it would only run earlier
        self.draft_ahead = runner.captured
        self.ahead: DraftAhead | None = None
        self.ahead_queued = self.ahead_used = 0  # drafts queued ahead, and those a step took
        self.ahead_narrowed = 0  # of those, taken for some of their rows (others had ended)
        self.ahead_widened = 0  # of those, taken by a step wider than their head (run again)
        self.deferred: dict[int, DeferredContext] = {}  # id(seq) -> its plain steps' context
        self.reader = HostReader()  # the step's one transfer to the host

    def __call__(
        self, seqs: list[Sequence], width: int | None = None, same_rows_next: bool = False
    ) -> list[StepCommit]:
        """One step; the verify checks the first `width` proposals of each row (all of them
        when None; verify_width.py). `same_rows_next`: the caller expects the next step to
        run these rows again (no request waiting to join them), so the next step's draft may
        be queued now (DraftAhead)."""
        if width == 0 and all(s.params.greedy for s in seqs):
            return self.plain_step(seqs)
        rows = self.rows(seqs, width)
        if width == 0:  # a plain step (verify_width.py): the anchor alone, no draft forward
            self.ahead = None  # a draft queued for it goes unused
            rows = self.verified_rows(rows, 0)
            block, proposals, draft_probs = self.no_proposals(rows)
        else:
            with self.timer.phase("draft"):
                block, proposals, draft_probs = self.propose(rows)
        if width is not None and width < rows.positions.shape[1] - 1:
            rows = self.verified_rows(rows, width)
            W = rows.positions.shape[1] - 1
            block, proposals = block[:, : W + 1].contiguous(), proposals[:, :W]
            draft_probs = [None if q is None else q[: rows.n[i]] for i, q in enumerate(draft_probs)]
        plain = width == 0
        with self.timer.phase("verify"):
            out = self.verify(rows, block, record=not plain)
        with self.timer.phase("accept"):
            table, written = self.step_results(rows, proposals, draft_probs, out, plain)
            bonus, processed = table[:, 1], table[:, 2]
            # the one host transfer of the step, read once the captured commit is queued
            b = len(seqs)
            pending = self.reader.copy(table)
        ahead = self.draft_ahead and same_rows_next and not plain
        with self.timer.phase("commit"):
            replayed = self.commit_replayed(processed, written)
            if not (ahead and replayed):
                read = self.read_step(rows, block, out, processed, pending, replayed, plain)
        if ahead and replayed:  # queued behind the commit, it runs while the host reads the step
            with self.timer.phase("draft", count=False):
                self.launch_ahead_replayed(rows, bonus, processed, written)
            with self.timer.phase("commit", count=False):
                read = self.read_step(rows, block, out, processed, pending, replayed, plain)
        acc_list, bonus_list, kept, drafted = read
        if ahead:
            self.expect_ahead(rows, kept, bonus_list, replayed)
        return [
            StepCommit(rows.n[i], acc_list[i], drafted[i], drafted[i][: acc_list[i]] + [bonus_list[i]])
            for i in range(b)
        ]

    def plain_step(self, seqs: list[Sequence]) -> list[StepCommit]:
        """A plain step (verify width 0, the CPU only) of greedy rows: the verify of each
        row's anchor alone, whose argmax is the token plain decode gives, and the anchor's
        context features kept for the draft (DeferredContext). Nothing is drafted, so there
        is nothing to accept or to commit beyond the lengths: the general step's accept,
        commit and read (about 0.4 ms of host work at 16 rows on the demo pair) are left
        out. Sampled rows take the general step (the bonus is drawn there)."""
        self.ahead = None  # a draft queued for it goes unused
        rows = self.verified_rows(self.rows(seqs), 0)
        block = rows.anchors[:, None]
        with self.timer.phase("verify"):
            out = self.verify(rows, block, record=False)
        with self.timer.phase("accept"):
            tokens = out.tokens if out.tokens is not None else self.ops.greedy(out.logits)
            bonus = tokens[:, 0].tolist()
        with self.timer.phase("commit"):
            self.defer_context(rows, self.context_features(out.features, 1, rows.n_t))
            for start, slot in zip(rows.starts, rows.slot_ids):
                self.state.lengths[slot] = self.draft_state.lengths[slot] = start + 1
        return [StepCommit(0, 0, [], [token]) for token in bonus]

    def seconds(
        self, widths: tuple[int, ...], max_rows: int, repeats: int = 5
    ) -> dict[tuple[int, int], float]:
        """Wall seconds of whole eager steps by (rows, verify width), for rows 1, 2, 4, ... up
        to max_rows: the median of `repeats` timed steps after one untimed (the widths timed
        in turn, round by round), each on
        placeholder requests in slots 0..rows-1 from position 0, so before any request runs (a
        request's admission resets its slot). A step is timed as the engine runs it: the rows'
        layout, the draft forward (none at width 0), the verify, accept, the commit and the
        draft's context, and the read of the results. Block position i of the flattened rows
        holds `timing_ids` (a different token at every position: a mixture of experts routes
        them as it routes text, verify_width.py); the draft's proposals are those tokens.
        Not timed: the engine's work around a step (emitting tokens, stop checks), and the
        attention over a request's context (every step here starts at position 0)."""
        B = self.block_size
        vocab = self.target.config.vocab_size
        rows_list = sorted({min(1 << k, max_rows) for k in range(max_rows.bit_length() + 1)})
        out = {}
        for rows in rows_list:
            ids = timing_ids(rows, B, vocab).tolist()
            seqs = [
                Sequence(
                    f"timing-{i}",
                    [],
                    SamplingParams(max_tokens=B + 1, ignore_eos=True),
                    frozenset(),
                    0.0,
                    True,
                    oracle=TimingProposals(ids[i][1:]),
                    slot=i,
                    output_ids=[ids[i][0]],
                )
                for i in range(rows)
            ]
            times: dict[int, list[float]] = {width: [] for width in widths}
            for r in range(repeats + 1):  # the widths in turn, so a machine's drift meets each alike
                for width in widths:
                    for i in range(rows):
                        self.state.lengths[i] = self.draft_state.lengths[i] = 0
                    start = time.perf_counter()
                    self(seqs, width)
                    if r:
                        times[width].append(time.perf_counter() - start)
            for width in widths:
                out[rows, width] = statistics.median(times[width])
            self.deferred.clear()  # what the plain steps kept for the placeholders
        for i in range(max_rows):
            self.state.lengths[i] = self.draft_state.lengths[i] = 0
        self.timer.reset()
        return out

    def read_step(
        self,
        rows: Rows,
        block: torch.Tensor,
        out: Verified,
        processed: torch.Tensor,
        pending: HostCopy,
        replayed: bool,
        plain: bool,
    ) -> tuple[list[int], list[int], list[int], list[list[int]]]:
        """The commit's host side: read the step's results (the one transfer), commit eagerly
        when no captured commit ran, and move the rows' lengths. Returns each row's accepted
        count, bonus, processed tokens and drafted tokens."""
        table = pending.tolist()  # a row each (step_table)
        acc_list, bonus_list, kept = [r[0] for r in table], [r[1] for r in table], [r[2] for r in table]
        drafted = [r[3 : 3 + n] for r, n in zip(table, rows.n)]
        if not replayed:
            if plain:  # the state is there already; nothing reads the draft's context before
                # the next draft (DeferredContext)
                self.defer_context(rows, self.context_features(out.features, max(kept), rows.n_t))
            else:
                self.commit_eagerly(rows, block, out, processed, max(kept))
        for i, slot in enumerate(rows.slot_ids):
            self.state.lengths[slot] = rows.starts[i] + kept[i]
            self.draft_state.lengths[slot] = rows.starts[i] + kept[i]
        return acc_list, bonus_list, kept, drafted

    def commit_eagerly(
        self, rows: Rows, block: torch.Tensor, out: Verified, processed: torch.Tensor, width: int
    ) -> None:
        """The commit without its graph: the state to the accepted boundary, and the draft's
        context of the block's first `width` positions (at least every row's kept ones)."""
        self.commit_state(rows.slot_ids, rows, block, processed.contiguous())
        features = self.context_features(out.features, width, rows.n_t)
        positions = rows.positions[:, :width]
        self.draft.append_context(features, positions, rows.slots, self.draft_state, self.ops)

    # ------------------------------------------------------------------ turns of several steps
    def turn_fits(self, seqs: list[Sequence], width: int | None) -> bool:
        """Whether `turn` may run steps past the first: a drafted step (width above 0) whose
        rows are all greedy and draft for themselves (an oracle's proposals are the host's)."""
        return width != 0 and all(s.params.greedy and s.oracle is None for s in seqs)

    def turn(
        self, seqs: list[Sequence], width: int | None, steps: int, same_rows_next: bool = False
    ) -> list[list[StepCommit]]:
        """`steps` speculative steps of the same rows, each queued from the one before it on
        the device, and the results of all of them read at the end: what each committed, step
        by step (docs/engine.md, "Steps per turn"). Step k + 1 drafts from step k's bonus
        tokens and processed counts (the captured inputs of a draft queued ahead, or the same
        operations eagerly) and verifies what that draft proposed, so the host queues
        `steps` steps and waits for the device once. Every row runs every step: a row that
        ends on the way (its end of sequence, a stop string, its max_tokens) runs on to the
        turn's end, the host drops what it commits after its end, and a row that has used
        up its max_tokens stays where it is (`next_positions`), inside its cells. One step
        (`__call__`) when `steps` is 1 or the rows cannot (`turn_fits`)."""
        if steps <= 1 or not self.turn_fits(seqs, width):
            return [self(seqs, width, same_rows_next)]
        first = rows = self.rows(seqs, width)
        with self.timer.phase("draft"):
            block, _, _ = self.propose(rows)
        N = rows.positions.shape[1] - 1
        W = N if width is None else min(width, N)
        if W < N:
            first = rows = self.verified_rows(rows, W)
            block = block[:, : W + 1].contiguous()
        tables, table, written = [], block, False  # each step's table (step 0 reads none)
        for k in range(steps):
            if k:
                with self.timer.phase("draft"):
                    rows, block = self.turn_step(rows, table, written, W, k)
            with self.timer.phase("verify"):
                out = self.verify(rows, block)
            with self.timer.phase("accept"):
                table, written = self.step_results(rows, block[:, 1:], [None] * len(seqs), out)
                tables.append(table.clone())  # a replayed accept's table is the next one's buffer
            with self.timer.phase("commit"):
                replayed = self.commit_replayed(table[:, 2], written)
                if not replayed:
                    self.commit_eagerly(rows, block, out, table[:, 2], W + 1)
        if self.draft_ahead and same_rows_next and replayed:
            with self.timer.phase("draft", count=False):
                self.launch_ahead_replayed(rows, table[:, 1], table[:, 2], written)
        with self.timer.phase("commit", count=False):
            read = self.reader.copy(torch.stack(tables)).tolist()
        return self.turn_commits(first, read)

    def turn_step(
        self, rows: Rows, table: torch.Tensor, written: bool, W: int, k: int
    ) -> tuple[Rows, torch.Tensor]:
        """Step k of a turn (k >= 1) from step k - 1's `rows` and `table` on the device: its
        rows as the verify sees them, and its blocks [b, W + 1] (each row's bonus, then the
        proposals of a draft from there). The rows are laid out here, from the table, as the
        draft's inputs are (`next_blocks`), but apart from them: a draft's inputs, however
        wrong, change its proposals and so acceptance, never output."""
        N = W if self.span_verify else self.block_size - 1
        vocab = self.target.config.vocab_size
        bonus, processed = self.anchor_ids(table[:, 1]), table[:, 2]
        n = self.next_draft_tokens(rows.remaining_t, processed).clamp(max=N)
        positions = self.next_positions(processed, rows.positions[:, 0], N, n)
        # what an eager forward reads: the turn's rows move at most a block a step
        kv_len = min(max(rows.starts) + (k + 1) * (N + 1), self.state.max_len)
        queued = self.runner.propose_ahead(rows.remaining_t, W) if written else None
        if queued is not None:  # the draft's inputs written by their graph, then the draft's
            drafted = queued[1]
        else:
            block = self.block_of(bonus, N)
            drafted = self.runner.propose(block, positions, rows.slots, n + 1, kv_len, width=W)
        block = torch.cat([bonus[:, None], drafted.tokens[:, :W].clamp(0, vocab - 1)], dim=1)
        n_t = n.clamp(max=W)
        nxt = Rows(
            rows.seqs,
            rows.slot_ids,
            rows.slots,
            rows.starts,  # the first step's: later ones are read at the turn's end
            rows.n,
            n_t,
            block[:, 0],
            rows.remaining_t - processed,
            positions[:, : W + 1],
            kv_len,
            rows.draft_width,
            n_t + 1,
        )
        return nxt, block

    def turn_commits(self, rows: Rows, read: list[list[list[int]]]) -> list[list[StepCommit]]:
        """What each step of a turn committed for each row, from the steps' tables (`read`, a
        table a step) and the turn's first rows; moves the rows' lengths to the turn's end and
        says where a draft queued behind it put each row (DraftAhead)."""
        B = self.block_size
        W = rows.positions.shape[1] - 1
        starts, remaining = list(rows.starts), [s.remaining for s in rows.seqs]
        n = list(rows.n)
        out = []
        for k, table in enumerate(read):
            if k:  # the draft tokens each row verified at step k, from what it had left
                n = [min(B - 1, W, max(r, 0)) for r in remaining]
            commits = []
            for i, r in enumerate(table):
                accepted, bonus, kept = r[0], r[1], r[2]
                drafted = r[3 : 3 + n[i]]
                commits.append(StepCommit(n[i], accepted, drafted, drafted[:accepted] + [bonus]))
                starts[i] += kept  # past its end a row's values are never read again
                remaining[i] -= kept
            out.append(commits)
        for i, slot in enumerate(rows.slot_ids):
            self.state.lengths[slot] = self.draft_state.lengths[slot] = starts[i]
        if self.ahead is not None:
            self.ahead.starts, self.ahead.n = starts, [min(B - 1, r) for r in remaining]
        return out

    # ------------------------------------------------------------------ deferred context
    def defer_context(self, rows: Rows, features: torch.Tensor) -> None:
        """Keep a plain step's context features ([b, 1, n * hidden], each row's anchor) for
        the row's next draft (DeferredContext)."""
        for i, (seq, slot) in enumerate(zip(rows.seqs, rows.slot_ids)):
            entry = self.deferred.get(id(seq))
            if entry is not None and entry.first + len(entry.features) != rows.starts[i]:
                self.flush_context([seq])  # not the next position (never seen): written as it is
                entry = None
            if entry is None:
                entry = self.deferred[id(seq)] = DeferredContext(seq, slot, rows.starts[i], [])
            entry.features.append(features[i, 0])

    def drop_context(self, seqs: list[Sequence]) -> None:
        """Forget what the plain steps of `seqs` deferred: they ended, and nothing reads a
        request's draft context after its last step (its slot's next request writes its own)."""
        for seq in seqs:
            self.deferred.pop(id(seq), None)

    def flush_context(self, seqs: list[Sequence], only: bool = False) -> None:
        """Append the context the plain steps of `seqs` deferred, before anything reads it:
        rows with as many deferred positions go in one append (no padding: every position
        written is a committed one, with the features a step's own append would have written).
        With `only`, the other requests' deferred context is dropped: a drafted step runs every
        speculative request that runs, so what is left belongs to requests that have left (an
        abort, a failed step, a fall back to plain decode), whose slots may already hold
        another request."""
        if not self.deferred:  # nothing deferred (always so on a GPU, where no step is plain)
            return
        # an entry holds its request, so no other request can have that id()
        entries = [self.deferred.pop(id(seq)) for seq in seqs if id(seq) in self.deferred]
        if only:
            self.deferred.clear()
        groups: dict[int, list[DeferredContext]] = {}
        for entry in entries:
            groups.setdefault(len(entry.features), []).append(entry)
        for count, group in groups.items():
            features = torch.stack([torch.stack(e.features) for e in group])  # [g, count, F]
            first = to_device([e.first for e in group], self.device)
            positions = first[:, None] + torch.arange(count, device=self.device)
            slots = to_device([e.slot for e in group], self.device)
            self.draft.append_context(features, positions, slots, self.draft_state, self.ops)

    # ------------------------------------------------------------------ layout
    def rows(self, seqs: list[Sequence], width: int | None = None) -> Rows:
        """The step's rows, their blocks of N + 1 positions, and the draft slots whose
        proposals a verify of `width` takes (Rows.draft_width). With the verify's draft span a
        drafted step's blocks hold only as many mask tokens as it verifies."""
        n = [min(self.block_size - 1, s.remaining) for s in seqs]
        if self.span_verify and width:
            n = [min(k, width) for k in n]
        N = self.block_size - 1 if self.pad_blocks else max(n)
        starts = self.anchor_positions(seqs)
        slot_ids = [s.slot for s in seqs]
        anchors = [s.output_ids[-1] if s.pending is None else 0 for s in seqs]
        remaining = [s.remaining for s in seqs]
        valid = [k + 1 for k in n]
        positions = [start + j for start in starts for j in range(N + 1)]
        # one host-to-device copy for the six and the positions (each a device operation less)
        b = len(seqs)
        packed = to_device(slot_ids + n + anchors + remaining + valid + positions, self.device)
        slots_t, n_t, anchors_t, remaining_t, valid_t, positions_t = packed.split([b] * 5 + [len(positions)])
        pending = [(i, *s.pending) for i, s in enumerate(seqs) if s.pending is not None]
        if pending:  # first tokens still on the device (prefill.py)
            place_tokens(anchors_t, pending)
        kv_len = max(starts) + N + 1
        draft_width = None if width is None or width >= N else width
        return Rows(
            seqs,
            slot_ids,
            slots_t,
            starts,
            n,
            n_t,
            anchors_t,
            remaining_t,
            positions_t.view(b, N + 1),
            kv_len,
            draft_width,
            valid_t,
        )

    def verified_rows(self, rows: Rows, width: int) -> Rows:
        """The rows as the verify sees them: each row's first min(n_i, width) proposals, padded
        to `width` with graphs (a captured verify width) and to the longest row without."""
        n = [min(n_i, width) for n_i in rows.n]
        W = width if self.pad_blocks else max(n)
        n_t = rows.n_t.clamp(max=width)
        return Rows(
            rows.seqs,
            rows.slot_ids,
            rows.slots,
            rows.starts,
            n,
            n_t,
            rows.anchors,
            rows.remaining_t,
            rows.positions[:, : W + 1],
            max(rows.starts) + W + 1,
            rows.draft_width,
        )

    def anchor_positions(self, seqs: list[Sequence]) -> list[int]:
        """Each row's anchor sits at its committed length."""
        return [self.state.lengths[s.slot] for s in seqs]

    # ------------------------------------------------------------------ draft
    def block_of(self, anchors: torch.Tensor, N: int) -> torch.Tensor:
        """The draft's blocks [b, N + 1]: each row's anchor, then N mask tokens."""
        mask = self.draft.config.mask_token_id
        block = torch.full((anchors.shape[0], N + 1), mask, dtype=torch.int64, device=self.device)
        block[:, 0] = anchors
        return block

    def next_blocks(
        self, bonus: torch.Tensor, processed: torch.Tensor, anchors_at: torch.Tensor, N: int, n: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The next step's draft blocks [b, N + 1] and their positions from this step's results:
        each row's bonus as its anchor, at its anchor position `anchors_at` + processed. A row
        with no draft tokens left (`n`, next_draft_tokens, is 0: this step used up its
        max_tokens) stays where it is: nothing takes its block, and it then writes only the
        positions this step's block wrote, inside the request's cells."""
        return self.block_of(self.anchor_ids(bonus), N), self.next_positions(processed, anchors_at, N, n)

    def anchor_ids(self, bonus: torch.Tensor) -> torch.Tensor:
        """Each row's bonus as the anchor a next step drafts and verifies from, on the device.
        A row whose bonus is not a token (its logits were not finite: greedy gave `vocab`) has
        failed; it runs on to the end of a turn or a queued draft, as a row that ended does,
        from a valid id (an out-of-range one would index the embeddings out of bounds: a
        device assert on the GPU), and what it commits after its failure is dropped."""
        return bonus.clamp(0, self.target.config.vocab_size - 1)

    def next_positions(
        self, processed: torch.Tensor, anchors_at: torch.Tensor, N: int, n: torch.Tensor
    ) -> torch.Tensor:
        """The positions [b, N + 1] of the next step's blocks (`next_blocks`)."""
        at = anchors_at + torch.where(n > 0, processed, 0)
        return at[:, None] + torch.arange(N + 1, device=self.device)

    def next_draft_tokens(self, remaining: torch.Tensor, processed: torch.Tensor) -> torch.Tensor:
        """Each row's draft tokens next step, from the tokens it had left and kept: min(B - 1,
        remaining - processed), 0 for a row that ends."""
        return (remaining - processed).clamp(0, self.block_size - 1)

    def ahead_width(self, rows: Rows, N: int) -> int:
        """The head width of a draft queued ahead: this step's draft width (the next step's
        most likely one)."""
        return N if rows.draft_width is None else min(rows.draft_width, N)

    def launch_ahead(
        self,
        rows: Rows,
        bonus: torch.Tensor,  # [b] each row's next anchor
        processed: torch.Tensor,  # [b] block tokens each row kept
        n: torch.Tensor,  # [b] each row's next draft tokens
        N: int,  # the next block's draft slots
        kv_len: int,  # what an eager forward reads (a replayed one ignores it)
    ) -> None:
        """Queue the next step's draft (DraftAhead): each row's bonus as its anchor, at its
        start + processed, its head at this step's draft width."""
        self.flush_context(rows.seqs, only=True)
        block, positions = self.next_blocks(bonus, processed, rows.positions[:, 0], N, n)
        width = self.ahead_width(rows, N)
        drafted = self.runner.propose(block, positions, rows.slots, n + 1, kv_len, width=width)
        self.queued_ahead(rows, block, drafted, width)

    def queued_ahead(self, rows: Rows, block: torch.Tensor, drafted: Proposals, width: int) -> None:
        self.ahead = DraftAhead(list(rows.seqs), block, drafted, width)
        self.ahead_queued += 1

    def launch_ahead_replayed(
        self, rows: Rows, bonus: torch.Tensor, processed: torch.Tensor, written: bool = False
    ) -> None:
        """Behind a captured commit, from the device's results alone: a full block of B - 1
        slots (as every replayed draft), min(B - 1, remaining - processed) of them real. With
        `written` (the captured accept made the step's table) the inputs are written by a
        graph of their own (`ahead_body`, captured beside the accept), so the host queues
        three replays and no operation of its own."""
        N = self.block_size - 1
        if written:
            self.flush_context(rows.seqs, only=True)
            width = self.ahead_width(rows, N)
            queued = self.runner.propose_ahead(rows.remaining_t, width)
            if queued is not None:
                inputs, drafted = queued
                self.queued_ahead(rows, inputs.ids, drafted, width)
                return
        n = self.next_draft_tokens(rows.remaining_t, processed)
        self.launch_ahead(rows, bonus, processed, n, N, self.state.max_len)

    def ahead_body(self, x: StepInputs, table: torch.Tensor, remaining: torch.Tensor) -> StepInputs:
        """The captured inputs of a draft queued ahead (`launch_ahead_replayed`), from a
        verify's static inputs `x`, the captured accept's table (step_table) and each row's
        tokens left before the step: the next blocks, their positions, the slots and the
        valid tokens, as `launch_ahead` makes them (a bucket's padding rows are put back to
        the padding's inputs by the graphs)."""
        bonus, processed = table[:, 1], table[:, 2]
        N = self.block_size - 1
        n = self.next_draft_tokens(remaining, processed)
        block, positions = self.next_blocks(bonus, processed, x.positions[:, 0], N, n)
        return StepInputs(block, positions, x.slots, n + 1)

    def expect_ahead(self, rows: Rows, kept: list[int], bonus: list[int], replayed: bool) -> None:
        """Once the step's results are read: where the queued draft put each row, checked
        against the next step's rows (DraftAhead.rows_for). An eager step queues it only now,
        after its commit has given the draft its context, with the next step's own shapes."""
        starts = [start + k for start, k in zip(rows.starts, kept)]
        n = [min(self.block_size - 1, s.remaining - k) for s, k in zip(rows.seqs, kept)]
        if not replayed:
            # shaped for the rows that go on (a row that ends drafts nothing and is not taken)
            going_on = [(start, k) for start, k in zip(starts, n) if k > 0]
            if not going_on:
                return
            N = self.block_size - 1 if self.pad_blocks else max(k for _, k in going_on)
            kv_len = max(start for start, _ in going_on) + N + 1
            processed_t, bonus_t, n_t = to_device([kept, bonus, [max(k, 0) for k in n]], self.device)
            with self.timer.phase("draft", count=False):
                self.launch_ahead(rows, bonus_t, processed_t, n_t, N, kv_len)
        if self.ahead is not None:
            self.ahead.starts, self.ahead.n = starts, n

    def propose(self, rows: Rows) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
        """One draft forward over every row's block (or the one queued for these rows by the
        step before, DraftAhead), its head for draft slots 1..W (W = Rows.draft_width, N when
        None). Returns (block [b, W + 1]: anchor and proposals, proposals [b, W], draft
        distributions per row (sampled rows only)). A DFlash2 draft's greedy proposals are
        its selector's path; its sampled rows draw along the path (walk.py)."""
        N = rows.positions.shape[1] - 1
        W = N if rows.draft_width is None else min(rows.draft_width, N)
        ahead, self.ahead = self.ahead, None
        taken = ahead.rows_for(rows) if ahead is not None else None
        drafted = None
        if taken is not None:
            drafted = ahead.drafted
            if ahead.width < W:  # queued for a narrower step: its head again, over its layers
                drafted = self.runner.repropose(len(ahead.seqs), W)
                self.ahead_widened += drafted is not None
        if drafted is not None:
            if taken != list(range(len(ahead.seqs))):  # rows ended: their blocks are left out
                drafted = drafted.rows(to_device(taken, self.device))
                self.ahead_narrowed += 1
            self.ahead_used += 1
        else:
            self.flush_context(rows.seqs, only=True)
            block = self.block_of(rows.anchors, N)
            with self.timer.parts() as part:  # a DFlash2 draft's convolution and selector, when eager
                drafted = self.runner.propose(
                    block, rows.positions, rows.slots, rows.valid, rows.kv_len, part, width=W
                )
        # [b, W] (a queued draft's head may be wider), a copy; a draft row that is not finite
        # (greedy gives `vocab`, sampling -1) still proposes a valid id: the target verifies
        # every proposal, so a bad draft costs acceptance only
        vocab = self.target.config.vocab_size
        proposals = drafted.tokens[:, :W].clamp(0, vocab - 1)
        drawn = False  # whether a sampled row wrote its own proposals (clamped again below)
        draft_probs: list[torch.Tensor | None] = [None] * len(rows.seqs)
        guesses = {}  # tests and benchmarks: the oracle's scheduled proposals, row -> ids
        for i, seq in enumerate(rows.seqs):
            n_i = min(rows.n[i], W)
            if seq.oracle is not None:
                guesses[i] = seq.oracle.propose(len(seq.steps), seq.generated, rows.n[i])[:W]
            elif not seq.params.greedy and drafted.edges is not None:  # DFlash2: along the walk
                p = seq.params
                drawn = True
                proposals[i, :n_i], draft_probs[i] = sample_walk(
                    drafted.candidates[i, :n_i],
                    drafted.edges[i, :n_i],
                    drafted.logits.shape[-1],
                    p.temperature,
                    p.top_k,
                    p.top_p,
                    seq.generator,
                )
            elif not seq.params.greedy:
                p = seq.params
                # [n_i, vocab] of the draft's logits (valid until its next replay)
                draft_probs[i] = probabilities(drafted.logits[i, :n_i], p.temperature, p.top_k, p.top_p)
                proposals[i, :n_i] = sample(draft_probs[i], seq.generator)
                drawn = True
        if guesses:  # one host-to-device copy for every oracle row (-1: keep the draft's)
            guessed = to_device([g + [-1] * (W - len(g)) for g in guesses.values()], self.device)
            at = to_device(list(guesses), self.device)
            proposals[at] = torch.where(guessed >= 0, guessed, proposals[at])
        if drawn or guesses:
            proposals.clamp_(0, vocab - 1)
        # the anchors the host knows, not the draft's block (a queued draft's is a view of its
        # graph's static inputs, written from the device's results): a draft's inputs, however
        # wrong, then cost acceptance only
        block = torch.cat([rows.anchors[:, None], proposals], dim=1)
        return block, proposals, draft_probs

    def no_proposals(self, rows: Rows) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
        """A plain step's block: the anchors alone [b, 1], no proposals [b, 0], and for sampled
        rows an empty draft distribution (the bonus is then drawn from the target's)."""
        block = rows.anchors[:, None].clone()
        proposals = block[:, 1:]
        vocab = self.target.config.vocab_size
        empty = torch.zeros((0, vocab), dtype=torch.float32, device=self.device)
        return block, proposals, [None if s.params.greedy else empty for s in rows.seqs]

    # ------------------------------------------------------------------ verify
    def verify(self, rows: Rows, block: torch.Tensor, record: bool = True) -> Verified:
        """One target forward over every block; captures the draft's context features and
        keeps what the commit strategy needs (a replayed one brings its argmax along, so
        accept needs no second pass). Without `record` (a plain step, whose block is kept
        whole) an eager forward keeps nothing for the commit and leaves the state after it."""
        # a plain step commits its whole block, so it needs no snapshot to go back to (plain
        # steps run on the CPU only, where no captured commit reads one)
        if record and self.target.config.is_hybrid and needs_snapshot(self.commit_strategy):
            self.state.save_rows(rows.slot_ids)
        # a block of the anchor alone is real in every row: an eager forward then takes
        # decode's path (no row held back, the conv state moved on by a slice, not a gather)
        valid = None if block.shape[1] == 1 and not self.runner.captured else rows.valid
        return self.runner.verify(block, rows.positions, rows.slots, valid, rows.kv_len, record)

    # ------------------------------------------------------------------ accept
    def accept_replayed(self, rows: Rows) -> torch.Tensor | None:
        """The step's table from the captured accept (`capture_commit`), when this step's
        verify replayed its graph, every row is greedy with no forced acceptance, and the
        accept's phase methods are still the reference ones (a replaced one, e.g. a planted
        fault, runs eagerly); None otherwise."""
        for seq in rows.seqs:
            if not seq.params.greedy or (seq.oracle is not None and seq.oracle.forced):
                return None
        if not self.runs_reference(REFERENCE_ACCEPT):
            return None
        return self.runner.accept(len(rows.seqs))

    def step_results(
        self,
        rows: Rows,
        proposals: torch.Tensor,
        draft_probs: list[torch.Tensor | None],
        out: Verified,
        plain: bool = False,
    ) -> tuple[torch.Tensor, bool]:
        """The step's table (step_table) and whether the captured accept made it, which then
        also wrote `processed` into the commit's input; eagerly otherwise (a plain step always)."""
        table = None if plain else self.accept_replayed(rows)
        if table is not None:
            return table, True
        accepted, bonus = self.accept(rows, proposals, draft_probs, out.logits, out.tokens)
        return step_table(accepted, bonus, self.processed(rows, accepted), proposals), False

    def accept(
        self,
        rows: Rows,
        proposals: torch.Tensor,  # [b, N]
        draft_probs: list[torch.Tensor | None],
        logits: torch.Tensor,  # [b, N + 1, vocab] the verify's
        target_tokens: torch.Tensor | None = None,  # [b, N + 1] its argmax, when at hand
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (accepted [b], bonus [b]): greedy rows by comparison with the target's
        argmax, sampled rows by speculative sampling."""
        if target_tokens is None:
            target_tokens = self.ops.greedy(logits)  # [b, N + 1]
        accepted = self.accept_greedy(proposals, target_tokens, rows.n_t)
        forced = [
            (i, seq.oracle.scheduled(len(seq.steps), rows.n[i]))
            for i, seq in enumerate(rows.seqs)
            if seq.oracle is not None and seq.oracle.forced
        ]  # benchmarks only
        if forced:  # one host-to-device copy for every forced row
            at, counts = to_device(list(zip(*forced)), self.device)
            accepted[at] = counts
        bonus = target_tokens.gather(1, self.bonus_index(accepted, rows.n_t)[:, None])[:, 0]
        for i, seq in enumerate(rows.seqs):
            if not seq.params.greedy:
                n_i, p = rows.n[i], seq.params
                target_probs = probabilities(logits[i, : n_i + 1], p.temperature, p.top_k, p.top_p)
                accepted[i], bonus[i] = self.accept_sampled(
                    proposals[i, :n_i], draft_probs[i], target_probs, seq.generator
                )
        return accepted, bonus

    def accept_greedy(
        self, proposals: torch.Tensor, target_tokens: torch.Tensor, n_t: torch.Tensor
    ) -> torch.Tensor:
        accepted, _ = accept_greedy(proposals, target_tokens)
        return torch.minimum(accepted, n_t)  # padding is never accepted

    def bonus_index(self, accepted: torch.Tensor, n_t: torch.Tensor) -> torch.Tensor:
        """The block slot whose target choice is the bonus: right after the accepted prefix."""
        return accepted

    def accept_sampled(
        self,
        proposals: torch.Tensor,  # [n]
        draft_probs: torch.Tensor,  # [n, vocab]
        target_probs: torch.Tensor,  # [n + 1, vocab]
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        accepted, bonus = accept_sampled(proposals[None], draft_probs[None], target_probs[None], generator)
        return accepted[0], bonus[0]

    # ------------------------------------------------------------------ commit
    def processed(self, rows: Rows, accepted: torch.Tensor) -> torch.Tensor:
        """Block tokens each row keeps in the target: the anchor and the accepted ones."""
        return accepted + 1

    def commit_state(
        self, slot_ids: list[int], rows: Rows, block: torch.Tensor, processed: torch.Tensor
    ) -> None:
        """Bring hybrid state to the accepted boundary (commit.py; attention needs nothing,
        its length moves back)."""
        commit_hybrid(
            self.commit_strategy,
            self.target,
            self.state,
            slot_ids,
            block,
            rows.positions,
            processed,
            rows.kv_len,
            self.ops,
        )

    def context_features(self, features: torch.Tensor, width: int, n_t: torch.Tensor) -> torch.Tensor:
        """The verify's features of the committed positions ([b, width, n * hidden]), the
        draft's next context; rows that kept fewer overwrite the extra rows next step."""
        return features[:, :width]

    # ------------------------------------------------------------------ commit, captured
    def capture_commit(self) -> None:
        """Capture the commit (state to the accepted boundary, the draft's new context) per
        batch bucket and verify width, from the reference phase methods. It writes the draft
        context of every position of the verified block: the rows past what a row kept are
        the next block's positions, which that block overwrites before anything reads them
        (as rows that keep fewer than the longest do in the eager commit). Beside it, the
        greedy accept (`accept_replayed`), also from the reference phase methods: the step's
        table for the host, and each row's `processed` for the commit, in one replay instead
        of a dozen small operations a step."""

        def body(x: StepInputs, verified: Verified) -> None:
            width = x.ids.shape[1]  # the verify's block: anchor and the draft tokens it checks
            rows = captured_rows(x)
            REFERENCE_PHASES["commit_state"](self, x.slots, rows, x.ids, x.processed)
            features = REFERENCE_PHASES["context_features"](self, verified.features, width, rows.n_t)
            self.draft.append_context(features, x.positions[:, :width], x.slots, self.draft_state, self.ops)

        self.runner.capture_commit(body, self.accept_body)
        if self.draft_ahead:
            self.runner.capture_ahead(self.ahead_body)

    def accept_body(self, x: StepInputs, verified: Verified) -> torch.Tensor:
        """The captured accept (`capture_commit`) over a verify's inputs and outputs: the greedy
        rows of `accept`, then `processed`, as an eager step runs them, from the reference
        phase methods; writes `processed` into the commit's input and returns the step's
        table (step_table)."""
        rows, proposals, tokens = captured_rows(x), x.ids[:, 1:], verified.tokens
        accepted = REFERENCE_ACCEPT["accept_greedy"](self, proposals, tokens, rows.n_t)
        at = REFERENCE_ACCEPT["bonus_index"](self, accepted, rows.n_t)
        bonus = tokens.gather(1, at[:, None])[:, 0]
        processed = REFERENCE_ACCEPT["processed"](self, rows, accepted)
        x.processed.copy_(processed)
        return step_table(accepted, bonus, processed, proposals)

    def commit_replayed(self, processed: torch.Tensor, written: bool = False) -> bool:
        """The captured commit, when this step's verify replayed its graph and the commit's
        phase methods are still the reference ones (a replaced one, e.g. a planted fault,
        runs eagerly). `written`: the captured accept put `processed` in the commit's input."""
        return self.runner.commit(
            None if written else processed, replay=self.runs_reference(REFERENCE_PHASES)
        )

    def runs_reference(self, phases: dict[str, Callable]) -> bool:
        """Whether the step's phase methods named in `phases` are still the ones given there
        (a captured graph runs those; a replaced one, e.g. a planted fault, runs eagerly)."""
        return all(getattr(type(self), name) is method for name, method in phases.items())


def captured_rows(x: StepInputs) -> Rows:
    """The rows a captured phase sees, from a graph's static inputs: only the device fields
    the phases read are real (remaining_t is a stand-in)."""
    return Rows([], [], x.slots, [], [], x.valid - 1, x.ids[:, 0], x.valid - 1, x.positions, 1)


def step_table(
    accepted: torch.Tensor, bonus: torch.Tensor, processed: torch.Tensor, proposals: torch.Tensor
) -> torch.Tensor:
    """What the host reads of a step, one row per request: accepted, bonus, processed, then
    the W proposals ([b, 3 + W])."""
    return torch.cat([accepted[:, None], bonus[:, None], processed[:, None], proposals], dim=1)


# the phase methods the captured commit runs, as defined above
REFERENCE_PHASES = {name: getattr(SpeculativeStep, name) for name in ("commit_state", "context_features")}
# and those the captured accept runs (`accept` itself: a replaced one decides differently)
REFERENCE_ACCEPT = {
    name: getattr(SpeculativeStep, name) for name in ("accept", "accept_greedy", "bonus_index", "processed")
}
