"""Writing tiny checkpoints in the real on-disk formats, and what the written configs read back
as: the random weights' scales by kind of tensor (the SSM's decay and step bias, the DFlash2
base kernel near the identity, (1 + w) norms of the hybrid families beside the gated norm of
the linear attention that multiplies by w, tied embeddings at 1/sqrt(hidden)), their seed,
dtype and per-rank slices; the tiny families' configs (grouped-query attention, Qwen3.5's
linear layers first with full attention every second layer, Qwen3-MoE's renormalised top-k
and its dense last layer, Llama's RoPE scaling active at short positions, the wrapper's tied
embeddings); the per-expert layout's gate and up halves; the draft's fields taken from its
target (RoPE scaling, positions, the mask token beside the end-of-sequence token, layer ids
spread over the target) and DFlash2's published fields; the shard index and the safetensors
metadata; the make-tiny options reaching the files; and bad options (a shard count below one,
an `--out` that is a file) refused with one `error:` line and exit status 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from reference_engine.checkpoint import INDEX_FILE, SINGLE_FILE, load_target, read_config
from reference_engine.checkpoint.__main__ import main as checkpoint_main
from reference_engine.checkpoint.synthetic import (
    TINY_DFLASH2_WINDOW,
    make_tiny_draft,
    make_tiny_target,
    per_expert_layout,
    random_weights,
    spread_layer_ids,
    tiny_target_config,
)
from reference_engine.config import DraftConfig, TargetConfig
from reference_engine.errors import ConfigError
from reference_engine.models import draft_expected_shapes, expected_shapes
from reference_engine.tokenizer import EOS_TOKEN, MASK_TOKEN, load_tokenizer


def target_config(path: Path) -> TargetConfig:
    return TargetConfig.from_hf(read_config(path))


def draft_config(path: Path) -> DraftConfig:
    return DraftConfig.from_hf(read_config(path))


def shapes_of(arch: str, **options) -> dict[str, tuple[int, ...]]:
    raw = tiny_target_config(arch, options.pop("layers", 2), 64, 300, options.pop("tie", False), 298)
    return expected_shapes(TargetConfig.from_hf({**raw, **options}))


# ----------------------------------------------------------------------------- random weights
def test_random_weights_scale_each_kind_of_tensor_for_a_hybrid_target() -> None:
    shapes = shapes_of("qwen3_5")
    weights = random_weights(shapes, seed=0, norm_offset=True)
    assert set(weights) == set(shapes)
    assert all(tuple(weights[n].shape) == s for n, s in shapes.items())
    dt_bias = torch.cat([t for n, t in weights.items() if n.endswith("dt_bias")])
    assert 0.8 < dt_bias.mean().item() < 1.2  # a positive step before the softplus
    a_log = torch.cat([t for n, t in weights.items() if n.endswith("A_log")])
    assert a_log.min().item() >= 0.0 and a_log.max().item() <= 2.5 and a_log.std().item() > 0.3
    # (1 + w) norms hold w near 0; the linear attention's gated norm multiplies by w near 1
    offset = [t for n, t in weights.items() if n.endswith("norm.weight") and "linear_attn" not in n]
    gated = [t for n, t in weights.items() if n.endswith("linear_attn.norm.weight")]
    assert offset and gated
    assert abs(torch.cat(offset).mean().item()) < 0.1
    assert abs(torch.cat(gated).mean().item() - 1.0) < 0.1


def test_random_weights_without_norm_offset_hold_norm_weights_near_one() -> None:
    weights = random_weights(shapes_of("qwen3"), seed=1, norm_offset=False)
    norms = torch.cat([t for n, t in weights.items() if n.endswith("norm.weight")])
    assert abs(norms.mean().item() - 1.0) < 0.1


@pytest.mark.parametrize(("tie", "std"), [(True, 64**-0.5), (False, 1.0)], ids=["tied", "untied"])
def test_random_embeddings_are_scaled_down_only_when_they_double_as_the_lm_head(
    tie: bool, std: float
) -> None:
    shapes = shapes_of("qwen3", tie=tie)
    assert ("lm_head.weight" in shapes) is not tie
    embed = random_weights(shapes, seed=0, norm_offset=False)["model.embed_tokens.weight"]
    assert abs(embed.std().item() / std - 1.0) < 0.1


def test_random_weights_follow_the_seed_and_come_in_the_dtype_asked() -> None:
    shapes = shapes_of("qwen3")
    first = random_weights(shapes, seed=3, norm_offset=False)
    again = random_weights(shapes, seed=3, norm_offset=False)
    other = random_weights(shapes, seed=4, norm_offset=False)
    assert all(torch.equal(first[n], again[n]) for n in shapes)
    assert all(not torch.equal(first[n], other[n]) for n in shapes)
    half = random_weights(shapes, seed=3, norm_offset=False, dtype=torch.bfloat16)
    assert {t.dtype for t in half.values()} == {torch.bfloat16}
    assert all(torch.equal(half[n], first[n].to(torch.bfloat16)) for n in shapes)


def test_random_weights_keep_gives_the_slices_of_the_values_drawn_without_it() -> None:
    shapes = shapes_of("qwen3")
    whole = random_weights(shapes, seed=2, norm_offset=False)
    kept = random_weights(shapes, seed=2, norm_offset=False, keep=lambda name, t: t[:1].clone())
    assert all(torch.equal(kept[n], whole[n][:1]) for n in shapes)


def test_dflash2_base_kernel_starts_near_the_identity_at_tap_zero(tmp_path: Path) -> None:
    target = make_tiny_target(tmp_path / "target", layers=2, vocab=300)
    config = draft_config(make_tiny_draft(tmp_path / "draft", target, arch="dflash2"))
    weights = random_weights(draft_expected_shapes(config), seed=0, norm_offset=False)
    kernels = [t for n, t in weights.items() if n.endswith("base_kernel")]
    assert kernels and all(k.shape[1] == config.conv_kernel_size for k in kernels)
    for kernel in kernels:
        assert abs(kernel[:, 0].mean().item() - 1.0) < 0.1
        assert abs(kernel[:, 1:].mean().item()) < 0.1


# ----------------------------------------------------------------------------- target configs
def test_tiny_hidden_sizes_must_be_a_multiple_of_32() -> None:
    with pytest.raises(ConfigError, match="multiple of 32.*got 48"):
        tiny_target_config("qwen3", 2, 48, 300, False, 298)
    assert tiny_target_config("qwen3", 2, 96, 300, False, 298)["hidden_size"] == 96


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
def test_tiny_attention_targets_use_grouped_query_attention(arch: str) -> None:
    config = TargetConfig.from_hf(tiny_target_config(arch, 2, 128, 300, False, 298))
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.num_attention_heads * config.head_dim == 128


def test_tiny_hybrid_target_starts_with_linear_layers_and_attends_fully_every_second_layer() -> None:
    for arch in ("qwen3_5", "qwen3_5_moe"):
        config = TargetConfig.from_hf(tiny_target_config(arch, 4, 64, 300, False, 298))
        assert config.layer_types == ("linear_attention", "full_attention") * 2, arch
        assert config.partial_rotary_factor == 0.25


def test_tiny_qwen3_moe_renormalises_its_top_k_and_keeps_the_last_layer_dense() -> None:
    config = TargetConfig.from_hf(tiny_target_config("qwen3_moe", 3, 64, 300, False, 298))
    assert config.norm_topk_prob
    assert config.moe_layers == (0, 1) and config.dense_layers == (2,)
    one = TargetConfig.from_hf(tiny_target_config("qwen3_moe", 1, 64, 300, False, 298))
    assert one.moe_layers == (0,)


def test_tiny_llama_rope_scaling_applies_within_a_short_prompt() -> None:
    config = TargetConfig.from_hf(tiny_target_config("llama", 2, 64, 300, False, 298))
    assert config.rope_scaling is not None
    assert config.rope_scaling.original_max_position_embeddings <= 256
    assert config.max_position_embeddings > config.rope_scaling.original_max_position_embeddings


def test_tiny_target_names_its_tokenizers_end_token_as_bos_and_eos(tmp_path: Path) -> None:
    out = make_tiny_target(tmp_path / "t", layers=1, vocab=300)
    eos = load_tokenizer(out).token_to_id(EOS_TOKEN)
    raw = read_config(out)
    assert raw["eos_token_id"] == raw["bos_token_id"] == eos
    assert target_config(out).eos_token_ids == (eos,)


def test_a_tied_multimodal_wrapper_says_tied_at_both_levels(tmp_path: Path) -> None:
    out = make_tiny_target(
        tmp_path / "w", arch="qwen3_5", layers=2, vocab=300, multimodal_wrapper=True, tie_word_embeddings=True
    )
    raw = read_config(out)
    assert raw["tie_word_embeddings"] is True and raw["text_config"]["tie_word_embeddings"] is True
    assert raw["model_type"] == "qwen3_5" and raw["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    names = load_file(out / SINGLE_FILE)
    assert "lm_head.weight" not in names and "model.language_model.embed_tokens.weight" in names


def test_tiny_moe_wrapper_names_the_moe_classes(tmp_path: Path) -> None:
    out = make_tiny_target(tmp_path / "w", arch="qwen3_5_moe", layers=2, vocab=300, multimodal_wrapper=True)
    raw = read_config(out)
    assert raw["model_type"] == "qwen3_5_moe"
    assert raw["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert raw["vision_config"]["model_type"] == "qwen3_5_moe_vision"
    assert target_config(out).family == "qwen3_5_moe"


# ----------------------------------------------------------------------------- expert layouts
def test_per_expert_layout_splits_gate_rows_before_up_rows() -> None:
    gate_up = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)
    down = torch.arange(2 * 3 * 3, dtype=torch.float32).reshape(2, 3, 3)
    norm = torch.ones(3)
    out = per_expert_layout(
        {
            "model.layers.0.mlp.experts.gate_up_proj": gate_up,
            "model.layers.0.mlp.experts.down_proj": down,
            "model.layers.0.input_layernorm.weight": norm,
        }
    )
    prefix = "model.layers.0.mlp.experts"
    assert set(out) == {
        "model.layers.0.input_layernorm.weight",
        *(f"{prefix}.{e}.{p}_proj.weight" for e in (0, 1) for p in ("gate", "up", "down")),
    }
    for e in (0, 1):
        assert torch.equal(out[f"{prefix}.{e}.gate_proj.weight"], gate_up[e, :3])
        assert torch.equal(out[f"{prefix}.{e}.up_proj.weight"], gate_up[e, 3:])
        assert torch.equal(out[f"{prefix}.{e}.down_proj.weight"], down[e])
    assert out["model.layers.0.input_layernorm.weight"] is norm


def test_make_tiny_target_refuses_an_unknown_expert_layout(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--expert-layout must be one of per_expert, fused, got 'stacked'"):
        make_tiny_target(tmp_path / "m", arch="qwen3_moe", expert_layout="stacked")
    assert not (tmp_path / "m").exists()


# ----------------------------------------------------------------------------- target options
@pytest.mark.parametrize(("layers", "vocab"), [(0, 300), (2, 0), (-1, 300)])
def test_make_tiny_target_refuses_non_positive_layers_or_vocab(
    tmp_path: Path, layers: int, vocab: int
) -> None:
    with pytest.raises(ConfigError, match="--layers and --vocab must be positive"):
        make_tiny_target(tmp_path / "t", layers=layers, vocab=vocab, with_tokenizer=False)
    assert not (tmp_path / "t").exists()


def test_without_a_tokenizer_the_end_and_mask_tokens_are_the_last_two_ids(tmp_path: Path) -> None:
    target = make_tiny_target(tmp_path / "t", layers=2, vocab=16, with_tokenizer=False)
    assert not (target / "tokenizer.json").exists()
    assert target_config(target).eos_token_ids == (14,)
    draft = draft_config(make_tiny_draft(tmp_path / "d", target))
    assert draft.mask_token_id == 15


def test_with_a_tokenizer_the_draft_masks_with_the_tokenizers_mask_token(tmp_path: Path) -> None:
    target = make_tiny_target(tmp_path / "t", layers=2, vocab=300)
    tokenizer = load_tokenizer(target)
    mask = tokenizer.token_to_id(MASK_TOKEN)
    assert mask is not None and mask != tokenizer.token_to_id(EOS_TOKEN)
    assert draft_config(make_tiny_draft(tmp_path / "d", target)).mask_token_id == mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_config_names_the_dtype_the_weights_are_stored_in(tmp_path: Path, dtype: torch.dtype) -> None:
    out = make_tiny_target(tmp_path / "t", arch="llama", layers=1, vocab=300, dtype=dtype)
    assert {t.dtype for t in load_file(out / SINGLE_FILE).values()} == {dtype}
    assert read_config(out)["torch_dtype"] == str(dtype).removeprefix("torch.")


def test_llama_bias_sets_attention_and_mlp_biases(tmp_path: Path) -> None:
    out = make_tiny_target(tmp_path / "t", arch="llama", layers=1, vocab=300, bias=True)
    config = target_config(out)
    assert config.attention_bias and config.mlp_bias
    names = set(load_file(out / SINGLE_FILE))
    assert "model.layers.0.mlp.down_proj.bias" in names and "model.layers.0.self_attn.q_proj.bias" in names
    qwen = target_config(make_tiny_target(tmp_path / "q", layers=1, vocab=300, bias=True))
    assert qwen.attention_bias and not qwen.mlp_bias


# ----------------------------------------------------------------------------- the shard index
def test_shard_index_totals_the_tensor_bytes_and_every_file_says_pt(tmp_path: Path) -> None:
    out = make_tiny_target(tmp_path / "s", layers=2, vocab=300, shards=3, dtype=torch.bfloat16)
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(out.glob("*.safetensors"))
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                assert index["weight_map"][name] == file.name
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    assert len(index["weight_map"]) == len(expected_shapes(target_config(out)))
    single = make_tiny_target(tmp_path / "one", layers=1, vocab=300)
    with safe_open(str(single / SINGLE_FILE), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


# ----------------------------------------------------------------------------- drafts
def test_spread_layer_ids_are_distinct_and_span_the_target_below_its_last_layer() -> None:
    assert spread_layer_ids(4, 2) == [0, 2]
    assert spread_layer_ids(6, 3) == [0, 2, 4]
    assert spread_layer_ids(2, 2) == [0]
    assert spread_layer_ids(1, 2) == [0]
    for layers in range(2, 12):
        ids = spread_layer_ids(layers, 2)
        assert ids[0] == 0 and ids[-1] == layers - 2


def test_tiny_draft_fits_its_target(tmp_path: Path) -> None:
    target = make_tiny_target(tmp_path / "t", layers=5, vocab=300, hidden=96)
    draft = draft_config(make_tiny_draft(tmp_path / "d", target, block_size=4, layers=3))
    config = target_config(target)
    draft.check_target(config)
    assert (draft.num_hidden_layers, draft.block_size, draft.num_target_layers) == (3, 4, 5)
    assert draft.target_layer_ids == (0, 3)
    assert draft.max_position_embeddings == config.max_position_embeddings
    assert draft.num_key_value_heads < draft.num_attention_heads
    assert draft.num_attention_heads * draft.head_dim == 96


def test_a_tiny_draft_takes_its_targets_context_length(tmp_path: Path) -> None:
    overrides = (("max_position_embeddings", 1536),)
    target = make_tiny_target(tmp_path / "t", layers=2, config_overrides=overrides)
    draft = draft_config(make_tiny_draft(tmp_path / "d", target))
    assert target_config(target).max_position_embeddings == draft.max_position_embeddings == 1536


def test_a_llama_targets_draft_rotates_as_its_target_does(tmp_path: Path) -> None:
    target = make_tiny_target(tmp_path / "t", arch="llama", layers=2, vocab=300)
    draft = draft_config(make_tiny_draft(tmp_path / "d", target))
    config = target_config(target)
    assert draft.rope_scaling == config.rope_scaling is not None
    assert draft.rope_theta == config.rope_theta == 500000.0


def test_a_qwen_targets_draft_has_no_rope_scaling(tmp_path: Path) -> None:
    target = make_tiny_target(tmp_path / "t", layers=2, vocab=300)
    raw = read_config(make_tiny_draft(tmp_path / "d", target))
    assert "rope_scaling" not in raw and raw["rope_theta"] == 10000.0


def test_tiny_dflash2_draft_is_written_in_the_published_layout(tmp_path: Path) -> None:
    target = make_tiny_target(tmp_path / "t", layers=4, vocab=300)
    out = make_tiny_draft(tmp_path / "d", target, block_size=6, layers=2, arch="dflash2")
    raw = read_config(out)
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert raw["dflash_config"]["block_size"] == 6
    config = draft_config(out)
    assert config.is_dflash2 and config.block_size == 6
    assert config.layer_types == ("sliding_attention", "sliding_attention")
    assert config.sliding_window == TINY_DFLASH2_WINDOW
    assert config.causal is False and not config.layer_causal(0)
    assert (config.conv_kernel_size, config.conv_group_size) == (2, 16)
    assert (config.selector_rank, config.selector_top_k) == (16, 8)
    names = set(load_file(out / SINGLE_FILE))
    assert names == set(draft_expected_shapes(config))


@pytest.mark.parametrize("block_size", [1, 0, -4])
def test_make_tiny_draft_refuses_a_block_below_two(tmp_path: Path, block_size: int) -> None:
    target = make_tiny_target(tmp_path / "t", layers=2, vocab=300)
    with pytest.raises(ConfigError, match=f"--block-size must be >= 2, got {block_size}"):
        make_tiny_draft(tmp_path / "d", target, block_size=block_size)
    assert not (tmp_path / "d").exists()


def test_make_tiny_draft_refuses_an_unknown_arch_and_zero_layers(tmp_path: Path) -> None:
    target = make_tiny_target(tmp_path / "t", layers=2, vocab=300)
    with pytest.raises(ConfigError, match="unknown draft arch 'eagle'"):
        make_tiny_draft(tmp_path / "d", target, arch="eagle")
    with pytest.raises(ConfigError, match="--layers must be positive, got 0"):
        make_tiny_draft(tmp_path / "d", target, layers=0)
    assert not (tmp_path / "d").exists()


# ----------------------------------------------------------------------------- make-tiny
def test_make_tiny_passes_shards_bias_dtype_and_tie_to_the_files(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli"
    argv = ["make-tiny", "--arch", "llama", "--out", str(out), "--layers", "2", "--vocab", "300"]
    argv += ["--shards", "2", "--bias", "--dtype", "bfloat16", "--tie-word-embeddings", "--seed", "7"]
    assert checkpoint_main(argv) == 0
    assert capsys.readouterr().out.strip() == str(out)
    same = make_tiny_target(
        tmp_path / "api",
        arch="llama",
        layers=2,
        vocab=300,
        shards=2,
        bias=True,
        dtype=torch.bfloat16,
        tie_word_embeddings=True,
        seed=7,
    )
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in same.iterdir())
    assert (out / INDEX_FILE).is_file() and not (out / SINGLE_FILE).exists()
    for file in ["config.json", INDEX_FILE, *(p.name for p in same.glob("*.safetensors"))]:
        assert (out / file).read_bytes() == (same / file).read_bytes(), file
    config = target_config(out)
    assert config.mlp_bias and config.tie_word_embeddings
    load_target(out)


def test_make_tiny_draft_passes_block_size_layers_and_arch_to_the_files(tmp_path: Path, capsys) -> None:
    target = make_tiny_target(tmp_path / "t", layers=4, vocab=300)
    out = tmp_path / "cli"
    argv = ["make-tiny", "--arch", "dflash2", "--target", str(target), "--out", str(out)]
    assert checkpoint_main([*argv, "--block-size", "5", "--layers", "3", "--seed", "2"]) == 0
    same = make_tiny_draft(tmp_path / "api", target, block_size=5, layers=3, seed=2, arch="dflash2")
    for file in ("config.json", SINGLE_FILE):
        assert (out / file).read_bytes() == (same / file).read_bytes(), file
    assert draft_config(out).block_size == 5


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--arch", "qwen3", "--hidden", "48"], "--hidden must be a multiple of 32"),
        (["--arch", "qwen3", "--vocab", "0"], "--layers and --vocab must be positive"),
        (["--arch", "llama", "--multimodal-wrapper"], "--multimodal-wrapper applies to --arch"),
    ],
    ids=["hidden", "vocab", "wrapper"],
)
def test_make_tiny_refuses_bad_options_with_one_error_line(
    tmp_path: Path, capsys, flags: list[str], message: str
) -> None:
    out = tmp_path / "bad"
    assert checkpoint_main(["make-tiny", "--out", str(out), *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and message in captured.err
    assert captured.err.count("\n") == 1
    assert not (out / "config.json").exists()


def test_make_tiny_draft_refuses_a_missing_target_with_one_error_line(tmp_path: Path, capsys) -> None:
    argv = ["make-tiny", "--arch", "dflash", "--target", str(tmp_path / "none"), "--out", str(tmp_path / "d")]
    assert checkpoint_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no config.json" in err
    assert not (tmp_path / "d").exists()


# ----------------------------------------------------------------------------- refused input
@pytest.mark.parametrize("shards", ["0", "-2"])
def test_make_tiny_refuses_a_shard_count_below_one(tmp_path: Path, capsys, shards: str) -> None:
    out = tmp_path / "tiny"
    argv = ["make-tiny", "--arch", "qwen3", "--out", str(out), "--layers", "1", "--shards", shards]
    assert checkpoint_main(argv) == 2
    assert "--shards" in capsys.readouterr().err
    assert not (out / "config.json").exists()


def test_make_tiny_refuses_an_out_path_that_is_a_file(tmp_path: Path, capsys) -> None:
    out = tmp_path / "a-file"
    out.write_text("not a folder\n")
    argv = ["make-tiny", "--arch", "qwen3", "--out", str(out), "--layers", "1"]
    assert checkpoint_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(out) in err
    assert out.read_text() == "not a folder\n"


def test_make_tiny_draft_refuses_an_out_path_that_is_a_file(tmp_path: Path, capsys) -> None:
    target = make_tiny_target(tmp_path / "t", layers=2)
    out = tmp_path / "a-file"
    out.write_text("not a folder\n")
    argv = ["make-tiny", "--arch", "dflash", "--target", str(target), "--out", str(out)]
    assert checkpoint_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(out) in err
    assert out.read_text() == "not a folder\n"


# ----------------------------------------------------------------------------- configs read back
def llama_raw(**changes) -> dict:
    return {**tiny_target_config("llama", 2, 64, 300, False, 298), **changes}


def test_llama3_scaling_without_original_positions_takes_the_configs_max_positions() -> None:
    scaling = {
        k: v for k, v in llama_raw()["rope_scaling"].items() if k != "original_max_position_embeddings"
    }
    config = TargetConfig.from_hf(llama_raw(rope_scaling=scaling, max_position_embeddings=1024))
    assert config.rope_scaling.original_max_position_embeddings == 1024
    bare = llama_raw(rope_scaling=scaling)
    del bare["max_position_embeddings"]
    config = TargetConfig.from_hf(bare)
    assert config.max_position_embeddings == 2048  # Llama's own default
    assert config.rope_scaling.original_max_position_embeddings == 2048


def test_qwen_targets_default_to_32768_positions() -> None:
    raw = tiny_target_config("qwen3", 2, 64, 300, False, 298)
    del raw["max_position_embeddings"]
    assert TargetConfig.from_hf(raw).max_position_embeddings == 32768


def test_a_wrapper_that_says_tied_only_at_the_top_is_read_as_tied() -> None:
    text = tiny_target_config("qwen3_5", 2, 64, 300, True, 298)
    del text["tie_word_embeddings"]
    wrapper = {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": True}
    assert TargetConfig.from_hf(wrapper).tie_word_embeddings
    assert not TargetConfig.from_hf({**wrapper, "tie_word_embeddings": False}).tie_word_embeddings


def test_hybrid_layers_without_layer_types_attend_fully_every_fourth_layer() -> None:
    raw = tiny_target_config("qwen3_5", 8, 64, 300, False, 298)
    del raw["layer_types"]
    config = TargetConfig.from_hf(raw)
    assert config.attention_layers == (3, 7)
    raw["full_attention_interval"] = 2
    assert TargetConfig.from_hf(raw).attention_layers == (1, 3, 5, 7)


def test_published_target_layer_ids_spread_over_one_to_n_minus_three() -> None:
    from reference_engine.config import published_target_layer_ids

    assert published_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert published_target_layer_ids(7, 1) == (3,)
    assert published_target_layer_ids(8, 1) == (4,)


def test_a_draft_without_target_layer_ids_takes_the_published_spread(tmp_path: Path) -> None:
    target = make_tiny_target(tmp_path / "t", layers=8, vocab=300)
    raw = read_config(make_tiny_draft(tmp_path / "d", target, layers=3))
    del raw["dflash_config"]["target_layer_ids"]
    assert DraftConfig.from_hf(raw).target_layer_ids == (1, 3, 5)


def test_draft_fields_read_dflash_config_first(tmp_path: Path) -> None:
    target = make_tiny_target(tmp_path / "t", layers=4, vocab=300)
    raw = read_config(make_tiny_draft(tmp_path / "d", target, block_size=6, arch="dflash2"))
    raw["block_size"] = 3
    raw["selector_top_k"] = 4
    config = DraftConfig.from_hf(raw)
    assert config.block_size == 6 and config.selector_top_k == 8
    # both architectures named: DFlash2
    both = DraftConfig.from_hf({**raw, "architectures": ["DFlashDraftModel", "DFlash2DraftModel"]})
    assert both.is_dflash2
    # a DFlash draft with its block size at the top level only
    plain = read_config(make_tiny_draft(tmp_path / "p", target, block_size=5))
    assert "block_size" not in plain["dflash_config"]
    assert DraftConfig.from_hf(plain).block_size == 5
    del plain["block_size"]
    assert DraftConfig.from_hf(plain).block_size == 16


def test_draft_defaults_key_value_heads_to_its_heads_and_reads_zero_softcap_as_none(tmp_path: Path) -> None:
    target = make_tiny_target(tmp_path / "t", layers=2, vocab=300)
    raw = read_config(make_tiny_draft(tmp_path / "d", target))
    del raw["num_key_value_heads"]
    config = DraftConfig.from_hf({**raw, "final_logit_softcapping": 0})
    assert config.num_key_value_heads == config.num_attention_heads
    assert config.final_logit_softcapping is None
    assert DraftConfig.from_hf({**raw, "final_logit_softcapping": 30}).final_logit_softcapping == 30.0


def test_qwen3_max_window_layers_zero_slides_every_layer() -> None:
    raw = {**tiny_target_config("qwen3", 3, 64, 300, False, 298), "use_sliding_window": True}
    config = TargetConfig.from_hf({**raw, "sliding_window": 32, "max_window_layers": 0})
    assert config.layer_types == ("sliding_attention",) * 3 and config.sliding_window == 32
    config = TargetConfig.from_hf({**raw, "sliding_window": 32, "max_window_layers": 2})
    assert config.layer_types == ("full_attention", "full_attention", "sliding_attention")
