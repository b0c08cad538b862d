"""Read and write Hugging Face checkpoint layouts (tiny random checkpoints for tests and
benchmarks: synthetic.py; the `make-tiny` command: __main__.py).

Layouts read:
- `config.json` with `model_type` qwen3, llama, qwen3_5 (multimodal wrapper, `text_config`
  nested, tensors under `model.language_model.`, `mtp.*` and `model.visual.*` ignored) or
  qwen3_5_text (text-only, tensors under `model.`);
- `model.safetensors`, or shards listed in `model.safetensors.index.json`;
- tied (`tie_word_embeddings`, no `lm_head.weight` needed) or untied embeddings.

DFlash drafts (z-lab layout): `architectures: ["DFlashDraftModel"]`, tensors `layers.*`,
`fc`, `hidden_norm`, `norm` (a leading `model.` is accepted too); the draft borrows the
target's `embed_tokens` and `lm_head`.

"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..config import DraftConfig, TargetConfig
from ..errors import CheckpointError, ConfigError
from ..models import CausalLM, build_target, expected_shapes
from ..models.base import target_rotary
from ..models.dflash import DFlashDraft, draft_expected_shapes
from ..models.layers import RotaryEmbedding

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
    """Load a target (any model_type of config.SUPPORTED_TARGET_TYPES) from a Hugging Face
    model directory."""
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
    return _assemble(
        lambda: build_target(config),
        tensors,
        target_rotary(config).to(device),
    )


def assemble_draft(
    config: DraftConfig, tensors: dict[str, torch.Tensor], device: torch.device | str
) -> DFlashDraft:
    return _assemble(
        lambda: DFlashDraft(config), tensors, RotaryEmbedding(config.head_dim, config.rope_theta).to(device)
    )


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
    tensors = read_tensors(path, draft_expected_shapes(config), dtype, device, strip_model_prefix=True)
    draft = assemble_draft(config, tensors, device)
    draft.source_path = Path(path)
    return draft


# ----------------------------------------------------------------------------- writing
def write_safetensors(out_dir: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
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
