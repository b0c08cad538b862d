"""The demo-pair recipe: corpus, tokenizer, target, draft, evaluation, model card.

    python scripts/train_demo_pair.py [--out DIR] [--device cuda] [--seed 0] [--smoke]

Everything follows from the `Recipe` fields and the seed. `--smoke` is a seconds-long run
with tiny settings (CPU tests); the defaults are the shipped pair (about 5 minutes on one
H200).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import load_draft, load_target, write_safetensors
from ..config import DraftConfig, TargetConfig
from ..demo import DEMO_DIR, DEMO_PROMPTS, DEMO_RESULTS
from ..errors import exit_with
from ..models import build_target
from ..models.dflash import DFlashDraft
from ..tokenizer import EOS_TOKEN, MASK_TOKEN, save_tokenizer
from .corpus import Corpus, random_windows, token_stream, train_tokenizer
from .evaluation import evaluate, heldout_prompts, mean_tail, model_card
from .loops import (
    block_labels,
    block_logits,
    block_loss,
    greedy_continue,
    init_weights,
    lm_loss,
    optimise,
    target_views,
)

RESULTS_FILE = DEMO_RESULTS.name
CARD_FILE = "MODEL_CARD.md"


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    max_files: int | None = None  # None: the whole standard library
    vocab_size: int = 4096
    tokenizer_chars: int = 8_000_000
    hidden_size: int = 256
    target_layers: int = 6  # Gated DeltaNet, Gated DeltaNet, attention, repeated
    draft_layers: int = 3
    target_layer_ids: tuple[int, ...] = (0, 2, 5)  # low layers help copying, the last predicts
    block_size: int = 16
    seq_len: int = 256
    target_steps: int = 800
    validate_every: int = 100  # held-out loss; the best weights are kept
    target_batch: int = 64
    target_lr: float = 2e-3
    prompt_len: int = 64
    continuations: int = 8192
    draft_steps: int = 3500
    draft_batch: int = 32  # sequences per step
    anchors_per_seq: int = 12
    train_block_sizes: tuple[int, ...] = (4, 8, 16, 16)  # block lengths drawn per block
    draft_lr: float = 3e-3
    position_decay: float = 7.0
    eval_prompts: int = 32
    eval_max_tokens: int = 128
    eval_block_sizes: tuple[int, ...] = (4, 8, 16)

    @classmethod
    def smoke(cls, seed: int = 0) -> Recipe:
        return cls(seed=seed, max_files=40, vocab_size=384, tokenizer_chars=200_000,
                   hidden_size=64, target_layers=3, draft_layers=1, target_layer_ids=(0, 2),
                   block_size=4, seq_len=48, target_steps=6, validate_every=3,
                   target_batch=4, prompt_len=16, train_block_sizes=(2, 4),
                   continuations=8, draft_steps=4, draft_batch=4, anchors_per_seq=2,
                   eval_prompts=2, eval_max_tokens=12, eval_block_sizes=(2, 4))

    def __post_init__(self) -> None:
        if self.max_files is not None and self.max_files < 2:
            raise ValueError(f"max_files must be at least 2, got {self.max_files}")
        if self.prompt_len + self.block_size > self.seq_len:
            raise ValueError("seq_len must hold a prompt and one block")
        if max(self.target_layer_ids) >= self.target_layers:
            raise ValueError(f"target_layer_ids {self.target_layer_ids} outside the target")
        if max(self.eval_block_sizes + self.train_block_sizes) > self.block_size:
            raise ValueError("training and evaluation block sizes cannot exceed block_size")

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
            "layer_types": ["full_attention" if i % 3 == 2 else "linear_attention"
                            for i in range(self.target_layers)],
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
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.25},
            "torch_dtype": "bfloat16",
        }

    def draft_config(self, mask_id: int) -> dict:
        """config.json of the DFlash draft, in z-lab's format."""
        h = self.hidden_size
        return {
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
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids),
                              "mask_token_id": mask_id},
            "torch_dtype": "bfloat16",
        }


def log(message: str) -> None:
    print(message, flush=True)


