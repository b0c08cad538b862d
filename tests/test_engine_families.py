"""The batched engine on every target family beyond Qwen3 / Qwen3.5 (those are test_engine.py's):
DFlash with a tiny random draft gives plain greedy decode token for token in float64, for
each request alone and for several batched together, with the draft's own proposals and
with an oracle that makes blocks accept part of their proposals."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.models import CausalLM
from reference_engine.models.dflash import DFlashDraft
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.request import SamplingParams

TinyPair = Callable[..., tuple[Path, Path]]
BLOCK_SIZE = 8
FAMILIES = ["llama", "qwen3_moe", "qwen3_5_moe"]
PROMPTS = [
    [17, 301, 5, 88, 260, 42, 7, 199, 33, 410, 2, 95, 61],
    [400, 3, 77, 120, 9],
    [250, 251, 13, 480, 66, 1, 305, 222, 18, 90, 400, 21, 7, 7, 350, 11, 64, 128, 256, 31],
]
PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: pytest.FixtureRequest, tiny_pair: TinyPair) -> tuple[CausalLM, DFlashDraft]:
    target_dir, draft_dir = tiny_pair(request.param, block_size=BLOCK_SIZE)
    target = load_target(target_dir, dtype=torch.float64)
    return target, load_draft(draft_dir, target)


def run(engine: Engine, requests: dict[str, list[int]], oracles: dict[str, OracleProposer]) -> dict:
    for rid, prompt in requests.items():
        engine.add_request(rid, prompt, PARAMS, oracle=oracles.get(rid))
    for _ in range(500):
        if not engine.has_unfinished():
            return {rid: engine.collect(rid).output_ids for rid in requests}
        engine.step()
    raise AssertionError("engine still busy after 500 steps")


def test_dflash_gives_plain_greedy_for_each_request_alone(pair: tuple[CausalLM, DFlashDraft]) -> None:
    target, draft = pair
    for prompt in PROMPTS:
        engine = Engine(target, draft, EngineConfig(max_num_seqs=1, block_size=BLOCK_SIZE))
        reference = generate_plain(target, prompt, PARAMS).output_ids
        assert run(engine, {"r": prompt}, {})["r"] == reference


def test_dflash_gives_plain_greedy_for_requests_batched_together(
    pair: tuple[CausalLM, DFlashDraft],
) -> None:
    target, draft = pair
    engine = Engine(target, draft, EngineConfig(max_num_seqs=len(PROMPTS), block_size=BLOCK_SIZE))
    outputs = run(engine, {str(i): p for i, p in enumerate(PROMPTS)}, {})
    for i, prompt in enumerate(PROMPTS):
        assert outputs[str(i)] == generate_plain(target, prompt, PARAMS).output_ids


def test_blocks_that_accept_part_of_their_proposals_stay_lossless_in_a_batch(
    pair: tuple[CausalLM, DFlashDraft],
) -> None:
    """A random draft is almost never right; an oracle makes each block accept 0 to B - 1
    proposals, so the commit of accepted tokens runs too."""
    target, draft = pair
    references = [generate_plain(target, p, PARAMS).output_ids for p in PROMPTS]
    vocab = target.config.vocab_size
    oracles = {
        str(i): OracleProposer(ref, schedule, vocab)
        for i, (ref, schedule) in enumerate(zip(references, ([7, 2, 5], [3, 0, 6], [1, 4]), strict=True))
    }
    engine = Engine(target, draft, EngineConfig(max_num_seqs=len(PROMPTS), block_size=BLOCK_SIZE))
    outputs = run(engine, {str(i): p for i, p in enumerate(PROMPTS)}, oracles)
    assert [outputs[str(i)] for i in range(len(PROMPTS))] == references
    spec = engine.stats()["spec"]
    assert spec["accepted"] > 0 and spec["mean_acceptance_length"] > 2.0, spec


@pytest.mark.parametrize("strategy", ["replay", "per_token", "recompute"])
def test_every_commit_strategy_stays_lossless_on_the_hybrid_moe_target(
    tiny_pair: TinyPair, strategy: str
) -> None:
    """The Gated DeltaNet state after a partly accepted block, kept by each strategy, with
    MoE layers between the mixers."""
    target_dir, draft_dir = tiny_pair("qwen3_5_moe", block_size=BLOCK_SIZE)
    target = load_target(target_dir, dtype=torch.float64)
    draft = load_draft(draft_dir, target)
    references = [generate_plain(target, p, PARAMS).output_ids for p in PROMPTS]
    oracles = {
        str(i): OracleProposer(ref, [5, 1, 7, 0], target.config.vocab_size)
        for i, ref in enumerate(references)
    }
    config = EngineConfig(max_num_seqs=len(PROMPTS), block_size=BLOCK_SIZE, commit_strategy=strategy)
    outputs = run(Engine(target, draft, config), {str(i): p for i, p in enumerate(PROMPTS)}, oracles)
    assert [outputs[str(i)] for i in range(len(PROMPTS))] == references
