"""Gate: exact ties in a DFlash2 draft's candidate selector are broken by the rule of
docs/dflash2.md on every path: the candidates keep the lowest ids among logits tied at the
K-th value, and the walk takes the lowest index among equal edge scores, which is the lowest
id (candidates ascend by id). vLLM #42960 is an exact tie broken one way by one path and the
other way by another; the selector has two tie points of its own, and a path that breaks
either the other way costs acceptance only (the target verifies every proposal), so output
equality cannot see it. This gate looks at what the selector chose.

The checkpoint: a tiny dense target whose output head repeats rows 0..CLASS twice more, so
tokens v, v + CLASS and v + 2 * CLASS have equal logits everywhere (a "class"), and a DFlash2
draft (which borrows that head) whose predecessor and successor codebooks repeat the same
way. Every draft slot's logits then come in threes, and the K = 8 best are two whole classes
and two tokens of a third: the K-th value is a three-way tie of which the candidates keep
two. Every edge into a candidate equals the edges into the rest of its class, so at every
slot the walk's best edge is an exact tie of two or three candidates. The rule keeps the
lowest ids and walks to the lowest; a wrong rule picks an id no right answer holds. It is
loaded in float64 on the CPU (the kernels' reference path), and the gate asserts that every
tie it relies on is there.

The paths: the speculative engine with the draft's own proposals, each prompt alone and all
in one batch, and with scheduled proposals that make the verify decide at every block
position. What must hold: every draft slot's candidates and walk follow the rule; each
request's proposals (its path and candidates, per output position) are the same alone and
batched; the output is the lowest-id greedy output, computed here by full forwards. The
engine runs eagerly on the CPU; the GPU tier (test_exact_gpu_dflash2.py) holds CUDA graph
replays to the eager forward's bits.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reference_engine.checkpoint import load_draft, load_target, write_safetensors
from reference_engine.checkpoint.synthetic import make_tiny_draft, make_tiny_target
from reference_engine.models import CausalLM
from reference_engine.models.dflash2 import DFlash2Draft
from reference_engine.runtime.decode import new_state, prefill
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.speculative_step import SpeculativeStep

from .checks import EngineRequest, run_engine
from .faults import planted
from .hooks import hooked

VOCAB = 384
CLASS = VOCAB // 3  # tokens v, v + CLASS, v + 2 * CLASS share v's head and codebook rows
COPIES = 3
BLOCK_SIZE = 8
MAX_TOKENS = 18
PREFILL_CHUNK = 16  # the 40-token prompt prefills in three chunks
PROMPTS = ((3,), (17, 40, 99, 5, 50, 31, 8), tuple(range(1, 81, 2)), (120, 7, 7, 64))
SCHEDULE = (7, 0, 3, 7, 1, 5)  # accepted per step: the verify decides at every block position
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


@dataclass(frozen=True)
class SelectorTiePair:
    target: CausalLM
    draft: DFlash2Draft
    expected: dict[tuple[int, ...], list[int]]  # prompt -> the lowest-id greedy output


def repeat_classes(tensors: dict[str, torch.Tensor], names: tuple[str, ...]) -> None:
    """Make rows CLASS.. of each named [vocab, ...] tensor copies of rows ..CLASS."""
    for name in names:
        rows = tensors[name]
        for copy in range(1, COPIES):
            rows[copy * CLASS : (copy + 1) * CLASS] = rows[:CLASS]


def write_tie_pair(target_dir: Path, draft_dir: Path) -> None:
    make_tiny_target(target_dir, arch="qwen3", vocab=VOCAB, seed=11, with_tokenizer=False)
    tensors = load_file(target_dir / "model.safetensors")
    repeat_classes(tensors, ("lm_head.weight",))
    write_safetensors(target_dir, tensors)
    make_tiny_draft(draft_dir, target_dir, block_size=BLOCK_SIZE, seed=3, arch="dflash2")
    tensors = load_file(draft_dir / "model.safetensors")
    repeat_classes(tensors, CODEBOOKS)
    write_safetensors(draft_dir, tensors)


def lowest_id_output(target: CausalLM, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """Greedy by the rule written out, one full forward per token; asserts that every step's
    maximum is an exact tie among exactly one class."""
    ids, out = list(prompt), []
    for step in range(max_tokens):
        logits, _ = prefill(target, new_state(target, len(ids)), 0, ids)  # [vocab]
        best = (logits == logits.max()).nonzero().flatten().tolist()
        assert best == [best[0] + c * CLASS for c in range(COPIES)], (
            f"step {step} after {len(prompt)} prompt tokens: the maximum is at ids {best}, not one "
            f"class v, v + {CLASS}, v + {2 * CLASS}; the tie checkpoint is not what it claims"
        )
        out.append(best[0])
        ids.append(best[0])
    return out


_built: list[SelectorTiePair] = []


def selector_tie_pair(tmp_path_factory: pytest.TempPathFactory) -> SelectorTiePair:
    """The tie pair, written, loaded and decoded once per session."""
    if not _built:
        target_dir = tmp_path_factory.mktemp("dflash2_ties")
        draft_dir = tmp_path_factory.mktemp("dflash2_ties_draft")
        write_tie_pair(target_dir, draft_dir)
        target = load_target(target_dir, dtype=torch.float64)
        draft = load_draft(draft_dir, target)
        assert isinstance(draft, DFlash2Draft), type(draft)
        expected = {p: lowest_id_output(target, p, MAX_TOKENS) for p in PROMPTS}
        _built.append(SelectorTiePair(target, draft, expected))
    return _built[0]


# ------------------------------------------------------------------ the runs
@dataclass(frozen=True)
class Drafted:
    """One request's draft slots at one step: its n real slots."""

    logits: torch.Tensor  # [n, vocab] the selector's unary scores
    candidates: torch.Tensor  # [n, K]
    edges: torch.Tensor  # [n, K, K] edge(p -> c)
    tokens: list[int]  # the greedy walk's path, n ids


