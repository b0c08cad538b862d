"""Gate: the draft is batch-invariant. Every request's proposals (the draft's logits and its
own greedy tokens at each step, keyed by the output position the step starts from) and the
context features the draft receives (per committed position) are the same when it runs alone
and when it runs in a batch of 16 with mixed prompt lengths, staggered arrivals, departures
and slots taken over by later arrivals.

Output equality cannot see a draft fault: the target verifies every proposal, so a draft
that reads another row's context or positions, a departed request's rows, its own padding,
or the wrong target layer only in batches costs acceptance and nothing else; on a random
tiny draft, hardly even that. So this gate compares what the draft computes, not what the
engine emits. Both proposers run: the real draft (its tokens are the proposals) and the
oracle with mixed acceptance (each step keeps a different count, so rows of one batch commit
different widths; the draft still runs and is compared).

Tolerance: the CPU float64 kernels are not bit-for-bit batch-invariant (a GEMM's blocking
follows its row count; about 2e-14 measured here), so values must agree within 1e-10 and
tokens exactly. Faults of this class move the logits by far more: another row's context,
features or positions, attention past a row's own block (padding, stale rows) or the wrong
target layer in batches moved them by 0.05 to 1.4 where they first differed.
"""

from __future__ import annotations

import random
from collections import Counter
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import pytest
import torch

from reference_engine.models.dflash import DFlashDraft
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.speculative_step import SpeculativeStep
from reference_engine.runtime.verify_width import StepCosts, VerifyWidth

from .checks import EngineRequest, Pair, assert_batch_equivalent, run_engine
from .conftest import TINY_PAIRS
from .faults import planted
from .hooks import hooked

BLOCK_SIZE = 8
BATCH = 16
REQUESTS = 24  # more than the batch holds: later arrivals take over departed rows' slots
TOLERANCE = 1e-10  # float64; see the module docstring
PROPOSERS = ("draft", "oracle")
PROMPT_LENGTHS = (1, 6, 23, 48, 70, 130)  # the first four fit one prefill chunk
MAX_TOKENS = 30
PREFILL_CHUNK = 48


@dataclass
class DraftRecord:
    """What the draft computed for each request of one run."""

    # (request, output position at the step) -> (the draft's tokens [n], its logits [n, vocab])
    proposals: dict[tuple[str, int], tuple[list[int], torch.Tensor]] = field(default_factory=dict)
    # (request, position) -> the context features last written there [n * hidden]
    features: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    batch_sizes: list[int] = field(default_factory=list)  # rows of each draft forward
    # request -> the most context positions one of its draft forwards read (its block's start)
    read: dict[str, int] = field(default_factory=dict)
    occupants: dict[int, set[str]] = field(default_factory=dict)  # slot -> requests it held


def recording(record: DraftRecord, engine: Engine) -> AbstractContextManager[None]:
    """Hooks that fill `record` from the draft's inputs and outputs while `engine` runs."""
    step_logits: list[torch.Tensor] = []

    def proposals(correct):
        def wrapped(self, hidden, lm_head_weight, *args, **kwargs):
            out = correct(self, hidden, lm_head_weight, *args, **kwargs)
            step_logits.append(out[0])  # [b, N, vocab]
            step_logits.append(out[1])  # [b, N] (DFlash2: the selector's path)
            return out

        return wrapped

    def propose(correct):
        def wrapped(self, rows):
            step_logits.clear()
            out = correct(self, rows)
            logits, tokens = step_logits[:2]
            record.batch_sizes.append(len(rows.seqs))
            for i, seq in enumerate(rows.seqs):
                record.occupants.setdefault(seq.slot, set()).add(seq.request_id)
                record.read[seq.request_id] = max(record.read.get(seq.request_id, 0), rows.starts[i])
                n_i = rows.n[i]  # the row's real slots; the rest is padding
                record.proposals[(seq.request_id, len(seq.output_ids))] = (
                    tokens[i, :n_i].tolist(),
                    logits[i, :n_i].clone(),
                )
            return out

        return wrapped

    def append_context(correct):
        def wrapped(self, features, positions, slots, *args, **kwargs):
            owner = {seq.slot: seq.request_id for seq in engine.scheduler.active.values()}
            for i, slot in enumerate(slots.tolist()):
                row = features[i].clone()  # [T, n * hidden]
                for j, position in enumerate(positions[i].tolist()):
                    record.features[(owner[slot], position)] = row[j]
            return correct(self, features, positions, slots, *args, **kwargs)

        return wrapped

    return hooked(
        (type(engine.draft), "proposals", proposals),  # DFlash2 overrides it
        (SpeculativeStep, "propose", propose),
        (DFlashDraft, "append_context", append_context),
    )


