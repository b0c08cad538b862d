"""Checkpoint loading and config parsing, the contracts the other tests leave open: what the
writer puts in the files (format metadata, the index's byte total, non-contiguous tensors),
the loader's errors (a malformed index, how many missing and unexpected tensors a message
names), draft loading (the requested dtype, a leading `model.`), and config.json fields:
which spelling wins when two are given, the defaults of an absent field, and the values
that must be refused (NaN, zero, booleans, negative ids, the off-by-one edges)."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from reference_engine.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    load_draft,
    load_target,
    parse_dtype,
    read_config,
    write_safetensors,
)
from reference_engine.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DraftConfig,
    TargetConfig,
    published_target_layer_ids,
)
from reference_engine.errors import CheckpointError, ConfigError

from .test_checkpoint import all_logits
from .test_config import QWEN3_5_WRAPPER_RAW, qwen3, qwen3_5_text
from .test_dflash2 import published_config
from .test_dflash_config import draft_raw
from .test_llama import LLAMA_3_1_8B, llama
from .test_moe import qwen3_moe
from .test_qwen3_5_moe import text as qwen3_5_moe_text

TinyCheckpoint = Callable[..., Path]
TinyPair = Callable[..., tuple[Path, Path]]
CopyCheckpoint = Callable[[Path], Path]
F, S = FULL_ATTENTION, SLIDING_ATTENTION


def stored(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, over all its safetensors files."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def rewrite(path: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor] | None]) -> None:
    """Edit the tensors of a single-file checkpoint in place (the edit may return a new dict)."""
    tensors = load_file(str(path / SINGLE_FILE))
    tensors = edit(tensors) or tensors
    save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- dtypes
def test_an_unknown_dtype_name_is_a_config_error_that_lists_the_accepted_names() -> None:
    """`parse_dtype` knows float64, float32 and bfloat16 by name; any other name is a
    ConfigError naming it and the accepted ones, not a KeyError."""
    assert parse_dtype("float64") is torch.float64
    assert parse_dtype("float32") is torch.float32
    assert parse_dtype("bfloat16") is torch.bfloat16
    for name in ("float16", "fp32", "torch.float32", ""):
        with pytest.raises(ConfigError, match=rf"unknown dtype '{re.escape(name)}', expected one of "):
            parse_dtype(name)
    with pytest.raises(ConfigError, match=r"expected one of float64, float32, bfloat16$"):
        parse_dtype("int8")


# ----------------------------------------------------------------------------- writing
def test_every_written_safetensors_file_says_format_pt(tiny_checkpoint: TinyCheckpoint) -> None:
    """Single-file and sharded checkpoints carry `{"format": "pt"}` in each file's metadata,
    as `save_pretrained` writes them."""
    for path in (tiny_checkpoint("qwen3"), tiny_checkpoint("qwen3", shards=3)):
        files = sorted(path.glob("*.safetensors"))
        assert files
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                assert f.metadata() == {"format": "pt"}, file.name


def test_the_index_total_size_is_the_bytes_of_every_tensor(tiny_checkpoint: TinyCheckpoint) -> None:
    """The shard index's `metadata.total_size` is the sum of the tensors' sizes in bytes
    (elements times element size), whatever the stored dtype."""
    for dtype in (torch.float32, torch.bfloat16):
        path = tiny_checkpoint("qwen3", shards=3, dtype=dtype)
        index = json.loads((path / INDEX_FILE).read_text())
        tensors = stored(path)
        assert all(t.dtype == dtype for t in tensors.values())
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        assert index["metadata"]["total_size"] == total
        assert sorted(index["weight_map"]) == sorted(tensors)


@pytest.mark.parametrize("shards", [1, 2])
def test_non_contiguous_tensors_are_written_and_read_back_unchanged(tmp_path: Path, shards: int) -> None:
    """`write_safetensors` takes views that are not contiguous (a transpose, a strided slice)
    and writes their values, single-file or sharded."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {"a.weight": base.T, "b.weight": base[:, ::2], "c.weight": base.clone()}
    assert not tensors["a.weight"].is_contiguous() and not tensors["b.weight"].is_contiguous()
    write_safetensors(tmp_path, tensors, shards=shards)
    back = stored(tmp_path)
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(back[name], t), name


