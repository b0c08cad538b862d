"""Checkpoint loading against files laid out as Hugging Face lays them out, written here
under their literal names rather than by the project's writer: a Qwen3.5-MoE multimodal
wrapper (tensors under `model.language_model.`, one tensor per expert, the shared expert
and its gate, Gated DeltaNet key and value head dims that differ, an explicit head_dim that
is not hidden / heads, `mtp.*` and `model.visual.*` beside them) loads every tensor into the
parameter of its name; bfloat16 tensors outside float16's range widen exactly; a tensor
stored under both its wrapper name and its text-only name is refused, not picked by name
order, and so are experts stored one tensor per expert under both prefixes.

Also pinned: the shard index's refusals name the file (the last shard missing, a shard
that lacks the tensor the index maps to it); the defaults of an absent field as
transformers has them (rms_norm_eps 1e-6 for every family, `tie_word_embeddings` false, at
both levels of a wrapper); a draft's `rope_parameters.rope_theta`; the tiny writer's
wrapper config saying the same tie at both levels; a tiny draft's mask token being its
target tokenizer's `<|mask|>` (the last id without a tokenizer); and the make-tiny
command's `--shards` and `--dtype` reaching the files (the index, the shards, the stored
dtype and the config's `torch_dtype`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from reference_engine.checkpoint import INDEX_FILE, SINGLE_FILE, load_draft, load_target
from reference_engine.checkpoint.__main__ import main as checkpoint_main
from reference_engine.checkpoint.synthetic import make_tiny_draft, make_tiny_target
from reference_engine.errors import CheckpointError
from reference_engine.models.layers import GatedRMSNorm, RMSNorm

TinyCheckpoint = Callable[..., Path]
TinyPair = Callable[..., tuple[Path, Path]]
CopyCheckpoint = Callable[[Path], Path]


def edit_config(path: Path, edit: Callable[[dict], None]) -> None:
    raw = json.loads((path / "config.json").read_text())
    edit(raw)
    (path / "config.json").write_text(json.dumps(raw))


def stored(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


# ----------------------------------------------------------------------------- literal HF layout
# A Qwen3.5-MoE wrapper in the layout of Qwen/Qwen3.5-35B-A3B, shrunk: every size distinct
# where two could be confused (key vs value head dims, head_dim vs hidden / heads, routed vs
# shared expert widths)
H, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 64, 96, 4, 2, 24  # hidden / heads would be 16
NK, NV, DK, DV, KERNEL = 2, 4, 16, 8, 4  # Gated DeltaNet: key heads, value heads, dims, conv taps
EXPERTS, TOP_K, MOE_I, SHARED_I = 4, 2, 32, 48
LAYER_TYPES = ["linear_attention", "full_attention"]

QWEN3_5_MOE_WRAPPER = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": VOCAB,
        "hidden_size": H,
        "num_hidden_layers": len(LAYER_TYPES),
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "layer_types": LAYER_TYPES,
        "linear_num_key_heads": NK,
        "linear_num_value_heads": NV,
        "linear_key_head_dim": DK,
        "linear_value_head_dim": DV,
        "linear_conv_kernel_dim": KERNEL,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": MOE_I,
        "shared_expert_intermediate_size": SHARED_I,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
        "eos_token_id": 1,
    },
    "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 32},
}


def literal_layer(i: int, kind: str) -> dict[str, tuple[int, ...]]:
    """Layer i's tensors, named and shaped as transformers' Qwen3.5-MoE names them
    (`save_pretrained`'s per-expert layout), before the wrapper prefix."""
    p = f"layers.{i}"
    shapes: dict[str, tuple[int, ...]] = {
        f"{p}.input_layernorm.weight": (H,),
        f"{p}.post_attention_layernorm.weight": (H,),
        f"{p}.mlp.gate.weight": (EXPERTS, H),
        f"{p}.mlp.shared_expert.gate_proj.weight": (SHARED_I, H),
        f"{p}.mlp.shared_expert.up_proj.weight": (SHARED_I, H),
        f"{p}.mlp.shared_expert.down_proj.weight": (H, SHARED_I),
        f"{p}.mlp.shared_expert_gate.weight": (1, H),
    }
    for e in range(EXPERTS):
        shapes[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (MOE_I, H)
        shapes[f"{p}.mlp.experts.{e}.up_proj.weight"] = (MOE_I, H)
        shapes[f"{p}.mlp.experts.{e}.down_proj.weight"] = (H, MOE_I)
    if kind == "linear_attention":
        conv = 2 * NK * DK + NV * DV
        shapes |= {
            f"{p}.linear_attn.in_proj_qkv.weight": (conv, H),
            f"{p}.linear_attn.in_proj_z.weight": (NV * DV, H),
            f"{p}.linear_attn.in_proj_b.weight": (NV, H),
            f"{p}.linear_attn.in_proj_a.weight": (NV, H),
            f"{p}.linear_attn.conv1d.weight": (conv, 1, KERNEL),
            f"{p}.linear_attn.dt_bias": (NV,),
            f"{p}.linear_attn.A_log": (NV,),
            f"{p}.linear_attn.norm.weight": (DV,),
            f"{p}.linear_attn.out_proj.weight": (H, NV * DV),
        }
    else:  # gated attention: q_proj emits query and gate per head
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (2 * HEADS * HEAD_DIM, H),
            f"{p}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, H),
            f"{p}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, H),
            f"{p}.self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
            f"{p}.self_attn.q_norm.weight": (HEAD_DIM,),
            f"{p}.self_attn.k_norm.weight": (HEAD_DIM,),
        }
    return shapes


def literal_wrapper_tensors() -> dict[str, torch.Tensor]:
    """Every tensor of the wrapper checkpoint under its literal name, each with values of its
    own (a tensor loaded into another parameter of the same shape shows)."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"embed_tokens.weight": (VOCAB, H), "norm.weight": (H,)}
    for i, kind in enumerate(LAYER_TYPES):
        shapes |= literal_layer(i, kind)
    tensors = {
        f"model.language_model.{name}": torch.randn(shape, generator=gen) for name, shape in shapes.items()
    }
    tensors["lm_head.weight"] = torch.randn(VOCAB, H, generator=gen)
    # present in the published checkpoints and not part of the text model
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2, generator=gen)
    tensors["mtp.fc.weight"] = torch.randn(H, 2 * H, generator=gen)
    tensors["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.randn(MOE_I, H, generator=gen)
    return tensors


def write_literal_wrapper(path: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    """config.json and the tensors in `shards` files with an index, as the hub holds them."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(QWEN3_5_MOE_WRAPPER))
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {name: files[k % shards] for k, name in enumerate(names)}
    for file in files:
        part = {n: tensors[n].contiguous() for n in names if weight_map[n] == file}
        save_file(part, str(path / file), metadata={"format": "pt"})
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_literal_qwen3_5_moe_wrapper_loads_every_tensor_into_the_parameter_of_its_name(
    tmp_path: Path,
) -> None:
    tensors = literal_wrapper_tensors()
    write_literal_wrapper(tmp_path / "wrapper", tensors, shards=3)
    model = load_target(tmp_path / "wrapper", dtype=torch.float32)
    config = model.config
    assert (config.head_dim, config.rotary_dim) == (HEAD_DIM, HEAD_DIM // 4)
    assert (config.linear_key_head_dim, config.linear_value_head_dim) == (DK, DV)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        EXPERTS,
        TOP_K,
        MOE_I,
    )
    assert config.shared_expert_intermediate_size == SHARED_I and not config.tie_word_embeddings
    params = model.state_dict()
    seen = set()
    for name, tensor in tensors.items():
        if name.startswith(("mtp.", "model.visual.")):
            continue
        if ".mlp.experts." in name:
            continue  # below, fused
        ours = "model." + name.removeprefix("model.language_model.") if name.startswith("model.") else name
        assert torch.equal(params[ours], tensor), name
        seen.add(ours)
    for i in range(len(LAYER_TYPES)):
        prefix = f"model.language_model.layers.{i}.mlp.experts"
        gate_up = params[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        down = params[f"model.layers.{i}.mlp.experts.down_proj"]
        assert gate_up.shape == (EXPERTS, 2 * MOE_I, H) and down.shape == (EXPERTS, H, MOE_I)
        for e in range(EXPERTS):
            assert torch.equal(gate_up[e, :MOE_I], tensors[f"{prefix}.{e}.gate_proj.weight"]), (i, e)
            assert torch.equal(gate_up[e, MOE_I:], tensors[f"{prefix}.{e}.up_proj.weight"]), (i, e)
            assert torch.equal(down[e], tensors[f"{prefix}.{e}.down_proj.weight"]), (i, e)
        seen |= {f"model.layers.{i}.mlp.experts.gate_up_proj", f"model.layers.{i}.mlp.experts.down_proj"}
    assert seen == set(params)
    assert model.lm_head_weight is model.lm_head.weight


def test_bfloat16_tensors_outside_float16s_range_widen_exactly(tmp_path: Path) -> None:
    """A bfloat16 checkpoint read as float32 keeps every stored bit, values float16 cannot hold
    (1e-7, below its subnormals; 1e30, past its largest) included."""
    tensors = {k: v.to(torch.bfloat16) for k, v in literal_wrapper_tensors().items()}
    extreme = torch.tensor([1e-7, -3e-9, 1e30, -2e35, 1.0009765625, 65504 * 4], dtype=torch.bfloat16)
    embed = tensors["model.language_model.embed_tokens.weight"].clone()
    embed[0, : len(extreme)] = extreme
    tensors["model.language_model.embed_tokens.weight"] = embed
    write_literal_wrapper(tmp_path / "bf16", tensors, shards=1)
    model = load_target(tmp_path / "bf16", dtype=torch.float32)
    loaded = model.model.embed_tokens.weight
    assert loaded.dtype == torch.float32
    assert torch.equal(loaded, embed.float())
    assert torch.equal(loaded[0, : len(extreme)], extreme.float())
    assert torch.isfinite(loaded).all() and (loaded[0, :2] != 0).all()


def test_a_wrapper_tensor_also_stored_under_its_text_only_name_is_refused(
    tiny_checkpoint: TinyCheckpoint, copy_checkpoint: CopyCheckpoint
) -> None:
    path = copy_checkpoint(tiny_checkpoint("qwen3_5", layers=2, multimodal_wrapper=True))
    tensors = load_file(str(path / SINGLE_FILE))
    tensors["model.norm.weight"] = torch.full_like(tensors["model.language_model.norm.weight"], 7.0)
    save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.language_model\.norm\.weight.*model\.norm\.weight"):
        load_target(path)


def test_experts_stored_one_per_expert_under_both_prefixes_are_refused(tmp_path: Path) -> None:
    """The per-expert tensors of one layer under the wrapper's prefix and again under the
    text-only one are two copies of the experts: refused naming both, not the last read."""
    tensors = literal_wrapper_tensors()
    for e in range(EXPERTS):
        for proj in ("gate", "up", "down"):
            name = f"model.language_model.layers.1.mlp.experts.{e}.{proj}_proj.weight"
            tensors[name.replace("language_model.", "")] = torch.zeros_like(tensors[name])
    write_literal_wrapper(tmp_path / "twice", tensors, shards=2)
    with pytest.raises(
        CheckpointError,
        match=r"model\.language_model\.layers\.1\.mlp\.experts and under model\.layers\.1\.mlp\.experts",
    ):
        load_target(tmp_path / "twice")


# ----------------------------------------------------------------------------- the shard index
@pytest.mark.parametrize("shard", [1, 2, 3])
def test_any_missing_shard_listed_in_the_index_is_named(
    tiny_checkpoint: TinyCheckpoint, copy_checkpoint: CopyCheckpoint, shard: int
) -> None:
    """The first, a middle or the last shard gone: the index's refusal names that file."""
    path = copy_checkpoint(tiny_checkpoint("qwen3", shards=3))
    name = f"model-{shard:05d}-of-00003.safetensors"
    (path / name).unlink()
    with pytest.raises(CheckpointError, match=rf"{INDEX_FILE} lists shard {name}, which is missing"):
        load_target(path)


def test_an_index_mapping_a_tensor_to_a_shard_without_it_names_the_tensor_and_the_shard(
    tiny_checkpoint: TinyCheckpoint, copy_checkpoint: CopyCheckpoint
) -> None:
    path = copy_checkpoint(tiny_checkpoint("qwen3", shards=3))
    index = json.loads((path / INDEX_FILE).read_text())
    name = "model.layers.1.mlp.down_proj.weight"
    elsewhere = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    index["weight_map"][name] = elsewhere
    (path / INDEX_FILE).write_text(json.dumps(index))
    pattern = rf"the index maps {name.replace('.', '[.]')} to {elsewhere.replace('.', '[.]')}, which does not"
    with pytest.raises(CheckpointError, match=pattern):
        load_target(path)


# ----------------------------------------------------------------------------- absent fields
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5", "qwen3_moe"])
def test_an_absent_rms_norm_eps_is_1e_6_in_every_norm_of_the_loaded_model(
    tiny_checkpoint: TinyCheckpoint, copy_checkpoint: CopyCheckpoint, arch: str
) -> None:
    """transformers' default for every family (the tiny Llama states 1e-5, which must not
    stay either)."""
    path = copy_checkpoint(tiny_checkpoint(arch, layers=2))
    edit_config(path, lambda raw: raw.pop("rms_norm_eps"))
    model = load_target(path)
    assert model.config.rms_norm_eps == 1e-6
    norms = [m for m in model.modules() if isinstance(m, (RMSNorm, GatedRMSNorm))]
    assert len(norms) >= 4
    assert {m.eps for m in norms} == {1e-6}


def test_an_absent_rms_norm_eps_is_1e_6_in_a_loaded_draft(
    tiny_pair: TinyPair, copy_checkpoint: CopyCheckpoint
) -> None:
    target_dir, draft_dir = tiny_pair("qwen3")
    path = copy_checkpoint(draft_dir)
    edit_config(path, lambda raw: raw.pop("rms_norm_eps"))
    draft = load_draft(path, load_target(target_dir))
    norms = [m for m in draft.modules() if isinstance(m, RMSNorm)]
    assert norms and {m.eps for m in norms} == {1e-6}


@pytest.mark.parametrize("wrapper", [False, True], ids=["text-only", "wrapper"])
def test_an_absent_tie_word_embeddings_is_untied_and_the_stored_lm_head_is_used(
    tiny_checkpoint: TinyCheckpoint, copy_checkpoint: CopyCheckpoint, wrapper: bool
) -> None:
    arch = "qwen3_5" if wrapper else "qwen3"
    path = copy_checkpoint(tiny_checkpoint(arch, layers=2, multimodal_wrapper=wrapper))

    def drop(raw: dict) -> None:
        raw.pop("tie_word_embeddings")
        raw.get("text_config", {}).pop("tie_word_embeddings", None)

    edit_config(path, drop)
    model = load_target(path)
    assert not model.config.tie_word_embeddings
    lm_head = stored(path)["lm_head.weight"]
    assert torch.equal(model.lm_head_weight, lm_head)
    assert not torch.equal(model.lm_head_weight, model.model.embed_tokens.weight)


def test_a_drafts_rope_theta_in_rope_parameters_sets_its_rotary_frequencies(
    tiny_pair: TinyPair, copy_checkpoint: CopyCheckpoint
) -> None:
    """A transformers 5 draft config holds the base only in `rope_parameters`."""
    target_dir, draft_dir = tiny_pair("qwen3")
    path = copy_checkpoint(draft_dir)

    def to_v5(raw: dict) -> None:
        raw.pop("rope_theta")
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}

    edit_config(path, to_v5)
    draft = load_draft(path, load_target(target_dir))
    assert draft.config.rope_theta == 1e6
    dim = draft.config.head_dim
    expected = 1.0 / (1e6 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    assert torch.equal(draft.rotary.inv_freq, expected)


# ----------------------------------------------------------------------------- the writer
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_a_tiny_wrapper_says_the_same_tie_at_both_levels(tmp_path: Path, tie: bool) -> None:
    """transformers' ForConditionalGeneration ties by the outer config, the text model by
    text_config: a written wrapper must not make them disagree."""
    path = make_tiny_target(
        tmp_path / "w", arch="qwen3_5", layers=2, tie_word_embeddings=tie, multimodal_wrapper=True
    )
    raw = json.loads((path / "config.json").read_text())
    assert raw["tie_word_embeddings"] is tie
    assert raw["text_config"]["tie_word_embeddings"] is tie
    assert ("lm_head.weight" in stored(path)) is not tie


@pytest.mark.parametrize("mask_id", [7, None], ids=["tokenizer-mask", "no-tokenizer"])
def test_a_tiny_draft_takes_its_targets_mask_token_else_the_last_id(
    tmp_path: Path, mask_id: int | None
) -> None:
    """The draft's `dflash_config.mask_token_id` is the id the target's tokenizer.json gives
    `<|mask|>` wherever it sits, and the vocabulary's last id without a tokenizer."""
    vocab = 300
    target = make_tiny_target(tmp_path / "t", arch="qwen3", layers=2, vocab=vocab, with_tokenizer=False)
    if mask_id is not None:
        words = {f"w{i}": i for i in range(vocab)}
        words.pop(f"w{mask_id}")
        words["<|mask|>"] = mask_id
        Tokenizer(WordLevel(words, unk_token="w0")).save(str(target / "tokenizer.json"))
    draft = make_tiny_draft(tmp_path / "d", target)
    raw = json.loads((draft / "config.json").read_text())
    assert raw["dflash_config"]["mask_token_id"] == (vocab - 1 if mask_id is None else mask_id)
    assert (
        load_draft(draft, load_target(target)).config.mask_token_id == raw["dflash_config"]["mask_token_id"]
    )


def test_make_tiny_writes_the_shards_and_the_dtype_it_is_asked_for(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli"
    argv = ["make-tiny", "--arch", "qwen3", "--out", str(out), "--layers", "2", "--vocab", "300"]
    assert checkpoint_main([*argv, "--shards", "2", "--dtype", "bfloat16"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert not (out / SINGLE_FILE).exists()
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    for file in files:
        with safe_open(str(out / file), framework="pt") as f:
            assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"BF16"}, file
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # the same weights as the Python API writes for those options
    same = make_tiny_target(tmp_path / "api", arch="qwen3", layers=2, vocab=300, dtype=torch.bfloat16)
    written, expected = stored(out), stored(same)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[n], expected[n]) for n in expected)