def workload(pair: Pair, proposer: str) -> list[EngineRequest]:
    """A full batch from the first step (one prefill chunk each), then later arrivals with
    longer prompts (prefilled in chunks beside running rows) that wait for departed rows'
    slots; output budgets from 2 to MAX_TOKENS tokens."""
    rng = random.Random(5)
    schedules = random.Random(6)
    vocab = pair.target.config.vocab_size
    requests = []
    for i in range(REQUESTS):
        first_wave = i < BATCH
        length = rng.choice(PROMPT_LENGTHS[:4] if first_wave else PROMPT_LENGTHS)
        prompt = tuple(rng.randrange(vocab - 16) for _ in range(length))
        params = SamplingParams(max_tokens=rng.randint(2, MAX_TOKENS), ignore_eos=True)
        schedule = tuple(schedules.randrange(BLOCK_SIZE) for _ in range(5)) if proposer == "oracle" else None
        arrival = 0 if first_wave else 2 * (i - BATCH + 1)
        requests.append(EngineRequest(f"req{i}", prompt, params, arrival, schedule))
    return requests


def record_run(
    pair: Pair,
    requests: list[EngineRequest],
    references: dict[str, list[int]],
    slots: int,
    step_costs: StepCosts | None = None,
    widths: Counter | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
) -> tuple[DraftRecord, dict[str, list[int]]]:
    """Run `requests` on a fresh engine of `slots` rows (with `step_costs` for the verify
    width, and the widths its steps chose counted into `widths`); returns what the draft
    computed and each request's output."""
    engine = Engine(
        pair.target,
        pair.draft,
        EngineConfig(
            max_num_seqs=slots,
            block_size=BLOCK_SIZE,
            prefill_chunk=prefill_chunk,
            max_model_len=max(PROMPT_LENGTHS) + MAX_TOKENS,
            enforce_eager=True,
        ),
        step_costs=step_costs,
    )
    record = DraftRecord()
    with recording(record, engine):
        streamed = run_engine(engine, requests, references)
    if widths is not None:
        widths.update(engine.verify_widths)
    return record, streamed


def assert_draft_batch_invariant(
    alone: DraftRecord, batched: DraftRecord, committed: dict[str, int], what: str, every_step: bool = True
) -> int:
    """Every step the request ran alone ran in the batch from the same output position with
    the same draft tokens and logits, over the draft slots both computed, and every committed
    position got the same features. With `every_step` False (a batch of plain steps among
    drafted ones): over the steps both ran, and the positions a draft of the batch read (a
    plain step's context waits for the request's next draft, and is dropped if none comes)."""
    for (request_id, position), (tokens, logits) in sorted(alone.proposals.items()):
        got = batched.proposals.get((request_id, position))
        if got is None and not every_step:
            continue
        if got is None:
            raise AssertionError(
                f"{what}: request {request_id} drafted at output position "
                f"{position} alone but not in the batch"
            )
        # a step that verifies W proposals runs the draft's head for slots 1..W alone: the
        # slots both runs proposed for must agree
        k = min(len(got[0]), len(tokens))
        error = float((got[1][:k] - logits[:k]).abs().max()) if k else 0.0
        if got[0][:k] != tokens[:k] or not error <= TOLERANCE:
            raise AssertionError(
                f"{what}: request {request_id}'s draft at output position {position} differs "
                f"in the batch: tokens {got[0]} vs {tokens} alone, logits by {error:.3g} "
                f"(tolerance {TOLERANCE:g})"
            )
    compared = 0
    for (request_id, position), features in sorted(alone.features.items()):
        if position >= committed[request_id]:
            continue  # rows past the committed length are the next block's scratch
        if not every_step and position >= batched.read.get(request_id, 0):
            continue  # no draft of the batch read it
        got = batched.features.get((request_id, position))
        error = float("inf") if got is None else float((got - features).abs().max())
        if not error <= TOLERANCE:
            raise AssertionError(
                f"{what}: request {request_id}'s draft context at position {position} differs "
                f"in the batch by {error:.3g} (tolerance {TOLERANCE:g})"
            )
        compared += 1
    return compared