# ----------------------------------------------------------------------------- bad checkpoints
def test_an_index_whose_weight_map_is_not_an_object_is_a_checkpoint_error(
    qwen3_sharded_checkpoint: Path, copy_checkpoint: CopyCheckpoint
) -> None:
    """A `model.safetensors.index.json` whose `weight_map` is absent or not an object (a
    list, a string) is a CheckpointError naming the index, not an AttributeError."""
    for weight_map in (["model.embed_tokens.weight"], "model-00001-of-00003.safetensors", None):
        path = copy_checkpoint(qwen3_sharded_checkpoint)
        index = json.loads((path / INDEX_FILE).read_text())
        if weight_map is None:
            del index["weight_map"]
        else:
            index["weight_map"] = weight_map
        (path / INDEX_FILE).write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: no 'weight_map' object"):
            load_target(path)
        shutil.rmtree(path)


def test_a_missing_tensor_message_names_five_and_counts_the_rest(
    qwen3_checkpoint: Path, copy_checkpoint: CopyCheckpoint
) -> None:
    """With more than five tensors missing, the error names the first five (in the model's
    order) and says how many more there are."""
    path = copy_checkpoint(qwen3_checkpoint)
    gone = [f"model.layers.{i}.input_layernorm.weight" for i in range(4)]
    gone += ["model.layers.1.self_attn.q_norm.weight", "model.layers.2.mlp.up_proj.weight", "lm_head.weight"]
    assert len(gone) == 7
    rewrite(path, lambda t: {n: v for n, v in t.items() if n not in gone})
    with pytest.raises(CheckpointError) as info:
        load_target(path)
    message = str(info.value)
    assert message.endswith(" and 2 more"), message
    named = message.split("missing tensor(s) ", 1)[1].removesuffix(" and 2 more").split(", ")
    assert len(named) == 5 and set(named) <= set(gone)
    assert named[0] == "model.layers.0.input_layernorm.weight"


def test_a_few_missing_tensors_are_all_named_without_a_count(
    qwen3_checkpoint: Path, copy_checkpoint: CopyCheckpoint
) -> None:
    """Up to five missing tensors are all named, and no "more" follows."""
    path = copy_checkpoint(qwen3_checkpoint)
    gone = ["model.norm.weight", "model.layers.3.mlp.down_proj.weight"]
    rewrite(path, lambda t: {n: v for n, v in t.items() if n not in gone})
    with pytest.raises(CheckpointError) as info:
        load_target(path)
    message = str(info.value)
    assert "more" not in message
    assert all(name in message for name in gone)