def train(recipe: Recipe, out: Path, device: str) -> dict:
    t0 = time.perf_counter()
    torch.manual_seed(recipe.seed)
    gen = torch.Generator().manual_seed(recipe.seed)
    if device.startswith("cuda"):
        # reproducible on the GPU too: deterministic kernels where torch has them
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    corpus = Corpus.from_stdlib(recipe.max_files)
    train_texts = corpus.texts(corpus.train)
    tokenizer = train_tokenizer(train_texts, recipe.vocab_size, recipe.tokenizer_chars)
    stream = token_stream(tokenizer, train_texts)
    heldout_stream = token_stream(tokenizer, corpus.texts(corpus.heldout))
    eos_id, mask_id = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(MASK_TOKEN)
    log(f"corpus {corpus.root}: {len(corpus.train)} train files ({len(stream)} tokens), "
        f"{len(corpus.heldout)} held-out files ({len(heldout_stream)} tokens); "
        f"{time.perf_counter() - t0:.0f} s")

    # ---- target: a causal LM on random windows of the train stream
    target_raw = recipe.target_config(eos_id)
    target = build_target(TargetConfig.from_hf(target_raw))
    init_weights(target, recipe.target_layers, recipe.seed)
    target.to(device)
    t1 = time.perf_counter()
    probe = random_windows(heldout_stream, 64, recipe.seq_len + 1, gen).to(device)
    target_fit = optimise(
        target, recipe.target_steps, recipe.target_lr,
        lambda step: lm_loss(target, random_windows(stream, recipe.target_batch,
                                                     recipe.seq_len + 1, gen).to(device)),
        log, "target", validate=lambda: lm_loss(target, probe).item(),
        validate_every=recipe.validate_every)
    target_s = time.perf_counter() - t1
    target.eval().requires_grad_(False)

    # ---- the target's own greedy continuations of train-stream prompts, and what the
    # draft learns from them: the target's features and greedy choices at every position
    t2 = time.perf_counter()
    new_tokens = recipe.seq_len - recipe.prompt_len
    chunks = []
    for begin in range(0, recipe.continuations, 1024):
        count = min(1024, recipe.continuations - begin)
        prompts = random_windows(stream, count, recipe.prompt_len, gen).to(device)
        chunks.append(greedy_continue(target, prompts, new_tokens))
    sequences = torch.cat(chunks)  # [continuations, seq_len]
    features, greedy = target_views(target, sequences, recipe.target_layer_ids)
    log(f"continuations: {len(sequences)} x {new_tokens} tokens, {time.perf_counter() - t2:.0f} s")

    # ---- draft: blocks at anchors inside the continuations, against the frozen target
    draft_raw = recipe.draft_config(mask_id)
    draft = DFlashDraft(DraftConfig.from_hf(draft_raw))
    init_weights(draft, recipe.draft_layers, recipe.seed + 1)
    draft.to(device)
    t3 = time.perf_counter()
    block_sizes = torch.tensor(recipe.train_block_sizes)
    blocks = recipe.draft_batch * recipe.anchors_per_seq

    def draft_loss(step: int) -> torch.Tensor:
        rows = torch.randint(0, len(sequences), (recipe.draft_batch,), generator=gen).to(device)
        # anchors from the first generated token on (the first block an engine drafts)
        anchors = torch.randint(recipe.prompt_len, recipe.seq_len - recipe.block_size + 1,
                                (recipe.draft_batch, recipe.anchors_per_seq), generator=gen)
        lengths = block_sizes[torch.randint(0, len(block_sizes), (blocks,), generator=gen)]
        anchors, lengths = anchors.to(device), lengths.to(device)
        logits = block_logits(draft, target, sequences[rows], features[rows], anchors, lengths)
        labels = block_labels(greedy[rows], anchors, recipe.block_size)
        return block_loss(logits, labels, lengths, recipe.position_decay)

    draft_fit = optimise(draft, recipe.draft_steps, recipe.draft_lr, draft_loss, log, "draft")
    draft_s = time.perf_counter() - t3

    # ---- write both in the real on-disk formats (bfloat16), then evaluate what was written
    target_dir, draft_dir = out / "target", out / "draft"
    write_safetensors(target_dir, {n: t.to(torch.bfloat16).cpu()
                                   for n, t in target.state_dict().items()})
    (target_dir / "config.json").write_text(json.dumps(target_raw, indent=2) + "\n")
    save_tokenizer(tokenizer, target_dir)
    write_safetensors(draft_dir, {n: t.to(torch.bfloat16).cpu()
                                  for n, t in draft.state_dict().items()})
    (draft_dir / "config.json").write_text(json.dumps(draft_raw, indent=2) + "\n")
    prompts = heldout_prompts(corpus, tokenizer, recipe)
    with open(out / DEMO_PROMPTS.name, "w") as f:
        for row in prompts:
            f.write(json.dumps(row) + "\n")

    t4 = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False  # evaluate in true float32
    torch.backends.cudnn.allow_tf32 = False
    loaded = load_target(target_dir, dtype=torch.float32, device=device)
    acceptance = evaluate(loaded, load_draft(draft_dir, loaded),
                          [p["prompt_ids"] for p in prompts], recipe.eval_block_sizes,
                          recipe.eval_max_tokens)
    for B, row in acceptance.items():
        log(f"held-out acceptance, B={B}: mean length {row['mean_acceptance_length']:.2f}, "
            f"{row['mismatched_requests']} of {len(prompts)} requests differ from plain")

    def params(model) -> int:
        return sum(p.numel() for p in model.parameters())

    results = {
        "recipe": dataclasses.asdict(recipe),
        "device": (torch.cuda.get_device_name() if device.startswith("cuda")
                   else f"a CPU ({platform.machine()})"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "corpus": {"root": str(corpus.root), "train_files": len(corpus.train),
                   "heldout_files": len(corpus.heldout), "train_tokens": len(stream),
                   "heldout_tokens": len(heldout_stream)},
        "parameters": {"target": params(target),
                       "draft_own": params(draft)},
        "target": {"final_loss": mean_tail(target_fit["losses"]),
                   "kept_step": target_fit["best_step"],
                   "heldout_loss": target_fit["best_score"], "seconds": target_s},
        "draft": {"final_loss": mean_tail(draft_fit["losses"]), "seconds": draft_s},
        "acceptance": {str(B): row for B, row in acceptance.items()},
        "eval": {"prompts": len(prompts), "max_tokens": recipe.eval_max_tokens,
                 "dtype": "float32", "seconds": time.perf_counter() - t4},
        "total_seconds": time.perf_counter() - t0,
    }
    (out / RESULTS_FILE).write_text(json.dumps(results, indent=2) + "\n")
    (out / CARD_FILE).write_text(model_card(results))
    log(f"wrote {out} in {results['total_seconds']:.0f} s")
    return results


def parse(argv: list[str] | None) -> tuple[Recipe, Path, str]:
    p = argparse.ArgumentParser(prog="python scripts/train_demo_pair.py",
                                description="Train the demo target + DFlash draft pair.")
    p.add_argument("--out", type=Path, default=Path("results/demo-pair"),
                   help=f"output folder (default results/demo-pair; the shipped pair is {DEMO_DIR})")
    p.add_argument("--max-files", type=int, default=None,
                   help="use only the first N stdlib files in path order (default: all)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny settings, seconds on a CPU")
    scalar = {"int": int, "float": float}
    for field in dataclasses.fields(Recipe):
        if field.type in scalar:
            p.add_argument("--" + field.name.replace("_", "-"), type=scalar[field.type],
                           default=None, help=f"default {field.default}")
    ns = p.parse_args(argv)
    base = Recipe.smoke(ns.seed if ns.seed is not None else 0) if ns.smoke else Recipe()
    overrides = {f.name: getattr(ns, f.name) for f in dataclasses.fields(Recipe)
                 if getattr(ns, f.name, None) is not None}
    try:
        recipe = dataclasses.replace(base, **overrides)
    except ValueError as exc:
        p.error(str(exc))
    return recipe, ns.out, ns.device


def main(argv: list[str] | None = None) -> int:
    recipe, out, device = parse(argv)
    try:
        train(recipe, out, device)
    except (ValueError, OSError) as exc:  # ReferenceEngineError is a ValueError
        return exit_with(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
