"""Read and write Hugging Face checkpoint layouts; make tiny random checkpoints.

Layouts read:
- `config.json` with `model_type` qwen3, qwen3_5 (multimodal wrapper, `text_config` nested,
  tensors under `model.language_model.`, `mtp.*` and `model.visual.*` ignored) or
  qwen3_5_text (text-only, tensors under `model.`);
- `model.safetensors`, or shards listed in `model.safetensors.index.json`;
- tied (`tie_word_embeddings`, no `lm_head.weight` needed) or untied embeddings.

DFlash drafts (z-lab layout): `architectures: ["DFlashDraftModel"]`, tensors `layers.*`,
`fc`, `hidden_norm`, `norm` (a leading `model.` is accepted too); the draft borrows the
target's `embed_tokens` and `lm_head`.

Command line:
    python -m reference_engine.checkpoint make-tiny --arch {qwen3,qwen3_5} --out DIR
        [--seed N] [--layers N] [--hidden N] [--vocab N] [--multimodal-wrapper]
        [--tie-word-embeddings] [--shards N] [--dtype float32|bfloat16]
    python -m reference_engine.checkpoint make-tiny --arch dflash --target DIR --out DIR
        [--block-size N] [--layers N] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import DraftConfig, TargetConfig
from .errors import CheckpointError, ConfigError, ReferenceEngineError, exit_with
from .models import CausalLM, build_target, expected_shapes
from .models.dflash import DFlashDraft, draft_expected_shapes
from .models.layers import RotaryEmbedding
from .tokenizer import EOS_TOKEN, MASK_TOKEN, build_tiny_tokenizer, load_tokenizer, save_tokenizer

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
WRAPPER_PREFIX = "model.language_model."
IGNORED_PREFIXES = ("mtp.", "model.visual.")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype '{name}', expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


# ----------------------------------------------------------------------------- reading
def read_config(path: str | Path) -> dict[str, Any]:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json (is this a model directory?)")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file}: not valid JSON ({exc})") from None


def tensor_files(path: str | Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file that holds it."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise CheckpointError(f"{index} lists shard {file.name}, which is missing")
        return files
    single = path / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    return {name: single for name in open_safetensors(single).keys()}


def open_safetensors(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None


def _canonical_name(name: str, strip_model_prefix: bool = False) -> str | None:
    """Checkpoint name -> our parameter name, or None for tensors we ignore."""
    if name.startswith(IGNORED_PREFIXES):
        return None
    if name.startswith(WRAPPER_PREFIX):
        return "model." + name[len(WRAPPER_PREFIX) :]
    if strip_model_prefix and name.startswith("model."):
        return name[len("model.") :]
    return name


def read_tensors(
    path: str | Path,
    expected: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device | str,
    ignorable: tuple[str, ...] = (),
    strip_model_prefix: bool = False,
) -> dict[str, torch.Tensor]:
    """Read exactly the expected tensors, checking names and shapes before any load.

    Names in `ignorable` are skipped when the config does not expect them (for example
    `lm_head.weight` stored beside tied embeddings)."""
    files = tensor_files(path)
    by_canonical: dict[str, str] = {}
    unexpected = []
    for name in files:
        canonical = _canonical_name(name, strip_model_prefix)
        if canonical is None or (canonical in ignorable and canonical not in expected):
            continue
        if canonical not in expected:
            unexpected.append(name)
        by_canonical[canonical] = name
    missing = [name for name in expected if name not in by_canonical]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{path}: missing tensor(s) {shown}")
    if unexpected:
        shown = ", ".join(unexpected[:5])
        raise CheckpointError(f"{path}: unexpected tensor(s) {shown} for this config")

    tensors: dict[str, torch.Tensor] = {}
    handles: dict[Path, Any] = {}
    try:
        for canonical, shape in expected.items():
            name = by_canonical[canonical]
            file = files[name]
            if file not in handles:
                handles[file] = open_safetensors(file)
            handle = handles[file]
            try:
                found = tuple(handle.get_slice(name).get_shape())
            except SafetensorError:
                raise CheckpointError(
                    f"{path}: the index maps {name} to {file.name}, which does not contain it"
                ) from None
            if found != shape:
                raise CheckpointError(
                    f"{path}: tensor {name} has shape {list(found)}, expected {list(shape)}"
                )
            tensors[canonical] = handle.get_tensor(name).to(device=device, dtype=dtype)
    finally:
        handles.clear()
    return tensors


def load_target(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> CausalLM:
    """Load a Qwen3 / Qwen3.5 target from a Hugging Face model directory."""
    config = TargetConfig.from_hf(read_config(path))
    expected = expected_shapes(config)
    tensors = read_tensors(path, expected, dtype, device, ignorable=("lm_head.weight",))
    model = assemble_target(config, tensors, device)
    model.source_path = Path(path)
    return model


def assemble_target(
    config: TargetConfig, tensors: dict[str, torch.Tensor], device: torch.device | str
) -> CausalLM:
    """A target model around already-placed tensors (no copy, no random init)."""
    return _assemble(lambda: build_target(config), tensors,
                     RotaryEmbedding(config.rotary_dim, config.rope_theta).to(device))


def assemble_draft(
    config: DraftConfig, tensors: dict[str, torch.Tensor], device: torch.device | str
) -> DFlashDraft:
    return _assemble(lambda: DFlashDraft(config), tensors,
                     RotaryEmbedding(config.head_dim, config.rope_theta).to(device))


def _assemble(build, tensors: dict[str, torch.Tensor], rotary: RotaryEmbedding):
    """Build on the meta device, adopt the tensors as parameters, then the RoPE buffers
    (not in checkpoints) on the tensors' device."""
    with torch.device("meta"):
        model = build()
    model.load_state_dict(tensors, strict=True, assign=True)
    model.rotary = rotary
    return model.eval().requires_grad_(False)