def test_every_unexpected_tensor_up_to_five_is_named(
    qwen3_checkpoint: Path, copy_checkpoint: CopyCheckpoint
) -> None:
    """Tensors the config does not expect are refused, and the error names each of them
    (up to five), not only the first."""
    path = copy_checkpoint(qwen3_checkpoint)
    extra = ["model.layers.9.mlp.up_proj.weight", "model.rotary_emb.inv_freq", "score.weight"]
    rewrite(path, lambda t: t.update({name: torch.zeros(2, 2) for name in extra}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) .* for this config") as info:
        load_target(path)
    for name in extra:
        assert name in str(info.value), name


# ----------------------------------------------------------------------------- drafts
def test_a_draft_is_loaded_in_the_dtype_asked_for_else_its_targets(tiny_pair: TinyPair) -> None:
    """`load_draft(..., dtype=d)` gives every draft parameter dtype d, whatever the target's;
    without a dtype the draft takes the target's embedding dtype."""
    target_dir, draft_dir = tiny_pair("qwen3")
    target = load_target(target_dir, dtype=torch.float32)
    wide = load_draft(draft_dir, target, dtype=torch.float64)
    assert {p.dtype for p in wide.parameters()} == {torch.float64}
    narrow = load_draft(draft_dir, target, dtype=torch.bfloat16)
    assert {p.dtype for p in narrow.parameters()} == {torch.bfloat16}
    same = load_draft(draft_dir, target)
    assert {p.dtype for p in same.parameters()} == {torch.float32}
    for name, p in wide.state_dict().items():
        assert torch.equal(p, same.state_dict()[name].double()), name


def test_a_draft_stored_under_a_leading_model_prefix_loads_the_same_weights(
    tiny_pair: TinyPair, copy_checkpoint: CopyCheckpoint
) -> None:
    """A z-lab draft whose tensors are all named `model.<name>` loads to the same parameters
    as the one named `<name>`."""
    target_dir, draft_dir = tiny_pair("qwen3")
    target = load_target(target_dir, dtype=torch.float32)
    path = copy_checkpoint(draft_dir)
    rewrite(path, lambda t: {f"model.{n}": v for n, v in t.items()})
    assert all(n.startswith("model.") for n in stored(path))
    plain = load_draft(draft_dir, target).state_dict()
    prefixed = load_draft(path, target).state_dict()
    assert prefixed.keys() == plain.keys()
    for name, p in plain.items():
        assert torch.equal(prefixed[name], p), name


# ----------------------------------------------------------------------------- config.json
def target_from_file(folder: Path, raw: dict[str, Any]) -> TargetConfig:
    """`raw` written as a config.json (NaN as JSON's NaN) and parsed back as the loader does."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return TargetConfig.from_hf(read_config(folder))


def draft_from_file(folder: Path, raw: dict[str, Any]) -> DraftConfig:
    """The same for a draft's config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return DraftConfig.from_hf(read_config(folder))


# ----------------------------------------------------------------------------- RoPE
def test_a_null_llama3_factor_is_reported_as_missing(tmp_path: Path) -> None:
    """A llama3 `rope_scaling` whose `factor` is JSON null is "required field 'factor' is
    missing", as when the key is absent."""
    scaling = {**LLAMA_3_1_8B["rope_scaling"], "factor": None}
    with pytest.raises(ConfigError, match=r"llama3 rope scaling\): required field 'factor' is missing"):
        target_from_file(tmp_path, llama(rope_scaling=scaling))


def test_a_llama3_factor_that_is_not_a_number_is_refused(tmp_path: Path) -> None:
    """A llama3 `factor` given as a string or a boolean is refused by name."""
    for value in ("8", True):
        scaling = {**LLAMA_3_1_8B["rope_scaling"], "factor": value}
        with pytest.raises(ConfigError, match=r"'factor' must be a number"):
            target_from_file(tmp_path, llama(rope_scaling=scaling))


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"factor": math.nan}, r"'factor' must be >= 1, got nan"),
        (
            {"low_freq_factor": 0.0},
            r"expected 0 < low_freq_factor < high_freq_factor, got low_freq_factor 0.0",
        ),
        ({"low_freq_factor": -1.0}, r"got low_freq_factor -1.0 and high_freq_factor 4.0"),
        ({"low_freq_factor": math.nan}, r"got low_freq_factor nan"),
    ],
    ids=["nan-factor", "zero-low", "negative-low", "nan-low"],
)
def test_llama3_scaling_values_outside_their_range_are_refused(
    tmp_path: Path, change: dict[str, float], pattern: str
) -> None:
    """The llama3 scaling needs factor >= 1 and 0 < low_freq_factor < high_freq_factor: a
    NaN (JSON's NaN literal), a zero or a negative value is refused."""
    scaling = {**LLAMA_3_1_8B["rope_scaling"], **change}
    with pytest.raises(ConfigError, match=pattern):
        target_from_file(tmp_path, llama(rope_scaling=scaling))