@dataclass
class Run:
    # (request, output position at the step) -> what the draft chose there
    drafted: dict[tuple[str, int], Drafted] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # request -> streamed output
    batch_sizes: list[int] = field(default_factory=list)  # rows of each draft forward


def recording(run: Run) -> AbstractContextManager[None]:
    """Hooks that fill `run.drafted` from each draft forward's selector outputs."""
    last: list[tuple[torch.Tensor, ...]] = []

    def proposals(correct):
        def wrapped(self, *args, **kwargs):
            out = correct(self, *args, **kwargs)
            last[:] = [out]
            return out

        return wrapped

    def propose(correct):
        def wrapped(self, rows):
            out = correct(self, rows)
            logits, tokens, candidates, edges = last[0]
            run.batch_sizes.append(len(rows.seqs))
            for i, seq in enumerate(rows.seqs):
                n = rows.n[i]  # the row's real slots; the rest is padding
                run.drafted[(seq.request_id, len(seq.output_ids))] = Drafted(
                    logits[i, :n].clone(),
                    candidates[i, :n].clone(),
                    edges[i, :n].clone(),
                    tokens[i, :n].tolist(),
                )
            return out

        return wrapped

    return hooked((DFlash2Draft, "proposals", proposals), (SpeculativeStep, "propose", propose))


