"""Named real model shapes with random weights, for benchmarks on machines without the
real checkpoints: `random_pair("qwen3-8b", "cuda", torch.bfloat16)`.

The sizes follow the published configs of the named models (Qwen3-8B; Qwen3.5-4B's text
model; Llama-3.1-8B-Instruct; Qwen3-30B-A3B; Qwen3.5-35B-A3B's text model) and a 5-layer
block-16 DFlash draft shaped like z-lab's (DRAFT_HEADS: for the MoE targets the heads and
width of z-lab's Qwen3.5-35B-A3B draft, for Llama the target's own). Weights are random: a
random draft is accepted about never, so benchmarks pair these with the oracle proposer
at a chosen acceptance length (forced: see runtime/oracle.OracleProposer). Speed depends on shapes,
not on weight values.
"""

from __future__ import annotations

from typing import Any

import torch

from ..checkpoint import assemble_draft, assemble_target
from ..checkpoint.synthetic import random_weights
from ..config import DraftConfig, TargetConfig, published_target_layer_ids
from ..errors import ConfigError
from ..models import CausalLM, draft_expected_shapes, expected_shapes
from ..models.dflash import DFlashDraft
from ..runtime.tensor_parallel import TensorParallel, shard_plan, sharded_target

TARGET_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "eos_token_id": 151645,
    },
    "qwen3.5-4b": {
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "hidden_size": 2560,
        "intermediate_size": 9216,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 262144,
        "tie_word_embeddings": True,
        "eos_token_id": 248044,
    },
    "llama3.1-8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "eos_token_id": [128001, 128008, 128009],
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,  # no dense layer uses it
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "eos_token_id": 151645,
    },
    "qwen3.5-35b-a3b": {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
        "eos_token_id": 248044,
    },
    # small stand-ins with the same structure, for CPU smoke runs and tests
    "qwen3-small": {
        "model_type": "qwen3",
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "eos_token_id": 4095,
    },
    "qwen3.5-small": {
        "model_type": "qwen3_5_text",
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "eos_token_id": 4095,
    },
    "qwen3-moe-small": {
        "model_type": "qwen3_moe",
        "vocab_size": 4096,
        "hidden_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "eos_token_id": 4095,
    },
}
DRAFT_HEADS = {
    "qwen3-8b": (32, 8, 128, 12288),
    "qwen3.5-4b": (32, 8, 128, 9216),
    "llama3.1-8b": (32, 8, 128, 14336),
    "qwen3-30b-a3b": (32, 4, 128, 6144),
    "qwen3.5-35b-a3b": (32, 4, 128, 6144),
    "qwen3-small": (4, 2, 64, 512),
    "qwen3.5-small": (4, 2, 64, 512),
    "qwen3-moe-small": (4, 2, 64, 512),
}


DRAFT_ARCHS = ("dflash", "dflash2")
# z-lab/Qwen3.8-27B-DFlash2's choices, for a DFlash2 draft of any shape: every layer a
# sliding window of 2048 attending its block non-causally, kernel 2, groups of 16, rank 256, K 16
DFLASH2_FIELDS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
DFLASH2_WINDOW = 2048


def draft_raw(shape: str, block_size: int, layers: int, arch: str = "dflash") -> dict[str, Any]:
    """The config.json of a random draft for `shape`: DFlash, or (arch "dflash2") DFlash2 with
    the published DFlash2 fields on the same heads and width."""
    if arch not in DRAFT_ARCHS:
        raise ConfigError(f"unknown draft arch '{arch}', expected one of {', '.join(DRAFT_ARCHS)}")
    raw = _dflash_raw(shape, block_size, layers)
    if arch == "dflash2":
        raw["architectures"] = ["DFlash2DraftModel"]
        raw["layer_types"] = ["sliding_attention"] * layers
        raw["sliding_window"] = DFLASH2_WINDOW
        raw["is_causal"] = False
        raw["dflash_config"] |= DFLASH2_FIELDS
    return raw


def _dflash_raw(shape: str, block_size: int, layers: int) -> dict[str, Any]:
    target = TARGET_SHAPES[shape]
    heads, kv_heads, head_dim, intermediate = DRAFT_HEADS[shape]
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": target["vocab_size"],
        "hidden_size": target["hidden_size"],
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": target["max_position_embeddings"],
        "block_size": block_size,
        "num_target_layers": target["num_hidden_layers"],
        "dflash_config": {
            "target_layer_ids": list(published_target_layer_ids(target["num_hidden_layers"], layers)),
            "mask_token_id": target["vocab_size"] - 1,
        },
    }


def random_pair(
    shape: str,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    block_size: int = 16,
    draft_layers: int = 5,
    draft_arch: str = "dflash",
    tensor_parallel: TensorParallel | None = None,
) -> tuple[CausalLM, DFlashDraft]:
    """A random target of a real shape and its random draft. Under `tensor_parallel`, this
    rank's slice of the target (the slices of the target drawn whole, bit for bit), drawn one
    tensor at a time: the whole target never exists on the rank."""
    if shape not in TARGET_SHAPES:
        raise ConfigError(f"unknown shape '{shape}', expected one of {', '.join(TARGET_SHAPES)}")
    tconfig = TargetConfig.from_hf(TARGET_SHAPES[shape])
    shapes = expected_shapes(tconfig)
    if tensor_parallel is None:
        tensors = random_weights(shapes, seed, tconfig.norm_offset, device, dtype)
        target = assemble_target(tconfig, tensors, device)
    else:
        plan = shard_plan(tconfig, shapes, tensor_parallel)

        def keep(name: str, whole: torch.Tensor) -> torch.Tensor:
            return whole if plan[name] is None else plan[name].take(whole)

        tensors = random_weights(shapes, seed, tconfig.norm_offset, device, dtype, keep)
        target = sharded_target(tconfig, tensors, tensor_parallel, device)
    return target, random_draft(shape, device, dtype, seed, block_size, draft_layers, draft_arch)


def random_draft(
    shape: str,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    block_size: int = 16,
    draft_layers: int = 5,
    draft_arch: str = "dflash",
) -> DFlashDraft:
    """The draft of `random_pair` alone, so that one target is measured with a draft of
    each architecture."""
    dconfig = DraftConfig.from_hf(draft_raw(shape, block_size, draft_layers, draft_arch))
    return assemble_draft(
        dconfig,
        random_weights(draft_expected_shapes(dconfig), seed + 1, False, device, dtype),
        device,
    )
