"""Contracts of the speculative step (speculative_step.py) as the engine (engine.py) runs it,
checked from outside the step on the CPU: what each row may accept and commit, what the
draft's context holds when the draft reads it, how plain steps (verify width 0) treat
sampled rows, and what the statistics count.

The verify width of each step is scripted (`ScriptedWidths`) so that drafted, narrowed and
plain steps meet rows with different remaining budgets in one batch. Targets are tiny
float64 Qwen3 and Qwen3.5 checkpoints with random DFlash drafts, loaded through the real
loader; outputs are compared with plain decode of each request alone (`generate_plain`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.models import CausalLM
from reference_engine.models.dflash import DFlashDraft, DraftState
from reference_engine.runtime.decode import generate_plain, new_state, prefill
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.speculative_step import TimingProposals
from reference_engine.runtime.stats import SpecCounters

TinyCheckpoint = Callable[..., Path]
TinyPair = Callable[..., tuple[Path, Path]]
BLOCK_SIZE = 8
PROMPTS = [
    [17, 301, 5, 88, 260, 42, 7, 199, 33, 410, 2, 95, 61],
    [400, 3, 77, 120, 9],
    [250, 251, 13, 480, 66, 1, 305, 222, 18, 90, 400, 21, 7],
]


@pytest.fixture(scope="module")
def dense(tiny_pair: TinyPair) -> tuple[CausalLM, DFlashDraft]:
    target_dir, draft_dir = tiny_pair("qwen3", block_size=BLOCK_SIZE)
    target = load_target(target_dir, dtype=torch.float64)
    return target, load_draft(draft_dir, target)


@pytest.fixture(scope="module")
def hybrid(tiny_pair: TinyPair) -> tuple[CausalLM, DFlashDraft]:
    """A Qwen3.5 (Gated DeltaNet + attention) target and its draft."""
    target_dir, draft_dir = tiny_pair("qwen3_5", block_size=BLOCK_SIZE)
    target = load_target(target_dir, dtype=torch.float64)
    return target, load_draft(draft_dir, target)


@pytest.fixture(scope="module")
def scaled(tiny_pair: TinyPair, dense: tuple[CausalLM, DFlashDraft]) -> tuple[CausalLM, DFlashDraft]:
    """The dense target with its draft as a checkpoint that scales the draft's input
    embeddings (`input_embedding_scale`, 1.0 in the tiny checkpoints)."""
    target = dense[0]
    draft = load_draft(tiny_pair("qwen3", block_size=BLOCK_SIZE)[1], target)
    draft.config = replace(draft.config, input_embedding_scale=1.5)
    return target, draft


@pytest.fixture(scope="module")
def dflash2(tiny_pair: TinyPair, dense: tuple[CausalLM, DFlashDraft]) -> tuple[CausalLM, DFlashDraft]:
    """The dense target with a DFlash2 draft (its selector reads each row's anchor)."""
    target = dense[0]
    return target, load_draft(tiny_pair("qwen3", block_size=BLOCK_SIZE, draft_arch="dflash2")[1], target)


class ScriptedWidths:
    """A verify-width policy that takes its widths from a list, in turn (the engine's
    `VerifyWidth.choose` and `reset`), so a test decides which steps draft and how much."""

    def __init__(self, widths: Sequence[int]) -> None:
        self.widths = list(widths)
        self.step = 0
        self.chosen: list[int] = []  # the width of each speculative step so far

    def choose(self, limits: Sequence[int], counters, totals: SpecCounters) -> int:
        width = self.widths[self.step % len(self.widths)]
        self.step += 1
        self.chosen.append(width)
        return width

    def reset(self) -> None:
        self.step = 0


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def engine_with_widths(
    pair: tuple[CausalLM, DFlashDraft], widths: Sequence[int], max_num_seqs: int = 3, **config
) -> Engine:
    target, draft = pair
    engine = Engine(target, draft, EngineConfig(max_num_seqs=max_num_seqs, block_size=BLOCK_SIZE, **config))
    engine.verify_width = ScriptedWidths(widths)
    return engine


def drain(engine: Engine, limit: int = 400) -> None:
    for _ in range(limit):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError(f"engine still busy after {limit} steps")


# ----------------------------------------------------------------------------- the draft's context
def context_of(target: CausalLM, draft: DFlashDraft, tokens: list[int]) -> DraftState:
    """A draft state whose slot 0 holds the context of `tokens` at positions 0.., made from one
    prefill of them: what the draft must read before it drafts after those tokens (with room
    for one block after them)."""
    layers = draft.config.target_layer_ids
    state = new_state(target, len(tokens) + 1)
    _, features = prefill(target, state, 0, tokens, capture_layers=layers)
    weight = target.model.embed_tokens.weight
    context = DraftState(draft.config, 1, len(tokens) + BLOCK_SIZE, weight.dtype, weight.device)
    positions = torch.arange(len(tokens))[None]
    draft.append_context(features[None], positions, torch.tensor([0]), context)
    return context


def proposals_alone(
    target: CausalLM, draft: DFlashDraft, context: DraftState, anchor: int, start: int, n: int
) -> list[int]:
    """The draft's greedy proposals for a block of `anchor` at `start` and n mask tokens, from
    the models alone over `context` (slot 0)."""
    block = torch.full((1, n + 1), draft.config.mask_token_id)
    block[0, 0] = anchor
    embeds = target.embed(block) * draft.config.input_embedding_scale
    positions = torch.arange(start, start + n + 1)[None]
    hidden = draft(embeds, positions, torch.tensor([0]), context, start + n + 1)
    return draft.proposals(hidden, target.lm_head_weight, anchors=block[:, 0])[1][0, :n].tolist()


def check_every_draft(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """At every draft forward of the engine's speculative step, check each row against the
    models alone: its draft context at positions 0..anchor-1 is that of a prefill of the
    row's committed tokens, and the proposals the forward returns for the row's own draft
    slots are those the draft gives from that context for the row's block alone. Returns
    the number of rows checked at each draft forward."""
    target, draft = engine.target, engine.draft
    step, runner = engine.speculative_step, engine.runner
    checked: list[int] = []
    current = {}
    propose_rows, runner_propose = step.propose, runner.propose

    def propose(rows):
        current["rows"] = rows
        return propose_rows(rows)

    def runner_propose_checked(block, positions, slots, *args, width=None, **kwargs):
        rows = current["rows"]
        contexts = []
        for seq, start in zip(rows.seqs, rows.starts):
            committed = (seq.prompt_ids + seq.output_ids)[:start]
            assert len(committed) == start, (seq.request_id, start)
            expected = context_of(target, draft, committed)
            caches = zip(engine.draft_state.k_cache, engine.draft_state.v_cache, strict=True)
            for layer, (k, v) in enumerate(caches):
                name = f"{seq.request_id}, layer {layer}"
                torch.testing.assert_close(k[seq.slot, :start], expected.k_cache[layer][0, :start], msg=name)
                torch.testing.assert_close(v[seq.slot, :start], expected.v_cache[layer][0, :start], msg=name)
            contexts.append(expected)
        drafted = runner_propose(block, positions, slots, *args, width=width, **kwargs)
        for i, (seq, start, n) in enumerate(zip(rows.seqs, rows.starts, rows.n)):
            taken = min(n, drafted.tokens.shape[1])  # a narrowed verify takes the first ones
            alone = proposals_alone(target, draft, contexts[i], seq.output_ids[-1], start, n)
            assert drafted.tokens[i, :taken].tolist() == alone[:taken], (seq.request_id, start)
        checked.append(len(rows.seqs))
        return drafted

    monkeypatch.setattr(step, "propose", propose)
    monkeypatch.setattr(runner, "propose", runner_propose_checked)
    return checked


@pytest.mark.parametrize("pair_name", ["dense", "hybrid", "scaled", "dflash2"])
def test_every_draft_reads_the_committed_context_and_proposes_what_the_draft_alone_would(
    pair_name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the steps before it were (full blocks, narrowed verifies, plain steps that
    defer their context, rows that kept different counts), when the draft runs each row's
    context at positions 0..anchor-1 is that of its prompt and committed output, as a prefill
    of those tokens gives it (nothing missing, nothing shifted, nothing from another row), and
    its proposals for the row's own draft slots are those of the row's block alone: padding
    of shorter rows is never seen, and the draft's input embedding scale is applied. Every
    step leaves each row's lengths at its anchor; the output is plain greedy decode's."""
    pair = request.getfixturevalue(pair_name)
    engine = engine_with_widths(pair, [7, 0, 0, 3, 7, 0, 1, 5, 0, 0, 0, 7, 2])
    checked = check_every_draft(engine, monkeypatch)
    budgets = [29, 11, 20]
    for i, (prompt, budget) in enumerate(zip(PROMPTS, budgets)):
        engine.add_request(f"r{i}", prompt, greedy(budget))
    for _ in range(100):
        if not engine.has_unfinished():
            break
        engine.step()
        check_lengths(engine)
    assert len(checked) >= 5 and max(checked) == 3, checked  # not vacuous
    target = pair[0]
    for i, (prompt, budget) in enumerate(zip(PROMPTS, budgets)):
        assert engine.collect(f"r{i}").output_ids == generate_plain(target, prompt, greedy(budget)).output_ids


# ----------------------------------------------------------------------------- accept and commit
class TruthBeyondTheBudget:
    """Proposes the target's own continuation in every draft slot of the block, also in the
    slots past the row's own draft tokens (the padding of a row with fewer tokens left than
    the longest row), which a lossless step must never accept."""

    forced = False

    def __init__(self, continuation: list[int], block_size: int) -> None:
        self.continuation = continuation
        self.block_size = block_size

    def scheduled(self, step: int, n: int) -> int:
        return n

    def propose(self, step: int, generated: int, n: int) -> list[int]:
        return self.continuation[generated : generated + self.block_size - 1]


def check_lengths(engine: Engine) -> None:
    """Every running speculative request's target and draft lengths sit at its anchor: its
    prompt and every output token but the last, which the next step runs."""
    for seq in engine.scheduler.running():
        if seq.output_ids and seq.pending is None:
            expected = len(seq.prompt_ids) + len(seq.output_ids) - 1
            assert engine.state.lengths[seq.slot] == expected, (seq.request_id, "target")
            assert engine.draft_state.lengths[seq.slot] == expected, (seq.request_id, "draft")


@pytest.mark.parametrize("pair_name", ["dense", "hybrid"])
def test_a_row_never_accepts_or_commits_past_its_own_draft_tokens(
    pair_name: str, request: pytest.FixtureRequest
) -> None:
    """Rows with different remaining budgets share a step: a row with fewer tokens left drafts
    fewer (n_i = min(B - 1, remaining), of a narrowed verify min(n_i, width)) and the rest of
    its block is padding. Even when the padding holds exactly the target's own continuation,
    the row accepts its n_i proposals (all of them the target's choices) and no more, its
    committed length never passes its prompt and max_tokens, and the engine's totals keep
    accepted <= proposed. The lengths after every step sit at each row's anchor, and the
    output is plain greedy decode's."""
    pair = request.getfixturevalue(pair_name)
    target = pair[0]
    engine = engine_with_widths(pair, [7, 3, 7, 5, 1])
    budgets = [3, 30, 6]
    limits = {}
    for i, (prompt, budget) in enumerate(zip(PROMPTS, budgets)):
        truth = generate_plain(target, prompt, greedy(budget + BLOCK_SIZE)).output_ids
        engine.add_request(f"r{i}", prompt, greedy(budget), oracle=TruthBeyondTheBudget(truth, BLOCK_SIZE))
        limits[f"r{i}"] = len(prompt) + budget
    lengths: list[tuple[str, int]] = []
    widths: dict[str, list[int]] = {rid: [] for rid in limits}  # each step's verify width, by request

    def observe(seq, state, length: int) -> None:
        lengths.append((seq.request_id, length))
        widths[seq.request_id].append(engine.verify_width.chosen[-1])

    engine.commit_observer = observe
    for _ in range(100):
        if not engine.has_unfinished():
            break
        engine.step()
        check_lengths(engine)
    assert lengths and all(length <= limits[rid] for rid, length in lengths), lengths
    for i, (prompt, budget) in enumerate(zip(PROMPTS, budgets)):
        seq = engine.collect(f"r{i}")
        assert seq.output_ids == generate_plain(target, prompt, greedy(budget)).output_ids
        assert seq.steps, f"r{i} never drafted"
        generated = 1  # the prefill's token
        for record, width in zip(seq.steps, widths[f"r{i}"], strict=True):
            expected = min(BLOCK_SIZE - 1, budget - generated, width)
            assert record.proposed == expected, (f"r{i}", generated, width, record)
            # every proposal is the target's own choice: the whole verified span is accepted
            assert record.accepted == record.proposed, (f"r{i}", record)
            assert len(record.drafted) == record.proposed, (f"r{i}", record)
            generated += record.acceptance_length
    spec = engine.stats()["spec"]
    assert spec["accepted"] <= spec["proposed"], spec


# ----------------------------------------------------------------------------- sampled rows
def sampled(seed: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=seed)


def run_to_end(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    drain(engine)
    return {rid: engine.collect(rid).output_ids for rid in requests}


@pytest.mark.parametrize("pair_name", ["dense", "hybrid"])
@pytest.mark.parametrize("beside_greedy", [False, True], ids=["alone", "beside-greedy"])
def test_a_sampled_row_in_plain_steps_draws_as_plain_sampling_does(
    pair_name: str, beside_greedy: bool, request: pytest.FixtureRequest
) -> None:
    """A plain step (verify width 0) of a sampled row draws its token from the target's
    distribution with the request's own generator, exactly as plain decode samples it: a
    seeded request whose steps are all plain gives the tokens of the same seed on an engine
    without a draft, alone or beside a greedy request (whose plain step may take the greedy
    shortcut, but the sampled row may not), and those tokens are not the greedy chain."""
    pair = request.getfixturevalue(pair_name)
    target = pair[0]
    requests = {"s": (PROMPTS[0], sampled(seed=11, max_tokens=12))}
    if beside_greedy:
        requests["g"] = (PROMPTS[1], greedy(12))
    plain = run_to_end(Engine(target, None, EngineConfig(max_num_seqs=2)), requests)
    speculative = run_to_end(engine_with_widths(pair, [0], max_num_seqs=2), requests)
    assert speculative == plain
    assert plain["s"] != generate_plain(target, PROMPTS[0], greedy(12)).output_ids  # not vacuous


# ----------------------------------------------------------------------------- statistics
def test_statistics_count_each_drafted_step_once_and_only_the_tokens_it_kept(
    dense: tuple[CausalLM, DFlashDraft],
) -> None:
    """The engine's verify-width counts hold one entry per speculative step; a request's step
    records and the engine's acceptance totals hold its drafted steps alone (a plain step
    verifies nothing and counts none); each record's acceptance length is what the request
    kept of the step, so a block cut at max_tokens counts only the tokens emitted, and the
    prefill's token, the plain steps' tokens and the acceptance lengths add up to the output."""
    target = dense[0]
    engine = engine_with_widths(dense, [7, 0, 3, 0, 0, 5])
    budgets = {"a": 17, "b": 9}
    widths: dict[str, list[int]] = {rid: [] for rid in budgets}
    engine.commit_observer = lambda seq, state, length: widths[seq.request_id].append(
        engine.verify_width.chosen[-1]
    )
    for (rid, budget), prompt in zip(budgets.items(), PROMPTS):
        truth = generate_plain(target, prompt, greedy(budget + BLOCK_SIZE)).output_ids
        engine.add_request(rid, prompt, greedy(budget), oracle=TruthBeyondTheBudget(truth, BLOCK_SIZE))
    drain(engine)
    stats = engine.stats()
    chosen = engine.verify_width.chosen
    assert stats["verify_widths"] == {w: chosen.count(w) for w in sorted(set(chosen))}
    records = []
    for rid, budget in budgets.items():
        seq = engine.collect(rid)
        assert len(seq.output_ids) == budget
        drafted = [w for w in widths[rid] if w > 0]
        assert len(seq.steps) == len(drafted), (rid, widths[rid], seq.steps)
        plain = len(widths[rid]) - len(drafted)
        assert 1 + plain + sum(r.acceptance_length for r in seq.steps) == budget, (rid, seq.steps)
        records += seq.steps
    assert 0 in chosen and widths["a"].count(0) >= 2  # not vacuous
    spec = stats["spec"]
    assert spec["steps"] == len(records)
    assert spec["proposed"] == sum(r.proposed for r in records)
    assert spec["accepted"] == sum(r.accepted for r in records)
    histogram = {}
    for r in records:
        histogram[r.acceptance_length] = histogram.get(r.acceptance_length, 0) + 1
    assert spec["acceptance_length_histogram"] == dict(sorted(histogram.items()))


def test_the_step_verifies_the_proposers_tokens_whatever_their_ids(
    dense: tuple[CausalLM, DFlashDraft],
) -> None:
    """A request's proposer (oracle.py) replaces the draft's tokens: every drafted step
    records exactly the proposer's tokens for its draft slots, token id 0 and the last id of
    the vocabulary included, and the output stays plain greedy decode's. The proposer is the
    step timing's (the same tokens every step)."""
    target = dense[0]
    vocab = target.config.vocab_size
    tokens = [0, vocab - 1, 0, 5, 0, vocab - 1, 0]
    engine = engine_with_widths(dense, [7, 3])
    engine.add_request("p", PROMPTS[0], greedy(14), oracle=TimingProposals(tokens))
    engine.add_request("q", PROMPTS[1], greedy(6))
    drain(engine)
    seq = engine.collect("p")
    assert seq.output_ids == generate_plain(target, PROMPTS[0], greedy(14)).output_ids
    assert len(seq.steps) >= 2
    for record in seq.steps:
        assert list(record.drafted) == tokens[: record.proposed], record


@pytest.mark.parametrize(
    "pair_name, cut",
    [("dense", {"top_k": 1}), ("dense", {"top_p": 1e-6}), ("dflash2", {"top_k": 1})],
    ids=["top_k", "top_p", "dflash2-top_k"],
)
def test_a_sampled_request_whose_cut_keeps_one_token_gives_the_greedy_output(
    pair_name: str, cut: dict, request: pytest.FixtureRequest
) -> None:
    """Speculative sampling is lossless: with a top-k or top-p that keeps only the likeliest
    token, the target's distribution at every block slot is one-hot on its greedy choice, so a
    sampled request gives plain greedy decode's output through drafted, narrowed and plain
    steps alike, whatever its draft proposes."""
    pair = request.getfixturevalue(pair_name)
    target = pair[0]
    engine = engine_with_widths(pair, [7, 3, 0, 5], max_num_seqs=2)
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=3, **cut)
    engine.add_request("s", PROMPTS[2], params)
    engine.add_request("g", PROMPTS[1], greedy(12))
    drain(engine)
    assert engine.collect("s").output_ids == generate_plain(target, PROMPTS[2], greedy(20)).output_ids
    assert engine.collect("g").output_ids == generate_plain(target, PROMPTS[1], greedy(12)).output_ids


# ----------------------------------------------------------------------------- the bare loop
@pytest.mark.parametrize("pair_name", ["dense", "hybrid"])
def test_prefill_into_a_used_slot_gives_what_a_fresh_state_gives(
    pair_name: str, request: pytest.FixtureRequest
) -> None:
    """decode.prefill runs a prompt into a fresh slot: a slot that held another request (its
    attention rows and, for a hybrid target, its recurrent state) gives the same last-position
    logits and features as a new state, and the slot's length is the prompt's."""
    target, draft = request.getfixturevalue(pair_name)
    layers = draft.config.target_layer_ids
    fresh = new_state(target, 32)
    logits, features = prefill(target, fresh, 0, PROMPTS[1], capture_layers=layers)
    used = new_state(target, 32)
    prefill(target, used, 0, PROMPTS[2], capture_layers=layers)
    again, again_features = prefill(target, used, 0, PROMPTS[1], capture_layers=layers)
    torch.testing.assert_close(again, logits)
    torch.testing.assert_close(again_features, features)
    assert used.lengths[0] == len(PROMPTS[1])


# ----------------------------------------------------------------------------- the context's end
def test_a_row_padded_past_the_end_of_its_context_stays_lossless(dense: tuple[CausalLM, DFlashDraft]) -> None:
    """A verify may run past a request's last token: a row with few tokens left is padded to
    the longest row's block, and its padding sits past the end of its context when the
    request fills the context exactly. Each slot has room for that block, so the request
    still ends with plain greedy decode's output and its neighbour is untouched."""
    target = dense[0]
    context = len(PROMPTS[0]) + 10
    engine = engine_with_widths(dense, [7], max_num_seqs=2, max_model_len=context)
    budgets = {"full": (PROMPTS[0], 10), "short": (PROMPTS[1], context - len(PROMPTS[1]))}
    for rid, (prompt, budget) in budgets.items():
        engine.add_request(rid, prompt, greedy(budget))
    drain(engine)
    for rid, (prompt, budget) in budgets.items():
        seq = engine.collect(rid)
        assert seq.finish_reason == "length", (rid, seq.finish_reason)
        assert seq.output_ids == generate_plain(target, prompt, greedy(budget)).output_ids, rid