def run_engine_on(pair: SelectorTiePair, prompts: list[int], schedule: tuple[int, ...] | None) -> Run:
    """The prompts (indices into PROMPTS, which name the requests) in one continuous batch."""
    engine = Engine(
        pair.target,
        pair.draft,
        EngineConfig(
            max_num_seqs=len(prompts), block_size=BLOCK_SIZE, prefill_chunk=PREFILL_CHUNK, enforce_eager=True
        ),
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [EngineRequest(str(p), PROMPTS[p], params, 0, schedule) for p in prompts]
    references = {str(p): pair.expected[PROMPTS[p]] for p in prompts}
    run = Run()
    with recording(run):
        run.outputs = run_engine(engine, requests, references)
    return run


def merged(runs: list[Run]) -> Run:
    out = Run()
    for run in runs:
        out.drafted.update(run.drafted)
        out.outputs.update(run.outputs)
        out.batch_sizes.extend(run.batch_sizes)
    return out


@dataclass(frozen=True)
class Paths:
    """Each path's run: the draft's own proposals and the scheduled ones, alone and batched."""

    alone: Run
    batched: Run
    verify_alone: Run
    verify_batched: Run


def run_paths(pair: SelectorTiePair) -> Paths:
    every = list(range(len(PROMPTS)))
    return Paths(
        merged([run_engine_on(pair, [p], None) for p in every]),
        run_engine_on(pair, every, None),
        merged([run_engine_on(pair, [p], SCHEDULE) for p in every]),
        run_engine_on(pair, every, SCHEDULE),
    )


# ------------------------------------------------------------------ the checks
def expected_candidates(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k best ids per row by (logit descending, id ascending), sorted by id."""
    ranked = torch.sort(logits, dim=-1, descending=True, stable=True).indices
    return ranked[..., :k].sort(dim=-1).values


def assert_candidates_follow_the_rule(pair: SelectorTiePair, paths: Paths) -> None:
    """Every slot's K-th value is tied across the candidates' edge (more tokens hold it than
    the candidates take), and the candidates are the lowest ids among that tie."""
    k = pair.draft.config.selector_top_k
    for where, run in (("alone", paths.alone), ("batched", paths.batched)):
        for (request, position), d in sorted(run.drafted.items()):
            kth = d.logits.topk(k, dim=-1).values[:, -1:]  # [n, 1]
            held, taken = (d.logits == kth).sum(-1), (d.logits.gather(-1, d.candidates) == kth).sum(-1)
            assert (held > taken).all(), (
                f"{where}, request {request} at output position {position}: a slot's K-th value is "
                f"not a tie across the candidates' edge; the tie checkpoint is not what it claims"
            )
            rule = expected_candidates(d.logits, k)
            for j in range(len(d.tokens)):
                if not torch.equal(d.candidates[j], rule[j]):
                    extra = sorted(set(d.candidates[j].tolist()) - set(rule[j].tolist()))
                    raise AssertionError(
                        f"{where}, request {request} at output position {position}, slot {j + 1}: "
                        f"the candidates hold ids {extra} of the tie at the K-th value, the rule keeps "
                        f"{sorted(set(rule[j].tolist()) - set(d.candidates[j].tolist()))} (lowest ids)"
                    )


def assert_walk_follows_the_rule(pair: SelectorTiePair, paths: Paths) -> None:
    """At every slot the best edge from the candidate chosen before is an exact tie of two or
    more candidates, and the walk takes the lowest index of it, the lowest id."""
    for where, run in (("alone", paths.alone), ("batched", paths.batched)):
        for (request, position), d in sorted(run.drafted.items()):
            previous = 0  # slot 1's predecessors are all the anchor
            for j, token in enumerate(d.tokens):
                row = d.edges[j, previous]  # [K]
                tied = (row == row.max()).nonzero().flatten().tolist()
                ids = d.candidates[j, tied].tolist()
                assert len(tied) >= 2, (
                    f"{where}, request {request} at output position {position}, slot {j + 1}: the "
                    f"best edge is candidate {ids} alone, no tie; the tie checkpoint is not what it claims"
                )
                if token != ids[0]:
                    raise AssertionError(
                        f"{where}, request {request} at output position {position}, slot {j + 1}: the "
                        f"walk proposes {token} of the exact tie of edges among ids {ids}, the rule "
                        f"takes the lowest, {ids[0]}"
                    )
                previous = tied[0]


def assert_proposals_alone_equal_batched(pair: SelectorTiePair, paths: Paths) -> None:
    """Every step a request drafted alone it drafted in the batch from the same output
    position, with the same candidates and path."""
    assert max(paths.batched.batch_sizes) == len(PROMPTS)
    for key, d in sorted(paths.alone.drafted.items()):
        request, position = key
        got = paths.batched.drafted.get(key)
        if got is None:
            raise AssertionError(
                f"request {request} drafted at output position {position} alone but not in the batch"
            )
        if got.tokens != d.tokens or not torch.equal(got.candidates, d.candidates):
            j = next(
                (j for j, (a, b) in enumerate(zip(got.candidates, d.candidates)) if not torch.equal(a, b)), 0
            )
            raise AssertionError(
                f"request {request}'s proposals at output position {position} differ in the batch: "
                f"path {got.tokens} vs {d.tokens} alone; slot {j + 1}'s candidates "
                f"{got.candidates[j].tolist()} vs {d.candidates[j].tolist()} alone"
            )


def assert_outputs_lowest(pair: SelectorTiePair, runs: dict[str, Run]) -> None:
    for where, run in runs.items():
        for request, got in sorted(run.outputs.items()):
            expected = pair.expected[PROMPTS[int(request)]]
            if got != expected:
                i = next(
                    (j for j, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected))
                )
                raise AssertionError(
                    f"{where}, request {request}: output token {i} is "
                    f"{got[i] if i < len(got) else 'missing'}, plain greedy's (the lowest id of the "
                    f"tie) is {expected[i] if i < len(expected) else 'none'}"
                )


def assert_output_is_plain_greedy(pair: SelectorTiePair, paths: Paths) -> None:
    assert_outputs_lowest(pair, {"alone": paths.alone, "batched": paths.batched})


def assert_verify_takes_the_lowest_id(pair: SelectorTiePair, paths: Paths) -> None:
    assert_outputs_lowest(pair, {"alone": paths.verify_alone, "batched": paths.verify_batched})


CHECKS: dict[str, Callable[[SelectorTiePair, Paths], None]] = {
    "the candidates": assert_candidates_follow_the_rule,
    "the walk": assert_walk_follows_the_rule,
    "alone and batched": assert_proposals_alone_equal_batched,
    "output == plain greedy": assert_output_is_plain_greedy,
    "the verify": assert_verify_takes_the_lowest_id,
}


def assert_selector_ties_follow_the_rule(pair: SelectorTiePair, paths: Paths) -> None:
    """Run every check; one AssertionError naming each check that failed."""
    failures = []
    for name, check in CHECKS.items():
        try:
            check(pair, paths)
        except AssertionError as exc:
            failures.append(f"[{name}] {exc}")
    if failures:
        raise AssertionError("DFlash2 selector ties broken against the rule:\n" + "\n".join(failures))


# ------------------------------------------------------------------ the gate
@pytest.fixture(scope="module")
def selector_pair(tmp_path_factory) -> SelectorTiePair:
    return selector_tie_pair(tmp_path_factory)


@pytest.fixture(scope="module")
def paths(selector_pair: SelectorTiePair) -> Paths:
    return run_paths(selector_pair)


def test_the_checkpoint_repeats_every_selector_input_in_classes_of_three(
    selector_pair: SelectorTiePair,
) -> None:
    head = selector_pair.target.lm_head_weight  # [vocab, hidden]
    selector = selector_pair.draft.candidate_selector
    for rows in (head, selector.predecessor_codebook, selector.successor_codebook):
        for copy in range(1, COPIES):
            assert torch.equal(rows[copy * CLASS : (copy + 1) * CLASS], rows[:CLASS])
    k = selector_pair.draft.config.selector_top_k
    assert k % COPIES != 0, f"K = {k} takes whole classes: no tie at the K-th value"
    # lowest_id_output asserted a class tie at every step; the copies never appear
    assert all(len(out) == MAX_TOKENS and max(out) < CLASS for out in selector_pair.expected.values())


def test_the_candidates_keep_the_lowest_ids_of_the_tie_at_the_kth_value(
    selector_pair: SelectorTiePair, paths: Paths
) -> None:
    assert_candidates_follow_the_rule(selector_pair, paths)


def test_the_walk_takes_the_lowest_id_of_every_exact_tie_of_edges(
    selector_pair: SelectorTiePair, paths: Paths
) -> None:
    assert len(paths.alone.drafted) > 2 * len(PROMPTS)
    assert_walk_follows_the_rule(selector_pair, paths)


def test_a_requests_candidates_and_path_are_the_same_alone_and_batched(
    selector_pair: SelectorTiePair, paths: Paths
) -> None:
    assert_proposals_alone_equal_batched(selector_pair, paths)


def test_speculative_output_is_the_lowest_id_greedy_output_alone_and_batched(
    selector_pair: SelectorTiePair, paths: Paths
) -> None:
    assert_output_is_plain_greedy(selector_pair, paths)


def test_the_verify_takes_the_lowest_id_at_every_block_position_alone_and_batched(
    selector_pair: SelectorTiePair, paths: Paths
) -> None:
    assert_verify_takes_the_lowest_id(selector_pair, paths)


CATCHES = ("dflash2_top_k_highest_on_tie_in_batches", "dflash2_walk_last_on_tie")
CAUGHT_BY = {  # each fault, and exactly the checks that see it (the output cannot: lossless)
    # alone the candidates are right; batched they differ from the rule and from alone
    "dflash2_top_k_highest_on_tie_in_batches": {"the candidates", "alone and batched"},
    # the same wrong choice on every path: only the rule sees it
    "dflash2_walk_last_on_tie": {"the walk"},
}


@pytest.mark.parametrize("fault", CATCHES)
def test_the_gate_catches_a_selector_that_breaks_exact_ties_against_the_rule(
    selector_pair: SelectorTiePair, fault: str
) -> None:
    with planted(fault):
        paths = run_paths(selector_pair)
    with pytest.raises(AssertionError) as caught:
        assert_selector_ties_follow_the_rule(selector_pair, paths)
    named = {name for name in CHECKS if f"[{name}]" in str(caught.value)}
    assert named == CAUGHT_BY[fault], str(caught.value)
