"""The lossless-sampling gate's engine run and its checks (the reference and the tests:
sampling_reference.py).

A grid cell runs one batch of sampled requests through the engine, every step's proposals
and q recorded on the way. Even requests keep the real draft's proposals: the draft's q
must be the reference distribution of its logits, and its proposals must follow q. Odd
requests take the close proposer's, so that blocks are often accepted whole and the bonus
after a full block is drawn. Then every part of the rule is checked against the reference,
and the result as a whole: each accepted proposal was kept with probability min(1, p/q),
each rejected slot's replacement follows norm(max(p - q, 0)), each bonus after a fully
accepted block follows the target's distribution after it, and every output token follows
the target's distribution after its prefix (its top-k/top-p set's last token included),
none outside that set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from reference_engine.models import CausalLM
from reference_engine.models.dflash import DFlashDraft
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.sequence import StepRecord
from reference_engine.runtime.speculative_step import SpeculativeStep
from reference_engine.runtime.verify_width import StepCosts

from .faults import planted
from .hooks import hooked
from .sampling_reference import (
    Cell,
    Draws,
    Rate,
    TargetReference,
    assert_distributed_as,
    assert_in_support,
    assert_rate,
    boundary_rate,
    reference_probabilities,
    reference_residual,
)

Q_TOLERANCE = 1e-12  # the engine's q against the reference, both float64
CLOSE_MIX = 0.3  # the close proposer's share of uniform mass in q
TESTS_PER_CELL = 6  # statistical tests `assert_sampling_lossless` runs (for Bonferroni)


class CloseProposer:
    """Proposals for the rows it owns, drawn slot by slot from q_j = (1 - CLOSE_MIX) p_j +
    CLOSE_MIX * uniform, p_j the reference target distribution after the context and the
    slots before j. Most blocks are then accepted whole (the bonus after a full block is
    drawn), while q differs from p enough, and puts mass outside the top-k/top-p set, that a
    bonus taken from q or a residual computed wrongly shows."""

    def __init__(self, reference: TargetReference, seed: int) -> None:
        self.reference = reference
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, contexts: list[list[int]], n: list[int]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Per row: n_i proposals and their q [n_i, vocab]."""
        drafted: list[list[int]] = [[] for _ in contexts]
        qs: list[list[torch.Tensor]] = [[] for _ in contexts]
        for j in range(max(n, default=0)):
            live = [i for i in range(len(contexts)) if j < n[i]]
            p = self.reference.after([contexts[i] + drafted[i] for i in live])  # [live, vocab]
            q = (1 - CLOSE_MIX) * p + CLOSE_MIX / p.shape[-1]
            tokens = torch.multinomial(q, 1, generator=self.generator)[:, 0].tolist()
            for k, i in enumerate(live):
                drafted[i].append(tokens[k])
                qs[i].append(q[k])
        return drafted, [torch.stack(q) for q in qs]


@dataclass
class Request:
    """One sampled request of a run: its tokens and its steps."""

    request_id: str
    prompt: list[int]
    output: list[int]
    steps: list[StepRecord]
    finish_reason: str | None


@dataclass
class CellRun:
    """One engine run of a grid cell: every request, and every step's proposals and q."""

    cell: Cell
    block_size: int
    max_tokens: int
    reference: TargetReference
    requests: list[Request] = field(default_factory=list)
    # (request, output position at the step) -> (proposals, their q [n, vocab])
    proposed: dict[tuple[str, int], tuple[list[int], torch.Tensor]] = field(default_factory=dict)
    draft_q: Draws = field(default_factory=Draws)  # real-draft proposals, reference q each
    q_error: float = 0.0  # largest |engine q - reference q| over the real draft's slots
    q_error_at: str = "nowhere"
    verify_widths: dict[int, int] = field(default_factory=dict)  # steps per verify width


def selector_walk_logits(
    candidates: torch.Tensor,  # [n, K]
    edges: torch.Tensor,  # [n, K, K]
    proposals: torch.Tensor,  # [n] what the engine drew
    vocab: int,
) -> torch.Tensor:
    """The scores a DFlash2 draft samples slot j from (docs/dflash2.md): the edges from the
    candidate the engine drew at slot j - 1 (the anchor's row at slot 1) on slot j's
    candidates, -inf on every other token, [n, vocab] in float64."""
    out = torch.full((len(proposals), vocab), float("-inf"), dtype=torch.float64)
    previous = 0
    for j, token in enumerate(proposals.tolist()):
        ids = candidates[j].tolist()
        out[j, ids] = edges[j, previous].double().cpu()
        previous = ids.index(token) if token in ids else 0
    return out


