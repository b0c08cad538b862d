"""The recipe's settings: `Recipe`, one frozen dataclass validated when built, from which the
target's and the draft's config.json follow (`target_config`, `draft_config`); `Recipe.smoke`
is the seconds-long CPU run. Every int and float field is a flag of the command line
(recipe.py builds it from these fields)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config.draft import FINAL_NORM, LAST_LAYER_FEATURES, RAW
from ..demo import DEMO_RESULTS

RESULTS_FILE = DEMO_RESULTS.name
DRAFT_ARCHS = ("dflash", "dflash2")
DFLASH2_WINDOW = 2048  # the published draft's sliding window, longer than any demo context


# the settings that count something (steps, sizes, intervals): 0 or fewer cannot train
POSITIVE_COUNTS = (
    "vocab_size",
    "tokenizer_chars",
    "hidden_size",
    "target_layers",
    "draft_layers",
    "block_size",
    "seq_len",
    "target_steps",
    "validate_every",
    "target_batch",
    "prompt_len",
    "continuations",
    "draft_steps",
    "draft_batch",
    "anchors_per_seq",
    "checkpoint_every",
    "eval_prompts",
    "eval_max_tokens",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
)
LEARNING_RATES = ("target_lr", "draft_lr")


def finite_at_least(value: object, low: float) -> bool:
    """A real number (not a bool), finite and >= `low`."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value >= low


