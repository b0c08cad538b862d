"""Gate: an independent oracle. z-lab's own reference loop (`dflash` 0.1.0 on PyPI,
`dflash.model.dflash_generate` with `DFlashDraftModel`, run on Hugging Face transformers)
and our engine, on the same tiny Qwen3 checkpoints, produce the same output ids, the same
per-step acceptance lengths and the same drafted tokens at every step, greedy, several
block sizes. (Their transformers path has no hybrid targets; the other gates cover ours.)
"""

from __future__ import annotations

import time

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.runtime.engine import EngineConfig
from reference_engine.runtime.one_request import generate_speculative
from reference_engine.runtime.request import SamplingParams

from .faults import planted

dflash_model = pytest.importorskip(
    "dflash.model", reason="z-lab's dflash 0.1.0 is not installed (pip install --no-deps dflash==0.1.0)"
)
transformers = pytest.importorskip("transformers")

MAX_NEW_TOKENS = 24


class RecordingDraft(dflash_model.DFlashDraftModel):
    """Their draft, recording the tokens it proposes (greedy: argmax of its logits)."""

    drafted: list[list[int]]

    def compute_logits(self, hidden, output_head):
        logits = super().compute_logits(hidden, output_head)
        self.drafted.append(logits[0].argmax(-1).tolist())
        return logits


def zlab_generate(target_dir, draft_dir, prompt: list[int], block_size: int, fault=None):
    target = transformers.Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float64)
    draft = RecordingDraft.from_pretrained(draft_dir, dtype=torch.float64)
    draft.drafted = []
    # their return_stats path times with torch.cuda.synchronize; give it a host timer here
    original = dflash_model._cuda_time
    dflash_model._cuda_time = time.perf_counter
    try:
        stats = dflash_model.dflash_generate(
            draft.eval(),
            target.eval(),
            torch.tensor([prompt]),
            MAX_NEW_TOKENS,
            None,
            block_size=block_size,
            return_stats=True,
        )
    finally:
        dflash_model._cuda_time = original
    return stats.output_ids[0, len(prompt) :].tolist(), list(stats.acceptance_lengths), draft.drafted


def ours(target_dir, draft_dir, prompt, block_size, fault=None):
    target = load_target(target_dir, dtype=torch.float64)
    draft = load_draft(draft_dir, target)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    with planted(fault):
        result = generate_speculative(target, draft, prompt, params, EngineConfig(block_size=block_size))
    return result.output_ids, result.acceptance_lengths, [list(s.drafted) for s in result.steps]


def assert_matches_zlab(target_dir, draft_dir, prompt, block_size, fault=None) -> None:
    their_ids, their_lengths, their_drafts = zlab_generate(target_dir, draft_dir, prompt, block_size)
    our_ids, our_lengths, our_drafts = ours(target_dir, draft_dir, prompt, block_size, fault)
    assert our_ids == their_ids, f"output ids differ: ours {our_ids}, z-lab {their_ids}"
    assert our_lengths == their_lengths, (
        f"acceptance lengths differ: ours {our_lengths}, z-lab {their_lengths}"
    )
    for step, (a, b) in enumerate(zip(our_drafts, their_drafts)):
        assert a == b, f"step {step}: drafted tokens differ: ours {a}, z-lab {b}"


@pytest.fixture(scope="module")
def zlab_pair(tiny_pair_dirs):
    return tiny_pair_dirs["dense"]


@pytest.mark.parametrize("block_size", (2, 4, 8, 16))
def test_output_acceptance_and_drafts_equal_zlab_reference(zlab_pair, block_size: int) -> None:
    target_dir, draft_dir = zlab_pair
    for prompt in ([5], [17, 3, 99, 250, 41, 8, 77, 120, 3, 64, 200, 13]):
        assert_matches_zlab(target_dir, draft_dir, prompt, block_size)
