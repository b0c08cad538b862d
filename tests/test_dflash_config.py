"""Parsing z-lab DFlash draft configs into DraftConfig (config/draft.py): where each field is
read from, its defaults, range checks, the draft/target compatibility check, and that a
loaded draft's logits honour output_multiplier and final_logit_softcapping."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from reference_engine.bench.shapes import TARGET_SHAPES
from reference_engine.checkpoint import load_draft, load_target
from reference_engine.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DraftConfig,
    TargetConfig,
    published_target_layer_ids,
)
from reference_engine.errors import ConfigError
from reference_engine.models import CausalLM

F, S = FULL_ATTENTION, SLIDING_ATTENTION
TinyCheckpoint = Callable[..., Path]
TinyPair = Callable[..., tuple[Path, Path]]

# shaped like z-lab's Qwen3-8B DFlash draft (block 16, 5 layers over a 36-layer target)
DRAFT_RAW: dict[str, Any] = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "max_position_embeddings": 40960,
    "num_target_layers": 36,
    "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
}
TARGET = TargetConfig.from_hf(TARGET_SHAPES["qwen3-8b"])  # 36 layers, hidden 4096


def draft_raw(
    dflash: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    drop_dflash: tuple[str, ...] = (),
    **changes: Any,
) -> dict[str, Any]:
    """DRAFT_RAW with top-level `changes`, dflash_config entries updated by `dflash`, and
    the named top-level / dflash_config keys removed."""
    raw = copy.deepcopy(DRAFT_RAW)
    raw["dflash_config"].update(dflash or {})
    for key in drop_dflash:
        del raw["dflash_config"][key]
    for key in drop:
        del raw[key]
    raw.update(changes)
    return raw


def test_the_published_draft_config_parses() -> None:
    config = DraftConfig.from_hf(DRAFT_RAW)
    assert config.block_size == 16
    assert config.mask_token_id == 151669
    assert config.target_layer_ids == (1, 9, 17, 25, 33)
    assert config.num_features == 5
    assert config.layer_types == (F,) * 5
    assert (config.input_embedding_scale, config.output_multiplier) == (1.0, 1.0)
    assert config.final_logit_softcapping is None
    assert config.sliding_window is None
    config.check_target(TARGET)


# ----------------------------------------------------------------------------- target layers
def test_target_layer_ids_are_read_from_dflash_config() -> None:
    raw = draft_raw(dflash={"target_layer_ids": [2, 10, 18, 26, 34]}, target_layer_ids=[0, 1])
    assert DraftConfig.from_hf(raw).target_layer_ids == (2, 10, 18, 26, 34)


def test_target_layer_ids_are_read_from_the_top_level_without_a_dflash_entry() -> None:
    raw = draft_raw(drop_dflash=("target_layer_ids",), target_layer_ids=[3, 6, 9, 12, 15])
    assert DraftConfig.from_hf(raw).target_layer_ids == (3, 6, 9, 12, 15)


def test_without_target_layer_ids_the_published_spread_is_used() -> None:
    config = DraftConfig.from_hf(draft_raw(drop_dflash=("target_layer_ids",)))
    assert config.target_layer_ids == published_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    one = DraftConfig.from_hf(
        draft_raw(drop_dflash=("target_layer_ids",), num_hidden_layers=1, num_target_layers=28)
    )
    assert one.target_layer_ids == (14,)


@pytest.mark.parametrize(
    ("num_target", "num_draft", "expected"),
    [(36, 5, (1, 9, 17, 25, 33)), (28, 1, (14,)), (36, 1, (18,)), (28, 3, (1, 13, 25)), (36, 2, (1, 33))],
)
def test_published_target_layer_ids_spread_over_1_to_n_minus_3(
    num_target: int, num_draft: int, expected: tuple[int, ...]
) -> None:
    assert published_target_layer_ids(num_target, num_draft) == expected


# ----------------------------------------------------------------------------- other fields
def test_a_llama_draft_reads_llama3_rope_scaling_and_rotates_as_its_target() -> None:
    """z-lab's Llama 3.1 drafts carry the target's llama3 RoPE scaling; the draft's rotary
    frequencies then equal the target's."""
    from reference_engine.models.base import target_rotary
    from reference_engine.models.dflash import DFlashDraft

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    raw = {**copy.deepcopy(DRAFT_RAW), "rope_theta": 500000.0, "rope_scaling": scaling}
    raw.update(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    raw.update(num_key_value_heads=2, head_dim=16, vocab_size=256)
    raw["dflash_config"] = {"mask_token_id": 255, "target_layer_ids": [1]}
    config = DraftConfig.from_hf(raw)
    assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0
    target = TargetConfig.from_hf(
        {**TARGET_SHAPES["llama3.1-8b"], "head_dim": 16, "rope_scaling": scaling, "rope_theta": 500000.0}
    )
    draft_freq = DFlashDraft(config).rotary.inv_freq
    assert torch.equal(draft_freq, target_rotary(target).inv_freq.to(draft_freq.dtype))
    plain = DFlashDraft(DraftConfig.from_hf({**raw, "rope_scaling": None})).rotary.inv_freq
    assert not torch.equal(plain, draft_freq)  # the scaling is applied, not only parsed


def test_mask_token_id_in_dflash_config_wins_over_the_top_level() -> None:
    raw = draft_raw(mask_token_id=151670)
    assert DraftConfig.from_hf(raw).mask_token_id == 151669


def test_mask_token_id_is_read_from_the_top_level_without_a_dflash_entry() -> None:
    raw = draft_raw(drop_dflash=("mask_token_id",), mask_token_id=151670)
    assert DraftConfig.from_hf(raw).mask_token_id == 151670


def test_a_draft_without_mask_token_id_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"no mask_token_id \(in dflash_config or top level\)"):
        DraftConfig.from_hf(draft_raw(drop_dflash=("mask_token_id",)))