def test_a_factor_of_one_and_a_thin_band_are_accepted(tmp_path: Path) -> None:
    """The edges inside the range parse: factor exactly 1, low_freq_factor just under
    high_freq_factor."""
    scaling = {**LLAMA_3_1_8B["rope_scaling"], "factor": 1, "low_freq_factor": 3.999}
    c = target_from_file(tmp_path, llama(rope_scaling=scaling))
    assert c.rope_scaling is not None
    assert (c.rope_scaling.factor, c.rope_scaling.low_freq_factor) == (1.0, 3.999)


def test_rope_parameters_win_over_a_stale_rope_scaling(tmp_path: Path) -> None:
    """When a config carries both transformers 5's `rope_parameters` and a v4
    `rope_scaling`, `rope_parameters` decides the rope type and every scaling value."""
    stale = dict(LLAMA_3_1_8B["rope_scaling"])
    plain = llama(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rope_scaling=stale)
    assert target_from_file(tmp_path / "plain", plain).rope_scaling is None
    params = {**stale, "rope_theta": 500000.0, "factor": 16.0, "original_max_position_embeddings": 4096}
    both = target_from_file(tmp_path / "both", llama(rope_parameters=params, rope_scaling=stale))
    assert both.rope_scaling is not None
    assert both.rope_scaling.factor == 16.0
    assert both.rope_scaling.original_max_position_embeddings == 4096


def test_rope_type_wins_over_the_legacy_type_key(tmp_path: Path) -> None:
    """In one `rope_scaling`, `rope_type` is read before the legacy `type` (as transformers
    standardises it): a llama3 `rope_type` beside a stale `type` is llama3."""
    scaling = {**LLAMA_3_1_8B["rope_scaling"], "type": "dynamic"}
    c = target_from_file(tmp_path, llama(rope_scaling=scaling))
    assert c.rope_scaling is not None and c.rope_scaling.factor == 8.0


@pytest.mark.parametrize("theta", [0, 0.0, True, False, "10000", None], ids=repr)
def test_a_rope_theta_that_is_not_a_positive_number_is_refused(tmp_path: Path, theta: Any) -> None:
    """`rope_theta` must be a positive number: zero, a boolean, a string or null are
    refused (null is not "absent": the default 10000 is for a missing key)."""
    with pytest.raises(ConfigError, match=r"'rope_theta' must be a positive number, got "):
        target_from_file(tmp_path, qwen3(rope_theta=theta))
    with pytest.raises(ConfigError, match=r"'rope_theta' must be a positive number, got "):
        draft_from_file(tmp_path, draft_raw(rope_theta=theta))


# ----------------------------------------------------------------------------- target checks
@pytest.mark.parametrize(
    ("raw", "pattern"),
    [
        (
            qwen3_moe(num_hidden_layers=2, layer_types=[F, S], sliding_window=128),
            r"qwen3_moe config: layer_types\[1\] = 'sliding_attention' is not one of \['full_attention'\]",
        ),
        (
            llama(num_hidden_layers=2, layer_types=[S, F], sliding_window=128),
            r"llama config: layer_types\[0\] = 'sliding_attention' is not one of \['full_attention'\]",
        ),
        (
            qwen3(num_hidden_layers=2, layer_types=[F, S], sliding_window=0, use_sliding_window=True),
            r"sliding_window must be a positive integer",
        ),
        (
            qwen3(partial_rotary_factor=0.005),
            r"rotary dimension head_dim \* partial_rotary_factor = 0 must be a positive even number",
        ),
        (qwen3(rms_norm_eps=math.nan), r"rms_norm_eps must be > 0, got nan"),
        (qwen3(rms_norm_eps=-1e-6), r"rms_norm_eps must be > 0, got -1e-06"),
        (qwen3(eos_token_id=-1), r"eos_token_id -1 outside the vocabulary \[0, 151936\)"),
        (qwen3(eos_token_id=[151645, -2]), r"eos_token_id -2 outside the vocabulary"),
        (qwen3_moe(mlp_only_layers=[-1]), r"mlp_only_layers \[-1\] out of range for 48 layers"),
        (
            qwen3_moe(mlp_only_layers=[True]),
            r"'mlp_only_layers' must be a list of layer indices, got \[True\]",
        ),
    ],
    ids=[
        "sliding-in-qwen3_moe",
        "sliding-in-llama",
        "zero-window",
        "zero-rotary-dim",
        "nan-eps",
        "negative-eps",
        "negative-eos",
        "negative-eos-in-list",
        "negative-mlp-only",
        "boolean-mlp-only",
    ],
)
def test_a_target_config_outside_its_range_is_refused(
    tmp_path: Path, raw: dict[str, Any], pattern: str
) -> None:
    """Each of these config.json values is a ConfigError naming the field and the value:
    a sliding layer where the family has none, a zero window, a rotary dimension truncated
    to 0, a NaN or negative norm epsilon, a negative token id, a negative or boolean layer
    index."""
    with pytest.raises(ConfigError, match=pattern):
        target_from_file(tmp_path, raw)