Workload = tuple[list[EngineRequest], dict[str, list[int]], DraftRecord, dict[str, int]]


@pytest.fixture(scope="module")
def alone_runs(pair: Pair) -> dict[str, Workload]:
    """Per proposer: the requests (the same ones; the oracle's follow plain greedy
    references), the references, what the draft computed for each request run alone on a
    fresh engine (no slot history, its prompt prefilled whole), and each request's
    committed length."""
    if pair.name not in TINY_PAIRS:
        pytest.skip("the draft batch-invariance gate compares float64 values: tiny pairs only")
    requests = {proposer: workload(pair, proposer) for proposer in PROPOSERS}
    references = {
        r.request_id: generate_plain(pair.target, list(r.prompt), r.params).output_ids
        for r in requests["oracle"]
    }
    runs = {}
    for proposer in PROPOSERS:
        alone = DraftRecord()
        committed: dict[str, int] = {}
        for r in requests[proposer]:
            # alone, every prompt in one prefill chunk (the batch runs the longer ones in chunks)
            one, streamed = record_run(
                pair,
                [EngineRequest(r.request_id, r.prompt, r.params, 0, r.schedule)],
                references,
                1,
                prefill_chunk=max(PROMPT_LENGTHS),
            )
            alone.proposals.update(one.proposals)
            alone.features.update(one.features)
            # the positions the target ran, whose features the draft keeps
            committed[r.request_id] = len(r.prompt) + len(streamed[r.request_id]) - 1
        runs[proposer] = (requests[proposer], references, alone, committed)
    return runs


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_draft_proposals_and_context_are_the_same_alone_and_in_a_batch(
    pair: Pair, alone_runs, proposer: str
) -> None:
    requests, references, alone, committed = alone_runs[proposer]
    batched, _ = record_run(pair, requests, references, BATCH)
    # not vacuous: several steps per request, a full batch, slots that changed hands
    assert len(alone.proposals) > 2 * REQUESTS
    assert max(batched.batch_sizes) == BATCH
    assert any(len(held) > 1 for held in batched.occupants.values())
    assert_draft_batch_invariant(alone, batched, committed, f"{pair.name}, {proposer}")


ACCEPTANCE_FAULTS = (
    "draft_context_from_next_row",
    "draft_block_sees_padding",
    "dflash2_conv_across_rows",
    "draft_context_at_chunk_positions",
)
CATCHES = (
    *ACCEPTANCE_FAULTS,
    "plain_step_without_draft_context",
    "deferred_context_one_position_late",
    "deferred_group_from_first_start",
)


@pytest.mark.parametrize("fault", ACCEPTANCE_FAULTS)
def test_draft_invariance_gate_catches_faults_that_cost_only_acceptance(
    pair: Pair, alone_runs, fault: str
) -> None:
    if fault.startswith("dflash2") and not pair.draft.config.is_dflash2:
        pytest.skip(f"{pair.name}: {fault} is a DFlash2 draft's fault")
    requests, references, alone, committed = alone_runs["draft"]
    with planted(fault):
        batched, streamed = record_run(pair, requests, references, BATCH)
    assert_batch_equivalent(streamed, references, fault)  # output equality cannot see it
    with pytest.raises(AssertionError, match="differs in the batch"):
        assert_draft_batch_invariant(alone, batched, committed, fault)


# verify width auto on costs where a plain step (width 0) pays from 5 rows up (5 to 8 rows
# read the 8-row costs) and never below: the full batch runs plain steps, and its rows draft
# again as the batch empties
PLAIN_PAYS_WIDE = StepCosts(
    {
        (rows, w): s
        for rows in (1, 2, 4, 8, 16)
        for w, s in ((0, 0.2 if rows >= 8 else 10.0), (1, 1.0), (3, 1.6), (7, 3.5))
    },
    measured=True,
)