def run_cell(
    target: CausalLM,
    draft: DFlashDraft,
    cell: Cell,
    prompts: Sequence[Sequence[int]],
    rows: int,
    max_tokens: int,
    block_size: int,
    seed: int,
    fault: str | None = None,
    step_costs: StepCosts | None = None,
    greedy_rows: int = 0,
) -> CellRun:
    """`rows` sampled requests in one batch, the prompts in turn; even rows keep the real
    draft's proposals, odd rows take the close proposer's. Seeds are fixed. `step_costs`
    time the engine's verify widths (plain steps among them); `greedy_rows` greedy requests
    (ids g0, g1, ...) run beside the sampled ones, which alone are judged."""
    reference = TargetReference(target, cell)
    close = CloseProposer(reference, seed)
    closed = {str(i) for i in range(1, rows, 2)}
    greedy = {f"g{i}" for i in range(greedy_rows)}
    run = CellRun(cell, block_size, max_tokens, reference)
    captured: dict[str, torch.Tensor] = {}

    def record_logits(correct):
        def proposals(self, hidden, lm_head_weight, *args, **kwargs):
            out = correct(self, hidden, lm_head_weight, *args, **kwargs)
            captured["logits"] = out[0]  # [b, N, vocab]
            if len(out) > 2:  # DFlash2: the selector's candidates [b, N, K] and edges [b, N, K, K]
                captured["candidates"], captured["edges"] = out[2], out[3]
            return out

        return proposals

    def check_draft(rows_, proposals: torch.Tensor, draft_probs: list) -> None:
        logits = captured.pop("logits", None)  # [b, N, vocab]
        candidates, edges = captured.pop("candidates", None), captured.pop("edges", None)
        for i, seq in enumerate(rows_.seqs):
            if seq.request_id in closed or seq.request_id in greedy:
                continue
            n_i, where = rows_.n[i], f"request {seq.request_id} at output {len(seq.output_ids)}"
            if logits is None or draft_probs[i] is None:
                run.q_error, run.q_error_at = float("inf"), f"{where} (no draft q)"
                continue
            row = logits[i, :n_i]
            if edges is not None:
                row = selector_walk_logits(
                    candidates[i, :n_i], edges[i, :n_i], proposals[i, :n_i], row.shape[-1]
                )
            ref = reference_probabilities(row, cell)  # [n_i, vocab]
            error = float((draft_probs[i].double() - ref).abs().max())
            if not error <= run.q_error:
                run.q_error, run.q_error_at = error, where
            run.draft_q.add(ref, proposals[i, :n_i], f"{where}, slots 1..{n_i}")

    def record_and_replace(correct):
        def propose(self, rows_):
            block, proposals, draft_probs = correct(self, rows_)
            check_draft(rows_, proposals, draft_probs)
            mine = [i for i, s in enumerate(rows_.seqs) if s.request_id in closed]
            if mine:
                drafted, qs = close.propose(
                    [rows_.seqs[i].prompt_ids + rows_.seqs[i].output_ids for i in mine],
                    [min(rows_.n[i], proposals.shape[1]) for i in mine],  # a narrow step's head
                )
                for i, tokens, q in zip(mine, drafted, qs):
                    proposals[i, : len(tokens)] = torch.tensor(tokens, device=proposals.device)
                    draft_probs[i] = q.to(proposals.device)
                block[:, 1:] = proposals
            for i, seq in enumerate(rows_.seqs):
                q = draft_probs[i]
                if q is not None:
                    run.proposed[(seq.request_id, len(seq.output_ids))] = (
                        proposals[i, : rows_.n[i]].tolist(),
                        q.double().cpu(),
                    )
            return block, proposals, draft_probs

        return propose

    longest = max(len(p) for p in prompts)
    engine = Engine(
        target,
        draft,
        EngineConfig(
            max_num_seqs=rows + greedy_rows,
            block_size=block_size,
            prefill_chunk=longest,
            max_model_len=longest + (2 if greedy else 1) * max_tokens,
            enforce_eager=True,
        ),
        step_costs=step_costs,
    )
    with (
        planted(fault),
        hooked((type(draft), "proposals", record_logits), (SpeculativeStep, "propose", record_and_replace)),
    ):
        for i in range(rows):
            engine.add_request(
                str(i),
                list(prompts[i % len(prompts)]),
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=cell.temperature,
                    top_k=cell.top_k,
                    top_p=cell.top_p,
                    ignore_eos=True,
                    seed=seed * 1_000_003 + i,
                ),
            )
        for name in sorted(greedy):
            prompt = list(prompts[int(name[1:]) % len(prompts)])
            # they outlast the sampled rows, so every step of those has greedy neighbours
            engine.add_request(name, prompt, SamplingParams(max_tokens=2 * max_tokens, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    run.verify_widths = dict(engine.verify_widths)
    for i in range(rows):
        seq = engine.collect(str(i))
        run.requests.append(
            Request(str(i), list(prompts[i % len(prompts)]), seq.output_ids, seq.steps, seq.finish_reason)
        )
    return run


@dataclass
class CellDraws:
    """A run's tokens, each with its reference distribution."""

    outputs: Draws = field(default_factory=Draws)  # every output token: target after prefix
    bonuses: Draws = field(default_factory=Draws)  # after a step that accepted all it drafted
    residuals: Draws = field(default_factory=Draws)  # a rejected slot's replacement
    acceptance: Rate = field(default_factory=Rate)  # every decided proposal: min(1, p/q)
    full_blocks: int = 0  # steps that accepted a full block of B - 1


def cell_draws(run: CellRun) -> CellDraws:
    """Walk every request's steps: a step starting at output position `at` decided its
    proposals' slots up to the first rejection, the target's distribution at slot j being
    the one after output[:at + j] (the accepted proposals are those outputs)."""
    prefixes = [r.prompt + r.output[:t] for r in run.requests for t in range(len(r.output))]
    every = run.reference.after(prefixes).split([len(r.output) for r in run.requests])
    draws = CellDraws()
    for r, probs in zip(run.requests, every):  # probs: [len(output), vocab]
        draws.outputs.add(probs, r.output, f"request {r.request_id} (draw = output position)")
        # the output positions the request drafted from, in order: a drafted step each (plain
        # steps, verify width 0, draft nothing and record no step: their tokens are the
        # target's own draws, judged with every output token)
        drafted_at = sorted(at for rid, at in run.proposed if rid == r.request_id)
        if len(drafted_at) != len(r.steps):
            raise AssertionError(
                f"{run.cell}: request {r.request_id} recorded {len(r.steps)} speculative steps "
                f"but drafted {len(drafted_at)} times"
            )
        plain_steps = run.verify_widths.get(0, 0) > 0
        at = 1  # the first output token came from prefill
        for step, start in zip(r.steps, drafted_at):
            if start != at and not (plain_steps and start > at):
                raise AssertionError(
                    f"{run.cell}: request {r.request_id} committed a step at "
                    f"output {at} whose proposals were never recorded"
                )
            at = start
            drafted, q = run.proposed[(r.request_id, at)]  # q: [n, vocab]
            a, n, kept = step.accepted, step.proposed, step.acceptance_length
            if r.output[at : at + min(a, kept)] != drafted[: min(a, kept)]:
                raise AssertionError(
                    f"{run.cell}: request {r.request_id} at output {at} accepted {a} but "
                    f"committed {r.output[at : at + a]}, not its proposals {drafted[:a]}"
                )
            decided = min(a + 1, n)
            x = torch.tensor(drafted[:decided])[:, None]
            ratio = probs[at : at + decided].gather(1, x)[:, 0] / q[:decided].gather(1, x)[:, 0]
            draws.acceptance.add(ratio.clamp(max=1.0), torch.arange(decided) < a)
            if kept == a + 1:  # the token after the accepted prefix was committed
                after = at + a
                where = f"request {r.request_id} output {after}"
                if a == n:
                    draws.bonuses.add(
                        probs[after : after + 1], r.output[after : after + 1], f"{where}, a bonus"
                    )
                    draws.full_blocks += n == run.block_size - 1
                else:
                    draws.residuals.add(
                        reference_residual(probs[after], q[a])[None],
                        r.output[after : after + 1],
                        f"{where}, a replacement",
                    )
            at += kept
    return draws


def assert_sampling_lossless(run: CellRun, alpha: float, min_full_blocks: int) -> None:
    """The run's requests all completed; the real draft's q is the reference distribution
    of its logits and its proposals follow q; no output token or replacement lies outside
    its support; at least `min_full_blocks` full blocks were accepted (the bonus check is
    not vacuous); then TESTS_PER_CELL statistical tests, each at level alpha: proposals
    against q, output tokens (ranks, and their sets' last token), bonuses after fully
    accepted blocks, replacements against the residual, and the acceptance count."""
    cell = run.cell
    for r in run.requests:
        if r.finish_reason != "length" or len(r.output) != run.max_tokens:
            raise AssertionError(
                f"{cell}: request {r.request_id} ended '{r.finish_reason}' "
                f"after {len(r.output)} tokens, expected {run.max_tokens}"
            )
    if not run.q_error <= Q_TOLERANCE:
        raise AssertionError(
            f"{cell}: the draft's q differs from the reference distribution "
            f"of its logits by {run.q_error:.3g} at {run.q_error_at}"
        )
    draws = cell_draws(run)
    assert_in_support(run.draft_q, f"{cell}, draft proposals")
    assert_in_support(draws.outputs, f"{cell}, output (outside the top-k/top-p set)")
    assert_in_support(draws.residuals, f"{cell}, replacements (outside the residual)")
    if draws.full_blocks < min_full_blocks:
        raise AssertionError(
            f"{cell}: {draws.full_blocks} full blocks were accepted, fewer "
            f"than the {min_full_blocks} the bonus check needs"
        )
    assert_distributed_as(run.draft_q, f"{cell}, draft proposals against their q", alpha)
    assert_distributed_as(draws.outputs, f"{cell}, output tokens", alpha)
    assert_rate(
        boundary_rate(draws.outputs),
        f"{cell}, output tokens that are the last of their top-k/top-p set",
        alpha,
    )
    assert_distributed_as(draws.bonuses, f"{cell}, bonuses after fully accepted blocks", alpha)
    assert_distributed_as(draws.residuals, f"{cell}, replacements of rejected proposals", alpha)
    assert_rate(draws.acceptance, f"{cell}, accepted proposals", alpha)
