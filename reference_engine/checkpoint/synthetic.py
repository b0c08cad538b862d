"""Tiny random checkpoints in the real on-disk formats, written by our own code for tests and
loaded back through the same loader that reads real checkpoints; random weights for the
benchmarks' real-shaped models."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config import DraftConfig, TargetConfig
from ..errors import CheckpointError, ConfigError
from ..models import draft_expected_shapes, expected_shapes
from ..tokenizer import EOS_TOKEN, MASK_TOKEN, build_tiny_tokenizer, load_tokenizer, save_tokenizer
from . import WRAPPER_PREFIX, read_config, write_safetensors


def random_weights(
    shapes: dict[str, tuple[int, ...]],
    seed: int,
    norm_offset: bool,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    keep: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Random weights scaled so that models give varied, non-degenerate logits. Drawn in
    float32 on `device` (real-shaped models straight on the GPU), then cast to `dtype`.
    `keep(name, tensor)` gives what to hold of each tensor as it is drawn (a rank's slice
    under tensor parallelism), so that only one whole tensor exists at a time; the values
    are those drawn without it."""
    tied = "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32, device=device) * std

    out = {}
    for name, shape in shapes.items():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("A_log"):
            out[name] = torch.empty(shape, device=device).uniform_(0.0, 2.5, generator=gen)
        elif name.endswith("dt_bias"):
            out[name] = 1.0 + normal(shape, 0.1)
        elif name.endswith("conv1d.weight"):
            out[name] = normal(shape, 0.5)
        elif leaf == "base_kernel":  # DFlash2 [2, taps, hidden]: near the identity at tap 0
            out[name] = normal(shape, 0.1)
            out[name][:, 0] += 1.0
        elif name.endswith("kernel_projection.weight"):  # DFlash2 dynamic taps, beside the base
            out[name] = normal(shape, 0.3 * shape[-1] ** -0.5)
        elif leaf.endswith("_codebook"):  # DFlash2 selector [vocab, rank]: bigrams of order 1
            out[name] = normal(shape, shape[-1] ** -0.25)
        elif len(shape) == 1 and leaf == "weight":  # norm weights
            offset_norm = norm_offset and not name.endswith("linear_attn.norm.weight")
            out[name] = normal(shape, 0.1) + (0.0 if offset_norm else 1.0)
        elif leaf in ("gate_up_proj", "down_proj"):  # fused experts [E, out, in]
            out[name] = normal(shape, shape[-1] ** -0.5)
        elif name.endswith("embed_tokens.weight"):
            # tied embeddings double as the lm_head: unit scale would make the fed token's
            # own logit dominate and greedy output repeat one token forever
            out[name] = normal(shape, shape[-1] ** -0.5 if tied else 1.0)
        elif leaf == "weight":
            out[name] = normal(shape, shape[-1] ** -0.5)
        else:  # biases
            out[name] = normal(shape, 0.1)
        out[name] = out[name].to(dtype)
        if keep is not None:
            out[name] = keep(name, out[name])
    return out


TINY_ARCHS = ("qwen3", "qwen3_5", "llama", "qwen3_moe", "qwen3_5_moe")
HYBRID_ARCHS = ("qwen3_5", "qwen3_5_moe")  # those with a multimodal wrapper
EXPERT_LAYOUTS = ("per_expert", "fused")


