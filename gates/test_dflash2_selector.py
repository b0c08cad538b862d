"""Gate: a DFlash2 draft's proposals in the engine are its candidate selector's, by the
specification (docs/dflash2.md), recomputed here from what the draft handed the engine:

- the candidates of each slot are the K best of its logits, the lowest ids among ties;
- each edge is <P[p] * W h, S[c]> + logit[c], p the anchor for slot 1 and slot j - 1's
  candidates after, h the slot's final hidden state (float64 here, a plain contraction);
- the greedy proposals are the walk from the anchor: the best edge from the previous
  choice, the lowest id among exact ties.

Output equality cannot see a selector fault (the target verifies every proposal); this gate
does. It runs on the DFlash2 pairs in a batch, so rows of different lengths share each draft
forward. (The convolution is checked against its definition in tests/test_dflash2.py, and
batch-invariant by gates/test_draft_batch_invariance.py.)
"""

from __future__ import annotations

import pytest
import torch

from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams

from .checks import Pair
from .faults import planted
from .hooks import hooked

BLOCK_SIZE = 8
MAX_TOKENS = 24


def record_selector(pair: Pair, fault: str | None = None) -> list[dict[str, torch.Tensor]]:
    """Every draft forward's selector inputs and outputs, over the pair's prompts in one
    batch."""
    seen: list[dict[str, torch.Tensor]] = []

    def proposals(correct):
        def wrapped(self, hidden, lm_head_weight, ops, anchors, **kwargs):
            out = correct(self, hidden, lm_head_weight, ops, anchors, **kwargs)
            logits, tokens, candidates, edges = out
            seen.append(
                dict(
                    hidden=hidden[:, 1:].clone(),
                    anchors=anchors.clone(),
                    logits=logits.clone(),
                    tokens=tokens.clone(),
                    candidates=candidates.clone(),
                    edges=edges.clone(),
                )
            )
            return out

        return wrapped

    engine = Engine(
        pair.target,
        pair.draft,
        EngineConfig(max_num_seqs=len(pair.prompts), block_size=BLOCK_SIZE, enforce_eager=True),
    )
    with planted(fault), hooked((type(pair.draft), "proposals", proposals)):
        for i, prompt in enumerate(pair.prompts):
            engine.add_request(str(i), list(prompt), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    return seen


def expected_candidates(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k best ids per row by (logit descending, id ascending), sorted by id."""
    ranked = torch.sort(logits.double(), dim=-1, descending=True, stable=True).indices
    return ranked[..., :k].sort(dim=-1).values


def expected_edges(pair: Pair, step: dict[str, torch.Tensor]) -> torch.Tensor:
    selector = pair.draft.candidate_selector
    P = selector.predecessor_codebook.double()
    S = selector.successor_codebook.double()
    W = selector.hidden_projection.weight.double()
    candidates = step["candidates"]
    K = candidates.shape[-1]
    previous = torch.cat([step["anchors"][:, None, None].expand(-1, 1, K), candidates[:, :-1]], dim=1)
    projected = step["hidden"].double() @ W.T  # [b, N, rank]
    bigram = torch.einsum("bnpr,bnr,bncr->bnpc", P[previous], projected, S[candidates])
    unary = step["logits"].double().gather(-1, candidates)
    return bigram + unary[:, :, None, :]


def expected_walk(edges: torch.Tensor, candidates: torch.Tensor) -> list[list[int]]:
    paths = []
    for b in range(edges.shape[0]):
        previous, path = 0, []
        for j in range(edges.shape[1]):
            row = edges[b, j, previous].tolist()
            previous = row.index(max(row))  # the first maximum: candidates ascend by id
            path.append(int(candidates[b, j, previous]))
        paths.append(path)
    return paths


def assert_selector_follows_the_specification(pair: Pair, seen: list[dict[str, torch.Tensor]]) -> None:
    assert len(seen) > 3 and max(s["tokens"].shape[0] for s in seen) == len(pair.prompts)
    k = pair.draft.config.selector_top_k
    for n, step in enumerate(seen):
        where = f"{pair.name}, draft forward {n}"
        if not torch.equal(step["candidates"], expected_candidates(step["logits"], k)):
            raise AssertionError(f"{where}: the selector's candidates are not the {k} best logits")
        error = float((step["edges"].double() - expected_edges(pair, step)).abs().max())
        if not error <= 1e-9:
            raise AssertionError(f"{where}: edges differ from the specification by {error:.3g}")
        if step["tokens"].tolist() != expected_walk(step["edges"].double(), step["candidates"]):
            raise AssertionError(f"{where}: the proposals are not the greedy walk from the anchor")


@pytest.fixture(scope="module")
def dflash2_pair(pair: Pair) -> Pair:
    if not pair.draft.config.is_dflash2:
        pytest.skip(f"{pair.name}: not a DFlash2 draft")
    return pair


def test_dflash2_proposals_are_the_selector_walk_over_the_specified_edges(dflash2_pair: Pair) -> None:
    assert_selector_follows_the_specification(dflash2_pair, record_selector(dflash2_pair))


CATCHES = ("dflash2_walk_ignores_predecessor",)


def test_selector_gate_catches_a_walk_that_ignores_its_predecessor(dflash2_pair: Pair) -> None:
    seen = record_selector(dflash2_pair, "dflash2_walk_ignores_predecessor")
    with pytest.raises(AssertionError, match="not the greedy walk"):
        assert_selector_follows_the_specification(dflash2_pair, seen)