def whole_numbers_from(values: tuple, low: int) -> bool:
    """One or more whole numbers (not bools), each >= `low`."""
    return bool(values) and all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in values)


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    max_files: int | None = None  # None: every file of the locked wheels
    vocab_size: int = 4096
    tokenizer_chars: int = 8_000_000
    hidden_size: int = 256
    target_layers: int = 6  # Gated DeltaNet, Gated DeltaNet, attention, repeated
    draft_layers: int = 3
    target_layer_ids: tuple[int, ...] = (0, 2, 5)  # low layers help copying, the last predicts
    # the last layer's feature: "raw" (its output, as the shipped drafts were trained) or
    # "final_norm" (Hugging Face's hidden_states[N]); written into the draft's config
    last_layer_feature: str = "raw"
    block_size: int = 16
    seq_len: int = 256
    target_steps: int = 1500
    validate_every: int = 150  # held-out loss; the best weights are kept
    target_batch: int = 128
    target_lr: float = 2e-3
    prompt_len: int = 64
    continuations: int = 16384
    draft_steps: int = 5000
    draft_batch: int = 48  # sequences per step
    anchors_per_seq: int = 16
    # block lengths the engine drafts: a full block of a block size in use, or (a request's
    # last block, which holds only what is left of its budget) any shorter length
    train_block_sizes: tuple[int, ...] = (8, 16)
    short_block_share: float = 0.2  # blocks of a uniform length in [2, block_size]
    draft_lr: float = 3e-3
    position_decay: float = 7.0
    checkpoint_every: int = 500
    eval_prompts: int = 32
    eval_max_tokens: int = 128
    eval_block_sizes: tuple[int, ...] = (4, 8, 16)
    draft_arch: str = "dflash"  # or "dflash2": the fields below shape and train it
    conv_kernel_size: int = 2  # taps, as published
    conv_group_size: int = 16  # channels per dynamic tap weight, as published
    selector_rank: int = 64
    selector_top_k: int = 16  # candidates per slot, as published
    selector_loss_weight: float = 1.0  # loss = token loss + this * selector loss

    @classmethod
    def smoke(cls, seed: int = 0) -> Recipe:
        return cls(
            seed=seed,
            max_files=40,
            vocab_size=384,
            tokenizer_chars=200_000,
            hidden_size=64,
            target_layers=3,
            draft_layers=1,
            target_layer_ids=(0, 2),
            block_size=4,
            seq_len=48,
            target_steps=6,
            validate_every=3,
            target_batch=4,
            prompt_len=16,
            train_block_sizes=(2, 4),
            continuations=8,
            draft_steps=4,
            draft_batch=4,
            anchors_per_seq=2,
            checkpoint_every=2,
            eval_prompts=2,
            eval_max_tokens=12,
            eval_block_sizes=(2, 4),
            selector_rank=16,
            selector_top_k=8,
        )

    def __post_init__(self) -> None:
        for name in POSITIVE_COUNTS:
            value = getattr(self, name)
            if not whole_numbers_from((value,), 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in LEARNING_RATES:  # 0 trains nothing: the initial weights are written
            if not finite_at_least(getattr(self, name), 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)!r}")
        if not finite_at_least(self.position_decay, 0) or self.position_decay == 0:
            raise ValueError(f"position_decay must be a finite number > 0, got {self.position_decay!r}")
        if not whole_numbers_from(self.train_block_sizes, 2):
            raise ValueError(
                f"train_block_sizes must be whole numbers of 2 or more each (a block of one has no "
                f"slot to predict), got {list(self.train_block_sizes)}"
            )
        if not whole_numbers_from(self.eval_block_sizes, 2):
            raise ValueError(
                f"eval_block_sizes must be whole numbers of 2 or more each (the engine drafts blocks "
                f"of two or more), got {list(self.eval_block_sizes)}"
            )
        if self.max_files is not None and not whole_numbers_from((self.max_files,), 2):
            raise ValueError(f"max_files must be a whole number of at least 2, got {self.max_files!r}")
        if self.prompt_len + self.block_size > self.seq_len:
            raise ValueError("seq_len must hold a prompt and one block")
        outside = [i for i in self.target_layer_ids if not 0 <= i < self.target_layers]
        if not self.target_layer_ids or outside:
            raise ValueError(
                f"target_layer_ids {list(self.target_layer_ids)}: give one or more of the target's "
                f"{self.target_layers} layers, 0 to {self.target_layers - 1}"
            )
        if self.last_layer_feature not in LAST_LAYER_FEATURES:
            raise ValueError(
                f"last_layer_feature must be one of {', '.join(LAST_LAYER_FEATURES)}, "
                f"got '{self.last_layer_feature}'"
            )
        if max(self.eval_block_sizes + self.train_block_sizes) > self.block_size:
            raise ValueError("training and evaluation block sizes cannot exceed block_size")
        if not 0.0 <= self.short_block_share <= 1.0:
            raise ValueError(f"short_block_share must be in [0, 1], got {self.short_block_share}")
        if self.draft_arch not in DRAFT_ARCHS:
            raise ValueError(f"draft_arch must be one of {', '.join(DRAFT_ARCHS)}, got '{self.draft_arch}'")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}"
            )
        if not 0 < self.selector_top_k <= self.vocab_size:
            raise ValueError(f"selector_top_k must be in [1, {self.vocab_size}], got {self.selector_top_k}")
        if not finite_at_least(self.selector_loss_weight, 0):
            raise ValueError(
                f"selector_loss_weight must be a finite number >= 0, got {self.selector_loss_weight!r}"
            )

    @property
    def raw_last_layer(self) -> bool:
        return self.last_layer_feature == RAW

    @property
    def draft_stage(self) -> str:
        """The draft's stage: its folder in `--out` and its `work/` files (`draft` for DFlash,
        `draft-dflash2` for DFlash2)."""
        return "draft" if self.draft_arch == "dflash" else f"draft-{self.draft_arch}"

    @property
    def results_file(self) -> str:
        return RESULTS_FILE if self.draft_arch == "dflash" else f"training-{self.draft_arch}.json"

    def target_config(self, eos_id: int) -> dict:
        """config.json of the Qwen3.5 hybrid target (text-only layout)."""
        h = self.hidden_size
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": h,
            "intermediate_size": 3 * h,
            "num_hidden_layers": self.target_layers,
            "layer_types": [
                "full_attention" if i % 3 == 2 else "linear_attention" for i in range(self.target_layers)
            ],
            "num_attention_heads": max(1, h // 64),
            "num_key_value_heads": max(1, h // 128),
            "head_dim": 64,
            "linear_num_key_heads": max(1, h // 128),
            "linear_num_value_heads": max(1, h // 64),
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "hidden_act": "silu",
            "bos_token_id": eos_id,
            "eos_token_id": eos_id,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "torch_dtype": "bfloat16",
        }

    def draft_config(self, mask_id: int) -> dict:
        """config.json of the draft, in z-lab's format: DFlash, or DFlash2 as published
        (every layer sliding, non-causal; the convolution and selector in `dflash_config`)."""
        h = self.hidden_size
        raw = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": h,
            "intermediate_size": 3 * h,
            "num_hidden_layers": self.draft_layers,
            "num_attention_heads": max(1, h // 64),
            "num_key_value_heads": max(1, h // 128),
            "head_dim": 64,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "block_size": self.block_size,
            "num_target_layers": self.target_layers,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": mask_id},
            "torch_dtype": "bfloat16",
        }
        if self.draft_arch == "dflash2":
            raw["architectures"] = ["DFlash2DraftModel"]
            raw["layer_types"] = ["sliding_attention"] * self.draft_layers
            raw["sliding_window"] = DFLASH2_WINDOW
            raw["use_sliding_window"] = True
            raw["is_causal"] = False
            raw["dflash_config"] |= {
                "block_size": self.block_size,
                "conv_kernel_size": self.conv_kernel_size,
                "conv_group_size": self.conv_group_size,
                "selector_rank": self.selector_rank,
                "selector_top_k": self.selector_top_k,
            }
        if self.last_layer_feature != FINAL_NORM:
            raw["dflash_config"]["last_layer_feature"] = self.last_layer_feature
        return raw