def tiny_target_config(
    arch: str, layers: int, hidden: int, vocab: int, tie: bool, eos_id: int
) -> dict[str, Any]:
    """A config.json dict in the real Hugging Face format for a tiny target."""
    if hidden % 32:
        raise ConfigError(f"--hidden must be a multiple of 32 for tiny models, got {hidden}")
    common = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": tie,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
    }
    if arch == "qwen3":
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **common,
            "num_attention_heads": hidden // 16,
            "num_key_value_heads": max(1, hidden // 32),
            "head_dim": 16,
            "rope_theta": 10000.0,
            "rope_scaling": None,
            "use_sliding_window": False,
            "torch_dtype": "float32",
        }
    if arch == "qwen3_5":
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            **common,
            "num_attention_heads": max(2, hidden // 32),
            "num_key_value_heads": 1,
            "head_dim": 32,
            "layer_types": [
                "full_attention" if (i + 1) % 2 == 0 else "linear_attention" for i in range(layers)
            ],
            "linear_num_key_heads": max(1, hidden // 32),
            "linear_num_value_heads": 2 * max(1, hidden // 32),
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
            "torch_dtype": "float32",
        }
    if arch in ("qwen3_moe", "qwen3_5_moe"):
        dense = tiny_target_config(arch.removesuffix("_moe"), layers, hidden, vocab, tie, eos_id)
        experts = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": hidden // 2}
        if arch == "qwen3_moe":  # the last layer dense (with more than one layer)
            return {
                **dense,
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                **experts,
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [layers - 1] if layers > 1 else [],
            }
        del dense["intermediate_size"]  # every layer MoE; a shared expert wider than the routed
        return {
            **dense,
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_moe_text",
            **experts,
            "shared_expert_intermediate_size": hidden * 3 // 4,
        }
    if arch == "llama":
        # Llama 3.1's RoPE scaling factors, with original_max_position_embeddings 256 (8192
        # in Llama 3.1) so that at the positions of a test (about 100) the scaling changes
        # the logits: head_dim 16 puts 2 frequencies in the kept band, 1 interpolated, 5
        # divided by the factor
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **common,
            "num_attention_heads": hidden // 16,
            "num_key_value_heads": max(1, hidden // 32),
            "head_dim": 16,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
            "mlp_bias": False,
            "torch_dtype": "float32",
        }
    raise ConfigError(f"unknown --arch '{arch}', expected one of {', '.join(TINY_ARCHS)}")


def wrap_multimodal(text_config: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3.5 (or Qwen3.5-MoE) multimodal wrapper config around a text config."""
    moe = text_config["model_type"] == "qwen3_5_moe_text"
    name, model_type = ("Qwen3_5Moe", "qwen3_5_moe") if moe else ("Qwen3_5", "qwen3_5")
    return {
        "architectures": [f"{name}ForConditionalGeneration"],
        "model_type": model_type,
        "text_config": text_config,
        "vision_config": {"model_type": f"{model_type}_vision", "depth": 1, "hidden_size": 32},
        "tie_word_embeddings": text_config["tie_word_embeddings"],
    }


def per_expert_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert tensors (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first;
    `mlp.experts.down_proj` [E, H, I]) split into one tensor per expert and projection
    (`mlp.experts.{e}.{gate,up,down}_proj.weight`), as `save_pretrained` writes them."""
    out = {}
    for name, t in tensors.items():
        experts, _, leaf = name.rpartition(".")
        if not experts.endswith(".mlp.experts") or leaf not in ("gate_up_proj", "down_proj"):
            out[name] = t
            continue
        for e in range(t.shape[0]):
            if leaf == "down_proj":
                out[f"{experts}.{e}.down_proj.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2, dim=0)
                out[f"{experts}.{e}.gate_proj.weight"] = gate
                out[f"{experts}.{e}.up_proj.weight"] = up
    return out


def check_out_dir(out: Path) -> None:
    """A checkpoint is a folder: refuse an `out` that is something else before writing."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} exists and is not a folder")


def make_tiny_target(
    out: str | Path,
    arch: str = "qwen3",
    seed: int = 0,
    layers: int = 4,
    hidden: int = 64,
    vocab: int = 512,
    tie_word_embeddings: bool = False,
    multimodal_wrapper: bool = False,
    shards: int = 1,
    dtype: torch.dtype = torch.float32,
    with_tokenizer: bool = True,
    bias: bool = False,
    expert_layout: str = "per_expert",
    config_overrides: tuple[tuple[str, Any], ...] = (),
) -> Path:
    """Write a tiny random target with a tiny tokenizer, in the real on-disk format.

    `with_tokenizer=False` allows vocabularies too small for a byte-level BPE (statistical
    tests want a handful of tokens); token-id prompts still work. `bias`: attention_bias
    (and, for llama, mlp_bias) true. `expert_layout` (MoE archs): "per_expert", what
    transformers' `save_pretrained` writes by default, or "fused"; the weights are the same
    for one seed. `config_overrides`: (field, value) pairs set in the (text) config before
    the weights are drawn, for variants of an arch (experts, top-k, dense layers)."""
    out = Path(out)
    if multimodal_wrapper and arch not in HYBRID_ARCHS:
        raise ConfigError(
            f"--multimodal-wrapper applies to --arch {' or '.join(HYBRID_ARCHS)} only, got {arch}"
        )
    if expert_layout not in EXPERT_LAYOUTS:
        raise ConfigError(
            f"--expert-layout must be one of {', '.join(EXPERT_LAYOUTS)}, got {expert_layout!r}"
        )
    if layers <= 0 or vocab <= 0:
        raise ConfigError(f"--layers and --vocab must be positive, got {layers} and {vocab}")
    if shards < 1:
        raise ConfigError(f"--shards must be >= 1, got {shards}")
    check_out_dir(out)
    tokenizer = build_tiny_tokenizer(vocab) if with_tokenizer else None
    eos_id = tokenizer.token_to_id(EOS_TOKEN) if tokenizer is not None else vocab - 2
    raw = tiny_target_config(arch, layers, hidden, vocab, tie_word_embeddings, eos_id)
    if bias:
        raw["attention_bias"] = True
        if arch == "llama":
            raw["mlp_bias"] = True
    raw.update(dict(config_overrides))
    raw["torch_dtype"] = str(dtype).removeprefix("torch.")  # what the weights are stored in
    config = TargetConfig.from_hf(raw)
    tensors = random_weights(expected_shapes(config), seed, config.norm_offset)
    if expert_layout == "per_expert":
        tensors = per_expert_layout(tensors)
    if multimodal_wrapper:
        gen = torch.Generator().manual_seed(seed + 1)
        tensors = {
            (WRAPPER_PREFIX + n[len("model.") :] if n.startswith("model.") else n): t
            for n, t in tensors.items()
        }
        # present in real checkpoints, ignored by text-only loading
        tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2, generator=gen)
        tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen)
        if config.is_moe:
            tensors["mtp.layers.0.mlp.experts.gate_up_proj"] = torch.randn(2, 4, hidden, generator=gen)
        raw = wrap_multimodal(raw)
    write_safetensors(out, {n: t.to(dtype) for n, t in tensors.items()}, shards)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    if tokenizer is not None:
        save_tokenizer(tokenizer, out)
    return out


def spread_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """`count` distinct target layers spread over 0..N-2 (tiny targets are too shallow for
    the published 1..N-3 spread to stay distinct)."""
    top = max(num_target_layers - 2, 0)
    ids = sorted({round(i * top / max(count - 1, 1)) for i in range(count)})
    return ids


TINY_DRAFT_ARCHS = ("dflash", "dflash2")
# the tiny DFlash2 draft: the published dflash_config (kernel 2, groups of 16) at a small rank
# and K; a window shorter than the gates' longest prompt, so that sliding is exercised
TINY_DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}
TINY_DFLASH2_WINDOW = 64


def make_tiny_draft(
    out: str | Path,
    target: str | Path,
    block_size: int = 8,
    layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    arch: str = "dflash",
) -> Path:
    """Write a tiny random draft matching the target in `target`: DFlash (z-lab layout) or,
    with `arch` "dflash2", DFlash2 in the published layout (`DFlash2DraftModel`, every layer
    sliding_attention, `is_causal` false, the convolution and selector fields in
    `dflash_config`)."""
    if arch not in TINY_DRAFT_ARCHS:
        raise ConfigError(f"unknown draft arch '{arch}', expected one of {', '.join(TINY_DRAFT_ARCHS)}")
    out = Path(out)
    if block_size < 2:
        raise ConfigError(f"--block-size must be >= 2, got {block_size}")
    if layers <= 0:
        raise ConfigError(f"--layers must be positive, got {layers}")
    check_out_dir(out)
    target_config = TargetConfig.from_hf(read_config(target))
    try:
        mask = load_tokenizer(target).token_to_id(MASK_TOKEN)
    except CheckpointError:
        mask = None
    if mask is None:
        mask = target_config.vocab_size - 1
    hidden = target_config.hidden_size
    head_dim = 16 if hidden % 16 == 0 else hidden
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": target_config.vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // head_dim,
        "num_key_value_heads": max(1, hidden // head_dim // 2),
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": target_config.max_position_embeddings,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "block_size": block_size,
        "num_target_layers": target_config.num_hidden_layers,
        "dflash_config": {
            "target_layer_ids": spread_layer_ids(target_config.num_hidden_layers, 2),
            "mask_token_id": mask,
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if target_config.rope_scaling is not None:  # as z-lab's Llama 3.1 drafts: the target's RoPE
        target_raw = read_config(target)
        raw["rope_theta"], raw["rope_scaling"] = target_config.rope_theta, target_raw["rope_scaling"]
    if arch == "dflash2":
        raw["architectures"] = ["DFlash2DraftModel"]
        raw["layer_types"] = ["sliding_attention"] * layers
        raw["sliding_window"] = TINY_DFLASH2_WINDOW
        raw["use_sliding_window"] = True
        raw["is_causal"] = False
        raw["dflash_config"] |= {"block_size": block_size, **TINY_DFLASH2}
    config = DraftConfig.from_hf(raw)
    tensors = random_weights(draft_expected_shapes(config), seed, norm_offset=False)
    write_safetensors(out, {n: t.to(dtype) for n, t in tensors.items()})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out