def test_plain_steps_hand_the_draft_the_context_a_speculative_step_would(pair: Pair, alone_runs) -> None:
    """A speculative request's plain steps (verify width 0: no draft, the anchor verified
    alone) must leave the draft the context features its speculative steps would have: the
    steps it drafts afterwards, from any output position both runs drafted at, propose what
    the request proposed alone, and every position those steps read holds the same features
    (a request that ends before it drafts again never needs, nor writes, its last plain
    steps' context)."""
    requests, references, alone, committed = alone_runs["draft"]
    widths: Counter = Counter()
    batched, streamed = record_run(pair, requests, references, BATCH, PLAIN_PAYS_WIDE, widths)
    assert_batch_equivalent(streamed, references, "plain steps among speculative ones")
    assert widths[0] > 0 and sum(n for w, n in widths.items() if w > 0) > 0, widths
    shared = set(alone.proposals) & set(batched.proposals)
    assert len(shared) > 5  # not vacuous: steps drafted after plain ones compared (11 here)
    compared = assert_draft_batch_invariant(alone, batched, committed, "after plain steps", every_step=False)
    assert compared > 100, compared  # not vacuous: the context positions the batch's drafts read


def plain_runs_then_a_draft(pair: Pair, alone_runs, fault: str | None = None) -> tuple[int, list]:
    """The draft workload with every fifth step drafted (width 3) and the others plain, so
    that each drafted step appends the context that rows admitted together (prompts of
    different lengths) deferred over the same steps, as one group per count: returns what
    the invariance check compared and the starts of every group of that append."""
    requests, references, alone, committed = alone_runs["draft"]
    steps = iter(range(10**6))
    groups: list[list[int]] = []

    def choose(self, limits, counters, totals):
        return 3 if next(steps) % 5 == 4 else 0

    def recorded(flush):
        def flush_context(self, seqs, only=False):
            counts: dict[int, list[int]] = {}
            for seq in seqs:
                entry = self.deferred.get(id(seq))
                if entry is not None:
                    counts.setdefault(len(entry.features), []).append(entry.first)
            groups.extend(counts.values())
            return flush(self, seqs, only)

        return flush_context

    with (
        planted(fault),
        hooked(
            (VerifyWidth, "choose", lambda correct: choose),
            (SpeculativeStep, "flush_context", recorded),
        ),
    ):
        batched, streamed = record_run(pair, requests, references, BATCH)
    assert_batch_equivalent(streamed, references, "plain runs then a draft")
    compared = assert_draft_batch_invariant(
        alone, batched, committed, "plain runs then a draft", every_step=False
    )
    return compared, groups


def test_rows_that_deferred_together_get_their_own_context(pair: Pair, alone_runs) -> None:
    """Rows whose plain steps deferred as many positions (admitted together, prompts of
    different lengths) have their context appended in one batch: each at its own positions."""
    compared, groups = plain_runs_then_a_draft(pair, alone_runs)
    assert compared > 100, compared
    # not vacuous: appends of several rows with as many positions from different starts
    assert any(len(set(starts)) > 1 for starts in groups), groups


def test_draft_invariance_gate_catches_a_deferred_group_written_from_one_start(
    pair: Pair, alone_runs
) -> None:
    with pytest.raises(AssertionError, match="differs in the batch"):
        plain_runs_then_a_draft(pair, alone_runs, "deferred_group_from_first_start")


@pytest.mark.parametrize("fault", ["plain_step_without_draft_context", "deferred_context_one_position_late"])
def test_draft_invariance_gate_catches_plain_steps_that_drop_the_drafts_context(
    pair: Pair, alone_runs, fault: str
) -> None:
    requests, references, alone, committed = alone_runs["draft"]
    with planted(fault):
        batched, streamed = record_run(pair, requests, references, BATCH, PLAIN_PAYS_WIDE)
    assert_batch_equivalent(streamed, references, fault)
    with pytest.raises(AssertionError, match="differs in the batch"):
        assert_draft_batch_invariant(alone, batched, committed, fault, every_step=False)