def test_llama3_scaling_set_on_another_family_is_refused() -> None:
    """A TargetConfig of a family other than llama with a llama3 scaling (as
    `dataclasses.replace` would make one) is refused on construction."""
    import dataclasses

    from reference_engine.config import Llama3RopeScaling

    scaling = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    base = TargetConfig.from_hf(qwen3())
    with pytest.raises(ConfigError, match=r"qwen3 config: llama3 rope scaling applies to llama only"):
        dataclasses.replace(base, rope_scaling=scaling)
    llama_config = TargetConfig.from_hf(llama(rope_scaling=None))
    assert dataclasses.replace(llama_config, rope_scaling=scaling).rope_scaling == scaling


def test_top_k_may_equal_the_number_of_experts(tmp_path: Path) -> None:
    """num_experts_per_tok equal to num_experts (every expert for every token) is a valid
    MoE config; one more is not."""
    every = target_from_file(tmp_path, qwen3_moe(num_experts=8, num_experts_per_tok=8))
    assert every.num_experts_per_tok == every.num_experts == 8
    with pytest.raises(ConfigError, match=r"num_experts_per_tok 9 must be between 1 and num_experts 8"):
        target_from_file(tmp_path, qwen3_moe(num_experts=8, num_experts_per_tok=9))


# ----------------------------------------------------------------------------- target fields
def test_the_rotary_dimension_truncates_head_dim_times_the_factor(tmp_path: Path) -> None:
    """rotary_dim is int(head_dim * partial_rotary_factor), truncated as transformers does:
    head_dim 96 at 0.3 (28.8) rotates 28 dimensions."""
    c = target_from_file(tmp_path, qwen3(head_dim=96, partial_rotary_factor=0.3))
    assert c.rotary_dim == 28
    assert target_from_file(tmp_path, qwen3(head_dim=96, partial_rotary_factor=0.25)).rotary_dim == 24


def test_a_null_head_dim_is_hidden_over_heads(tmp_path: Path) -> None:
    """`head_dim: null` is hidden_size // num_attention_heads, like an absent head_dim."""
    assert target_from_file(tmp_path, qwen3(head_dim=None)).head_dim == 1024 // 16
    assert target_from_file(tmp_path, llama(head_dim=None)).head_dim == 4096 // 32


def test_max_position_embeddings_defaults_to_32768_except_for_llama(tmp_path: Path) -> None:
    """Without `max_position_embeddings` a Qwen target gets transformers' 32768 (llama: 2048),
    and a DFlash draft 32768."""
    for raw in (qwen3(), qwen3_moe(), qwen3_5_text()):
        del raw["max_position_embeddings"]
        assert target_from_file(tmp_path, raw).max_position_embeddings == 32768, raw["model_type"]
    raw = llama()
    del raw["max_position_embeddings"]
    assert target_from_file(tmp_path, raw).max_position_embeddings == 2048
    draft = draft_from_file(tmp_path, draft_raw(drop=("max_position_embeddings",)))
    assert draft.max_position_embeddings == 32768


