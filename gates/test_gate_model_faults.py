"""Gate: a target with sliding-window attention verifies a block as plain decode scores it.

The default pairs' dense target attends over its whole cache. A Qwen3 target with
`use_sliding_window` hides, in its layers from `max_window_layers` on, the keys `sliding_window`
or more positions before each query; a verify runs several queries at once after a cached
prefix, each with its own window, where a decode step runs one and a prompt's prefill starts
from position 0. Here a tiny Qwen3 with a window of 4 tokens on its last two layers, narrower
than a block of 8 and than every prompt but the shortest, runs DFlash in float64:

- speculative output equals plain greedy token for token, each prompt alone, with the real
  draft and with the oracle at mixed acceptance;
- every verified position's logits equal plain decode's at that position (1e-9), for a
  batch of staggered requests, whole blocks verified and the widths taken in turn.

Planted fault: a forward of several tokens after a cached prefix that sees one key past the
window (`sliding_window_one_wide_past_the_prefix`).
"""

from __future__ import annotations

import random

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.runtime.engine import EngineConfig
from reference_engine.runtime.request import SamplingParams

from . import test_verify_logits as verify_gate
from .checks import Pair, assert_lossless
from .faults import planted

CATCHES = ("sliding_window_one_wide_past_the_prefix",)
BLOCK = 8
WINDOW = 4
SLIDING = (("use_sliding_window", True), ("sliding_window", WINDOW), ("max_window_layers", 2))
MIXED = [7, 0, 3, 1, 5, 2]


@pytest.fixture(scope="module")
def sliding_pair(tiny_pair) -> Pair:
    target_dir, draft_dir = tiny_pair(
        "qwen3", block_size=BLOCK, draft_layers=2, draft_seed=7, layers=4, config_overrides=SLIDING
    )
    target = load_target(target_dir, dtype=torch.float64)
    assert target.config.sliding_window == WINDOW
    windows = [layer.self_attn.sliding_window for layer in target.model.layers]
    assert windows == [None, None, WINDOW, WINDOW], windows
    rng = random.Random(1234)
    prompts = tuple(
        tuple(rng.randrange(target.config.vocab_size - 16) for _ in range(n)) for n in (1, 17, 40)
    )
    return Pair("sliding-window", target, load_draft(draft_dir, target), prompts)


@pytest.mark.parametrize("schedule", [None, MIXED], ids=["draft", "oracle"])
def test_speculative_equals_plain_greedy_on_a_sliding_window_target(sliding_pair: Pair, schedule) -> None:
    params = SamplingParams(max_tokens=2 * BLOCK + BLOCK // 2 + 1, ignore_eos=True)
    for prompt in sliding_pair.prompts:
        assert_lossless(sliding_pair, prompt, params, EngineConfig(block_size=BLOCK), schedule)


@pytest.mark.parametrize("widths", ["full", "turns"])
def test_a_sliding_window_verify_scores_each_committed_position_as_plain_decode(
    sliding_pair: Pair, widths: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared = verify_gate.assert_verify_logits_are_plain_decodes(sliding_pair, "replay", widths, monkeypatch)
    assert compared >= 6 * verify_gate.MAX_TOKENS // 2


def test_the_gate_catches_a_window_one_wide_after_a_cached_prefix(
    sliding_pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (
        planted("sliding_window_one_wide_past_the_prefix"),
        pytest.raises(AssertionError, match="verify logits != plain"),
    ):
        verify_gate.assert_verify_logits_are_plain_decodes(sliding_pair, "replay", "full", monkeypatch)