def load_draft(
    path: str | Path,
    target: CausalLM,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> DFlashDraft:
    """Load a z-lab DFlash draft and check it against its target (dtype/device default to
    the target's)."""
    weight = target.model.embed_tokens.weight
    dtype = dtype or weight.dtype
    device = device or weight.device
    config = DraftConfig.from_hf(read_config(path))
    config.check_target(target.config)
    tensors = read_tensors(
        path, draft_expected_shapes(config), dtype, device, strip_model_prefix=True
    )
    draft = assemble_draft(config, tensors, device)
    draft.source_path = Path(path)
    return draft


# ----------------------------------------------------------------------------- writing
def write_safetensors(
    out_dir: Path, tensors: dict[str, torch.Tensor], shards: int = 1
) -> None:
    """Write one `model.safetensors`, or `shards` files plus the index, as HF does."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    if shards <= 1:
        save_file(tensors, str(out_dir / SINGLE_FILE), metadata={"format": "pt"})
        return
    names = list(tensors)
    per_shard = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per_shard : (i + 1) * per_shard]}
        save_file(part, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def random_weights(
    shapes: dict[str, tuple[int, ...]],
    seed: int,
    norm_offset: bool,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Random weights scaled so that models give varied, non-degenerate logits. Drawn in
    float32 on `device` (real-shaped models straight on the GPU), then cast to `dtype`."""
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
        elif len(shape) == 1:  # norm weights
            offset_norm = norm_offset and not name.endswith("linear_attn.norm.weight")
            out[name] = normal(shape, 0.1) + (0.0 if offset_norm else 1.0)
        elif name.endswith("embed_tokens.weight"):
            # tied embeddings double as the lm_head: unit scale would make the fed token's
            # own logit dominate and greedy output repeat one token forever
            out[name] = normal(shape, shape[-1] ** -0.5 if tied else 1.0)
        elif leaf == "weight":
            out[name] = normal(shape, shape[-1] ** -0.5)
        else:  # biases
            out[name] = normal(shape, 0.1)
        out[name] = out[name].to(dtype)
    return out


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
    raise ConfigError(f"unknown --arch '{arch}', expected qwen3 or qwen3_5")


def wrap_multimodal(text_config: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3.5 multimodal wrapper config around a text config."""
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text_config,
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32},
        "tie_word_embeddings": text_config["tie_word_embeddings"],
    }


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
) -> Path:
    """Write a tiny random target with a tiny tokenizer, in the real on-disk format.

    `with_tokenizer=False` allows vocabularies too small for a byte-level BPE (statistical
    tests want a handful of tokens); token-id prompts still work."""
    out = Path(out)
    if multimodal_wrapper and arch != "qwen3_5":
        raise ConfigError("--multimodal-wrapper applies to --arch qwen3_5 only")
    if layers <= 0 or vocab <= 0:
        raise ConfigError(f"--layers and --vocab must be positive, got {layers} and {vocab}")
    tokenizer = build_tiny_tokenizer(vocab) if with_tokenizer else None
    eos_id = tokenizer.token_to_id(EOS_TOKEN) if tokenizer is not None else vocab - 2
    raw = tiny_target_config(arch, layers, hidden, vocab, tie_word_embeddings, eos_id)
    config = TargetConfig.from_hf(raw)
    tensors = random_weights(expected_shapes(config), seed, config.norm_offset)
    if multimodal_wrapper:
        gen = torch.Generator().manual_seed(seed + 1)
        tensors = {
            (WRAPPER_PREFIX + n[len("model.") :] if n.startswith("model.") else n): t
            for n, t in tensors.items()
        }
        # present in real checkpoints, ignored by text-only loading
        tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2, generator=gen)
        tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen)
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


def make_tiny_draft(
    out: str | Path,
    target: str | Path,
    block_size: int = 8,
    layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a tiny random DFlash draft matching the target in `target`."""
    out = Path(out)
    if block_size < 2:
        raise ConfigError(f"--block-size must be >= 2, got {block_size}")
    if layers <= 0:
        raise ConfigError(f"--layers must be positive, got {layers}")
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
        "torch_dtype": "float32",
    }
    config = DraftConfig.from_hf(raw)
    tensors = random_weights(draft_expected_shapes(config), seed, norm_offset=False)
    write_safetensors(out, {n: t.to(dtype) for n, t in tensors.items()})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out


# ----------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m reference_engine.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("make-tiny", help="write a tiny random checkpoint")
    tiny.add_argument("--arch", required=True, choices=["qwen3", "qwen3_5", "dflash"])
    tiny.add_argument("--out", required=True, help="output directory")
    tiny.add_argument("--target", help="dflash only: the target model directory to match")
    tiny.add_argument("--block-size", type=int, default=8, help="dflash only")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--layers", type=int, default=None,
                      help="decoder layers (default 4 for targets, 2 for drafts)")
    tiny.add_argument("--hidden", type=int, default=64)
    tiny.add_argument("--vocab", type=int, default=512)
    tiny.add_argument("--multimodal-wrapper", action="store_true",
                      help="Qwen3.5 only: write the multimodal wrapper layout")
    tiny.add_argument("--tie-word-embeddings", action="store_true")
    tiny.add_argument("--shards", type=int, default=1, help="number of safetensors shards")
    tiny.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.arch == "dflash":
            if not args.target:
                parser.error("--arch dflash needs --target DIR")
            out = make_tiny_draft(
                args.out,
                args.target,
                block_size=args.block_size,
                layers=args.layers or 2,
                seed=args.seed,
                dtype=parse_dtype(args.dtype),
            )
            print(out)
            return 0
        out = make_tiny_target(
            args.out,
            arch=args.arch,
            seed=args.seed,
            layers=args.layers or 4,
            hidden=args.hidden,
            vocab=args.vocab,
            tie_word_embeddings=args.tie_word_embeddings,
            multimodal_wrapper=args.multimodal_wrapper,
            shards=args.shards,
            dtype=parse_dtype(args.dtype),
        )
    except ReferenceEngineError as exc:
        return exit_with(exc)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