def test_partial_rotary_factor_in_rope_parameters_wins_over_the_top_level(tmp_path: Path) -> None:
    """With `partial_rotary_factor` both inside `rope_parameters` and at the top level, the
    `rope_parameters` one is used."""
    raw = qwen3_5_text(partial_rotary_factor=0.5)
    assert raw["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert target_from_file(tmp_path, raw).partial_rotary_factor == 0.25


def test_partial_rotary_factor_defaults_to_a_quarter_for_every_hybrid_family(tmp_path: Path) -> None:
    """Without any `partial_rotary_factor`, Qwen3.5 and Qwen3.5-MoE rotate a quarter of each
    head; Qwen3, Qwen3-MoE and Llama rotate all of it."""
    for raw, want in ((qwen3_5_text(), 0.25), (qwen3_5_moe_text(), 0.25)):
        del raw["rope_parameters"]["partial_rotary_factor"]
        assert target_from_file(tmp_path, raw).partial_rotary_factor == want, raw["model_type"]
    for raw in (qwen3(), qwen3_moe(), llama()):
        assert target_from_file(tmp_path, raw).partial_rotary_factor == 1.0, raw["model_type"]


def test_a_wrappers_attention_bias_is_read_from_its_text_config(tmp_path: Path) -> None:
    """In the multimodal wrapper layout `attention_bias` sits in `text_config`; true there
    is true, whatever the outer config says."""
    raw = copy.deepcopy(QWEN3_5_WRAPPER_RAW)
    raw["text_config"]["attention_bias"] = True
    raw["attention_bias"] = False
    assert target_from_file(tmp_path, raw).attention_bias
    raw["text_config"]["attention_bias"] = False
    raw["attention_bias"] = True
    assert not target_from_file(tmp_path, raw).attention_bias


def test_explicit_sliding_layer_types_take_the_window_only_with_use_sliding_window(tmp_path: Path) -> None:
    """A Qwen3 config listing sliding_attention layers in `layer_types` takes its
    `sliding_window` with `use_sliding_window` true; with it false those layers attend without
    a window, as transformers' Qwen3Config reads it; without sliding layers the window is
    dropped."""
    raw = qwen3(num_hidden_layers=3, layer_types=[F, S, S], sliding_window=256, use_sliding_window=True)
    c = target_from_file(tmp_path, raw)
    assert c.layer_types == (F, S, S) and c.sliding_window == 256
    off = target_from_file(tmp_path, {**raw, "use_sliding_window": False})
    assert off.layer_types == (F, S, S) and off.sliding_window is None
    full = target_from_file(tmp_path, qwen3(num_hidden_layers=2, layer_types=[F, F], sliding_window=256))
    assert full.sliding_window is None


def test_mlp_bias_is_read_for_llama_only(tmp_path: Path) -> None:
    """`mlp_bias: true` gives Llama biased MLP projections; Qwen3 has none, and a stray
    `mlp_bias` in its config is ignored (its checkpoint has no MLP biases)."""
    assert target_from_file(tmp_path, llama(mlp_bias=True)).mlp_bias
    assert not target_from_file(tmp_path, qwen3(mlp_bias=True)).mlp_bias
    assert not target_from_file(tmp_path, qwen3_5_text(mlp_bias=True)).mlp_bias


def test_a_stray_mlp_bias_does_not_change_what_a_qwen3_checkpoint_must_hold(
    qwen3_checkpoint: Path, copy_checkpoint: CopyCheckpoint
) -> None:
    """A Qwen3 checkpoint whose config.json says `mlp_bias: true` still loads from its
    bias-free tensors, to the same logits."""
    path = copy_checkpoint(qwen3_checkpoint)
    raw = json.loads((path / "config.json").read_text())
    raw["mlp_bias"] = True
    (path / "config.json").write_text(json.dumps(raw))
    model = load_target(path)
    assert not model.config.mlp_bias
    assert not any(name.endswith("mlp.up_proj.bias") for name in model.state_dict())
    assert torch.equal(all_logits(model), all_logits(load_target(qwen3_checkpoint)))


def test_qwen3_moe_decoder_sparse_step_defaults_to_one(tmp_path: Path) -> None:
    """Without `decoder_sparse_step` every Qwen3-MoE layer (but those in mlp_only_layers)
    is MoE, and a config without `intermediate_size` stays valid."""
    raw = qwen3_moe(num_hidden_layers=4)
    del raw["decoder_sparse_step"], raw["intermediate_size"]
    c = target_from_file(tmp_path, raw)
    assert c.moe_layers == (0, 1, 2, 3) and c.dense_layers == () and c.intermediate_size == 0
    raw = qwen3_moe(num_hidden_layers=4, mlp_only_layers=[2])
    del raw["decoder_sparse_step"]
    assert target_from_file(tmp_path, raw).moe_layers == (0, 1, 3)


# ----------------------------------------------------------------------------- drafts' config
def test_the_smallest_block_is_two(tmp_path: Path) -> None:
    """A draft block of 2 (the anchor and one proposal) is valid; 1 is refused."""
    assert draft_from_file(tmp_path, draft_raw(dflash={"block_size": 2})).block_size == 2
    with pytest.raises(ConfigError, match=r"block_size must be >= 2, got 1"):
        draft_from_file(tmp_path, draft_raw(dflash={"block_size": 1}))


def test_selector_top_k_may_be_the_whole_vocabulary(tmp_path: Path) -> None:
    """A DFlash2 selector may keep every token of the vocabulary as a candidate; one more
    than the vocabulary is refused."""
    raw = published_config()
    vocab = raw["vocab_size"]
    raw["dflash_config"]["selector_top_k"] = vocab
    assert draft_from_file(tmp_path, raw).selector_top_k == vocab
    raw["dflash_config"]["selector_top_k"] = vocab + 1
    with pytest.raises(ConfigError, match=rf"selector_top_k {vocab + 1} exceeds the vocabulary {vocab}"):
        draft_from_file(tmp_path, raw)


def test_without_is_causal_sliding_layers_are_causal_and_full_layers_are_not(tmp_path: Path) -> None:
    """A DFlash2 draft that says nothing of causality follows the legacy rule per layer:
    sliding_attention layers attend causally inside the block, full_attention layers see
    the whole block."""
    raw = published_config()
    del raw["is_causal"]
    raw["layer_types"] = [S, F, S, F, F]
    c = draft_from_file(tmp_path, raw)
    assert c.causal is None
    assert [c.layer_causal(i) for i in range(5)] == [True, False, True, False, False]


def test_dflash_config_causal_wins_over_is_causal(tmp_path: Path) -> None:
    """DFlash2's causality is `dflash_config.causal` when given, else the top-level
    `is_causal`; either, when given, applies to every layer."""
    raw = published_config()
    raw["dflash_config"]["causal"] = True
    c = draft_from_file(tmp_path, raw)  # is_causal false at the top level
    assert c.causal is True and all(c.layer_causal(i) for i in range(5))
    raw["dflash_config"]["causal"] = False
    raw["is_causal"] = True
    assert not any(draft_from_file(tmp_path, raw).layer_causal(i) for i in range(5))


@pytest.mark.parametrize("value", ["false", 0, 1, "true"])
def test_an_is_causal_that_is_not_a_boolean_is_refused(tmp_path: Path, value: Any) -> None:
    """`is_causal` is true or false: the string "false" (which Python reads as true) or a
    number is a ConfigError naming the field."""
    raw = published_config()
    raw["is_causal"] = value
    with pytest.raises(ConfigError, match=r"'is_causal' must be true or false, got "):
        draft_from_file(tmp_path, raw)


def test_a_draft_naming_both_architectures_is_dflash2(tmp_path: Path) -> None:
    """`architectures` naming both DFlashDraftModel and DFlash2DraftModel, in either order,
    is read as DFlash2."""
    for names in (["DFlashDraftModel", "DFlash2DraftModel"], ["DFlash2DraftModel", "DFlashDraftModel"]):
        raw = published_config()
        raw["architectures"] = names
        c = draft_from_file(tmp_path, raw)
        assert c.is_dflash2 and c.architecture == "DFlash2DraftModel"


def test_a_softcap_of_zero_or_null_means_no_softcapping(tmp_path: Path) -> None:
    """`final_logit_softcapping` 0 or null turns the cap off (None); a positive value is kept
    as a float."""
    for value in (0, 0.0, None):
        c = draft_from_file(tmp_path, draft_raw(final_logit_softcapping=value))
        assert c.final_logit_softcapping is None, value
    assert draft_from_file(tmp_path, draft_raw(final_logit_softcapping=30)).final_logit_softcapping == 30.0


def test_draft_head_shape_defaults_follow_hidden_and_heads(tmp_path: Path) -> None:
    """Without `head_dim` or `num_key_value_heads` a draft takes hidden_size //
    num_attention_heads and num_attention_heads; without `rms_norm_eps`, 1e-6."""
    raw = draft_raw(drop=("head_dim", "num_key_value_heads", "rms_norm_eps"))
    c = draft_from_file(tmp_path, raw)
    assert c.head_dim == 4096 // 32
    assert c.num_key_value_heads == 32
    assert c.rms_norm_eps == 1e-6
    narrow = draft_from_file(tmp_path, draft_raw(drop=("head_dim",), hidden_size=2048))
    assert narrow.head_dim == 2048 // 32


def test_a_draft_with_attention_bias_expects_and_loads_the_biases(
    tiny_pair: TinyPair, copy_checkpoint: CopyCheckpoint
) -> None:
    """`attention_bias: true` in a draft's config.json gives its attention projections
    biases: a checkpoint holding them loads them, one without them is missing tensors."""
    from reference_engine.models import draft_expected_shapes

    target_dir, draft_dir = tiny_pair("qwen3")
    target = load_target(target_dir)
    path = copy_checkpoint(draft_dir)
    raw = json.loads((path / "config.json").read_text())
    raw["attention_bias"] = True
    (path / "config.json").write_text(json.dumps(raw))
    config = DraftConfig.from_hf(raw)
    assert config.attention_bias
    biases = {n: s for n, s in draft_expected_shapes(config).items() if n.endswith("_proj.bias")}
    assert {n.split(".")[-2] for n in biases} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) .*self_attn\.q_proj\.bias"):
        load_draft(path, target)
    gen = torch.Generator().manual_seed(0)
    added = {n: torch.randn(s, generator=gen) for n, s in biases.items()}
    rewrite(path, lambda t: t.update(added))
    loaded = load_draft(path, target).state_dict()
    for name, bias in added.items():
        assert torch.equal(loaded[name], bias), name


def test_an_empty_target_layer_ids_list_falls_back_to_the_published_spread(tmp_path: Path) -> None:
    """`target_layer_ids: []` reads as absent: the draft takes z-lab's published spread over
    its target's layers, not an empty feature list."""
    c = draft_from_file(tmp_path, draft_raw(dflash={"target_layer_ids": []}))
    assert c.target_layer_ids == published_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert c.num_features == 5


@pytest.mark.parametrize("window", [-1, -4096, True, 2.5])
def test_a_negative_sliding_window_is_refused(tmp_path: Path, window: int) -> None:
    """Sliding layers with `use_sliding_window` need a positive integer `sliding_window`: a
    negative one, a boolean or a fraction is a ConfigError in a target's config and in a
    draft's, as 0 is."""
    raw = qwen3(num_hidden_layers=2, layer_types=[F, S], sliding_window=window, use_sliding_window=True)
    with pytest.raises(ConfigError, match=r"sliding_window must be a positive integer"):
        target_from_file(tmp_path, raw)
    with pytest.raises(ConfigError, match=r"sliding_window must be a positive integer"):
        draft_from_file(
            tmp_path, draft_raw(layer_types=[S, F, F, F, F], sliding_window=window, use_sliding_window=True)
        )