@pytest.mark.parametrize(
    ("dflash", "top", "expected"),
    [({"block_size": 8}, 16, 8), ({}, 10, 10), ({}, None, 16)],
    ids=["dflash_config", "top-level", "default"],
)
def test_block_size_comes_from_dflash_config_then_top_level_then_16(
    dflash: dict[str, Any], top: int | None, expected: int
) -> None:
    raw = draft_raw(dflash=dflash, drop=("block_size",))
    if top is not None:
        raw["block_size"] = top
    assert DraftConfig.from_hf(raw).block_size == expected


def test_embedding_scale_output_multiplier_and_softcapping_are_parsed() -> None:
    nested = DraftConfig.from_hf(
        draft_raw(
            dflash={"input_embedding_scale": 2.0, "output_multiplier": 0.5},
            input_embedding_scale=9.0,
            output_multiplier=9.0,
            final_logit_softcapping=30,
        )
    )
    assert nested.input_embedding_scale == 2.0
    assert nested.output_multiplier == 0.5
    assert nested.final_logit_softcapping == 30.0
    top = DraftConfig.from_hf(draft_raw(input_embedding_scale=3.0, output_multiplier=0.25))
    assert (top.input_embedding_scale, top.output_multiplier) == (3.0, 0.25)


def test_sliding_window_is_kept_only_with_a_sliding_attention_layer_and_use_sliding_window() -> None:
    """As z-lab's DFlashDraftModel reads its config (a Qwen3Config): the window only with
    use_sliding_window, and only where a layer slides; without layer_types, layers from
    max_window_layers on slide."""
    on = {"use_sliding_window": True, "sliding_window": 2048}
    sliding = DraftConfig.from_hf(draft_raw(layer_types=[S, F, S, F, F], **on))
    assert sliding.layer_types == (S, F, S, F, F)
    assert sliding.sliding_window == 2048
    off = DraftConfig.from_hf(draft_raw(layer_types=[S, F, S, F, F], sliding_window=2048))
    assert off.layer_types == (S, F, S, F, F) and off.sliding_window is None
    full = DraftConfig.from_hf(draft_raw(layer_types=[F] * 5, **on))
    assert full.sliding_window is None
    default = DraftConfig.from_hf(draft_raw(sliding_window=2048))
    assert default.layer_types == (F,) * 5 and default.sliding_window is None
    derived = DraftConfig.from_hf(draft_raw(max_window_layers=3, **on))
    assert derived.layer_types == (F, F, F, S, S) and derived.sliding_window == 2048


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("raw", "pattern"),
    [
        (
            draft_raw(architectures=["Qwen3ForCausalLM"]),
            r"not a DFlash draft: architectures \['Qwen3ForCausalLM'\] does not name DFlashDraftModel",
        ),
        (draft_raw(drop=("architectures",)), r"not a DFlash draft: architectures None"),
        (draft_raw(dflash={"block_size": 1}), r"block_size must be >= 2, got 1"),
        (draft_raw(drop=("block_size",), block_size=1), r"block_size must be >= 2, got 1"),
        (draft_raw(dflash={"block_size": 0}), r"'block_size' must be a positive integer, got 0"),
        (
            draft_raw(dflash={"mask_token_id": 151936}),
            r"mask_token_id 151936 outside the vocabulary \[0, 151936\)",
        ),
        (draft_raw(dflash={"mask_token_id": -1}), r"mask_token_id -1 outside the vocabulary"),
        (draft_raw(layer_types=[F, F, F]), r"layer_types has 3 entries, expected num_hidden_layers = 5"),
        (draft_raw(layer_types=[F, F, "linear_attention", F, F]), r"layer_types\[2\] = 'linear_attention'"),
        (
            draft_raw(layer_types=[S, F, F, F, F], use_sliding_window=True, sliding_window=0),
            r"sliding_window must be a positive integer \(or null: no window\), got 0",
        ),
        (
            draft_raw(num_attention_heads=12),
            r"num_attention_heads 12 is not a multiple of num_key_value_heads 8",
        ),
        (draft_raw(drop=("num_target_layers",)), r"required field 'num_target_layers' is missing"),
    ],
    ids=[
        "wrong-architecture",
        "no-architectures",
        "block-1",
        "top-level-block-1",
        "block-0",
        "mask-past-vocab",
        "negative-mask",
        "layer-types-length",
        "linear-layer",
        "zero-window",
        "heads-not-multiple",
        "no-num-target-layers",
    ],
)
def test_bad_draft_config_is_rejected_with_field_and_value(raw: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        DraftConfig.from_hf(raw)


@pytest.mark.parametrize(
    ("raw", "pattern"),
    [
        (
            draft_raw(hidden_size=2048, head_dim=64),
            r"draft hidden_size 2048 does not match the target's 4096",
        ),
        (draft_raw(vocab_size=152064), r"draft vocab_size 152064 does not match the target's 151936"),
        (
            draft_raw(dflash={"target_layer_ids": [1, 9, 17, 25, 40]}),
            r"draft target_layer_ids \[1, 9, 17, 25, 40\] out of range for a 36-layer target",
        ),
        (
            draft_raw(dflash={"target_layer_ids": [-1, 9, 17, 25, 33]}),
            r"draft target_layer_ids \[-1, 9, 17, 25, 33\] out of range for a 36-layer target",
        ),
        (
            draft_raw(num_target_layers=28, dflash={"target_layer_ids": [1, 7, 13, 19, 25]}),
            r"built for a 28-layer target \(num_target_layers\), the target has 36 layers",
        ),
    ],
    ids=["hidden", "vocab", "layer-id-past-the-end", "negative-layer-id", "num-target-layers"],
)
def test_check_target_rejects_a_draft_that_does_not_fit_the_target(raw: dict[str, Any], pattern: str) -> None:
    config = DraftConfig.from_hf(raw)
    with pytest.raises(ConfigError, match=pattern):
        config.check_target(TARGET)


# ----------------------------------------------------------------------------- loaded draft
@pytest.fixture(scope="module")
def target(tiny_checkpoint: TinyCheckpoint) -> CausalLM:
    return load_target(tiny_checkpoint("qwen3"), dtype=torch.float64)


@pytest.fixture(scope="module")
def draft_dir(tiny_pair: TinyPair) -> Path:
    """Shared: `edited_draft` copies it before changing its config."""
    return tiny_pair("qwen3", block_size=8)[1]


def edited_draft(draft_dir: Path, tmp_path: Path, **changes: Any) -> Path:
    out = tmp_path / "edited"
    shutil.copytree(draft_dir, out)
    raw = json.loads((out / "config.json").read_text())
    raw.update(changes)
    (out / "config.json").write_text(json.dumps(raw))
    return out


def test_draft_logits_are_scaled_by_output_multiplier(
    target: CausalLM, draft_dir: Path, tmp_path: Path
) -> None:
    plain = load_draft(draft_dir, target)
    scaled = load_draft(edited_draft(draft_dir, tmp_path, output_multiplier=2.5), target)
    assert scaled.config.output_multiplier == 2.5
    hidden = torch.randn(
        2, 7, target.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )  # [batch, B - 1, hidden]
    base = plain.logits(hidden, target.lm_head_weight)  # [2, 7, vocab]
    assert base.shape == (2, 7, target.config.vocab_size)
    torch.testing.assert_close(
        scaled.logits(hidden, target.lm_head_weight), 2.5 * base, rtol=1e-12, atol=1e-12
    )


def test_draft_logits_are_soft_capped_after_the_multiplier(
    target: CausalLM, draft_dir: Path, tmp_path: Path
) -> None:
    plain = load_draft(draft_dir, target)
    capped = load_draft(
        edited_draft(draft_dir, tmp_path, output_multiplier=2.5, final_logit_softcapping=3.0),
        target,
    )
    hidden = torch.randn(
        3, 5, target.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    base = plain.logits(hidden, target.lm_head_weight)
    assert (2.5 * base).abs().max() > 6.0  # the cap really bites
    got = capped.logits(hidden, target.lm_head_weight)
    torch.testing.assert_close(got, 3.0 * torch.tanh(2.5 * base / 3.0), rtol=1e-12, atol=1e-12)
    assert got.abs().max() < 3.0
    # monotone: capping never changes the draft's greedy proposal
    assert torch.equal(got.argmax(-1), base.argmax(-1))


def test_proposals_are_the_logits_and_argmax_of_block_slots_1_to_b_minus_1(
    target: CausalLM, draft_dir: Path
) -> None:
    """`DFlashDraft.proposals` takes the logits of every block position and drops the
    anchor's: what remains must be slot 1..B-1's, and the greedy tokens their argmax."""
    draft = load_draft(draft_dir, target)
    hidden = torch.randn(
        3, 8, target.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2)
    )  # [batch, B, hidden]
    logits, tokens = draft.proposals(hidden, target.lm_head_weight)
    want = draft.logits(hidden[:, 1:], target.lm_head_weight)  # [3, 7, vocab]
    assert logits.shape == want.shape and tokens.shape == (3, 7)
    torch.testing.assert_close(logits, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(tokens, want.argmax(-1))
    assert not torch.equal(tokens, draft.logits(hidden[:, :-1], target.lm_head_weight).argmax(-1))


@pytest.mark.parametrize("draft_arch", ["dflash", "dflash2"])
def test_the_proposals_of_the_first_w_slots_are_the_whole_blocks_first_w(
    tiny_pair: TinyPair, draft_arch: str
) -> None:
    """A verify of W proposals runs the draft's head over slots 1..W alone (`width`): each
    slot's logits read its own hidden state, and DFlash2's walk goes from the anchor one slot
    at a time, so the first W slots' logits, tokens (and candidates and edges) are the whole
    block's first W. A width outside 1..B-1 is refused."""
    target_dir, draft_dir = tiny_pair("qwen3", draft_arch=draft_arch)
    target = load_target(target_dir, dtype=torch.float64)
    draft = load_draft(draft_dir, target)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 8, target.config.hidden_size, dtype=torch.float64, generator=generator)
    anchors = torch.tensor([1, 2, 3])
    full = draft.proposals(hidden, target.lm_head_weight, anchors=anchors)
    assert full[1].shape == (3, 7)
    for width in (1, 3, 6, 7):
        narrow = draft.proposals(hidden, target.lm_head_weight, anchors=anchors, width=width)
        assert len(narrow) == len(full)
        assert narrow[1].shape == (3, width) and torch.equal(narrow[1], full[1][:, :width])
        for got, want in zip(narrow[:1] + narrow[2:], full[:1] + full[2:]):  # logits (and DFlash2's)
            assert got.shape[1] == width
            torch.testing.assert_close(got, want[:, :width], rtol=1e-12, atol=1e-12)
    held = []
    draft.proposals(
        hidden, target.lm_head_weight, anchors=anchors, width=2, hold=lambda x: held.append(x) or x
    )
    assert held[0].shape == (3, 3, target.config.vocab_size)  # the anchor's position and slots 1..2
    for width in (0, 8):
        with pytest.raises(ValueError, match=f"draft width {width} outside 1..7 for a block of 8"):
            draft.proposals(hidden, target.lm_head_weight, anchors=anchors, width=width)


def test_a_tiny_llama_pairs_draft_carries_its_targets_rope_scaling(tiny_pair: TinyPair) -> None:
    target_dir, draft_dir = tiny_pair("llama")
    target = load_target(target_dir, dtype=torch.float64)
    draft = load_draft(draft_dir, target)
    assert draft.config.rope_scaling == target.config.rope_scaling is not None
    assert draft.config.rope_theta == target.config.rope_theta


@pytest.mark.parametrize("value", ["5", 5.9, True])
def test_a_mask_token_id_that_is_not_a_token_id_is_refused(value) -> None:
    """`mask_token_id` is a token id: a string, a float or a boolean is a ConfigError naming
    the field, not an id made by `int()`."""
    with pytest.raises(ConfigError, match="'mask_token_id' must be a token id"):
        DraftConfig.from_hf(draft_raw(dflash={"mask_token_id": value}))


@pytest.mark.parametrize("value", [-5, -0.5, float("inf"), float("nan"), "30", True])
def test_a_final_logit_softcapping_that_is_not_a_finite_number_from_0_is_refused(value) -> None:
    """A negative cap (which tanh would turn into a cap of its size), an infinite or NaN one, a
    string or a boolean is a ConfigError naming the field; 0 and null mean no cap."""
    with pytest.raises(ConfigError, match="'final_logit_softcapping' must be a (finite )?number"):
        DraftConfig.from_hf(draft_raw(final_logit_softcapping=value))
    for none in (0, 0.0, None):
        assert DraftConfig.from_hf(draft_raw(final_logit_softcapping=none)).final_logit_softcapping is None
    assert DraftConfig.from_hf(draft_raw(final_logit_softcapping=30)).final_logit_softcapping == 30.0
