"""Read and write Hugging Face checkpoint layouts (tiny random checkpoints for tests and
benchmarks: synthetic.py; the `make-tiny` command: __main__.py).

Layouts read:
- `config.json` with `model_type` qwen3, llama, qwen3_5 (multimodal wrapper, `text_config`
  nested, tensors under `model.language_model.`, `mtp.*` and `model.visual.*` ignored) or
  qwen3_5_text (text-only, tensors under `model.`);
- `model.safetensors`, or shards listed in `model.safetensors.index.json`;
- tied (`tie_word_embeddings`, no `lm_head.weight` needed) or untied embeddings.

Under tensor parallelism a rank reads only its slice of each tensor (`load_target(...,
tensor_parallel=tp)`; the slices are runtime/tensor_parallel.py's `shard_of`).

DFlash drafts (z-lab layout): `architectures: ["DFlashDraftModel"]`, tensors `layers.*`,
`fc`, `hidden_norm`, `norm` (a leading `model.` is accepted too); the draft borrows the
target's `embed_tokens` and `lm_head`. DFlash2 drafts (`DFlash2DraftModel`) add, per layer,
`attention_conv` and `mlp_conv` (`base_kernel`, `kernel_projection.weight`) and one
`candidate_selector` (`predecessor_codebook`, `successor_codebook`,
`hidden_projection.weight`).

"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..config import DraftConfig, TargetConfig
from ..errors import CheckpointError, ConfigError
from ..models import CausalLM, build_draft, build_target, draft_expected_shapes, expected_shapes
from ..models.base import target_rotary
from ..models.dflash import DFlashDraft, draft_rotary
from ..models.layers import RotaryEmbedding
from ..runtime.tensor_parallel import Shard, TensorParallel, shard_plan, sharded_target

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
    return _json_object(config_file)


def _json_object(file: Path) -> dict[str, Any]:
    """A checkpoint's JSON file that must hold an object (config.json, the shard index)."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: holds {type(data).__name__}, not a JSON object")
    return data


def tensor_files(path: str | Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file that holds it."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index}: no 'weight_map' object of tensor names to file names")
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


# a per-expert MoE tensor; the model holds experts fused: gate_up_proj [E, 2I, H] (the gate
# rows of every expert, then their up rows) and down_proj [E, H, I], experts by id
PER_EXPERT = re.compile(r"(?P<experts>.+\.mlp\.experts)\.(?P<id>\d+)\.(?P<proj>gate|up|down)_proj\.weight")
FUSED_EXPERTS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class Source:
    """Where one expected tensor is read from: one checkpoint tensor (`join` "one"), or the
    per-expert tensors of the fused layout, stacked by expert id (`join` "down": down_proj)
    and for gate_up_proj also concatenated, gates first (`join` "gate_up")."""

    parts: tuple[tuple[str, tuple[int, ...]], ...]  # (checkpoint name, expected shape)
    join: str = "one"


def _fused_experts_of(canonical: str) -> str | None:
    """`model.layers.N.mlp.experts` for that layer's fused expert tensors, else None."""
    head, _, leaf = canonical.rpartition(".")
    return head if head.endswith(".mlp.experts") and leaf in FUSED_EXPERTS else None


def _per_expert_source(prefix: str, canonical: str, shape: tuple[int, ...]) -> Source:
    """The per-expert tensors (named under the checkpoint's `prefix`) that make up the
    fused tensor `canonical` of `shape`."""
    num_experts, rows, cols = shape
    if canonical.endswith(".gate_up_proj"):
        half = (rows // 2, cols)
        parts = [
            (f"{prefix}.{e}.{proj}_proj.weight", half) for proj in ("gate", "up") for e in range(num_experts)
        ]
        return Source(tuple(parts), "gate_up")
    return Source(tuple((f"{prefix}.{e}.down_proj.weight", (rows, cols)) for e in range(num_experts)), "down")


def _sources(
    path: str | Path,
    names: list[str],
    expected: dict[str, tuple[int, ...]],
    ignorable: tuple[str, ...],
    strip_model_prefix: bool,
) -> dict[str, Source]:
    """Where each expected tensor comes from, with missing and unexpected names refused."""
    by_canonical: dict[str, str] = {}
    per_expert: dict[str, str] = {}  # fused experts (canonical) -> the checkpoint's prefix
    per_expert_names: list[str] = []
    unexpected = []
    for name in names:
        canonical = _canonical_name(name, strip_model_prefix)
        if canonical is None or (canonical in ignorable and canonical not in expected):
            continue
        match = PER_EXPERT.fullmatch(canonical)
        if match and f"{match['experts']}.down_proj" in expected:
            prefix = name[: name.rindex(f".{match['id']}.{match['proj']}_proj.weight")]
            if per_expert.setdefault(match["experts"], prefix) != prefix:
                raise CheckpointError(
                    f"{path}: per-expert tensors under {per_expert[match['experts']]} and under {prefix} "
                    f"are both the experts {match['experts']}; expected one of them"
                )
            per_expert_names.append(name)
            continue
        if canonical not in expected:
            unexpected.append(name)
        if by_canonical.setdefault(canonical, name) != name:
            first, second = sorted((by_canonical[canonical], name))
            raise CheckpointError(f"{path}: {first} and {second} are both {canonical}; expected one of them")
    present = set(names)
    sources: dict[str, Source] = {}
    missing = []
    for canonical, shape in expected.items():
        experts = _fused_experts_of(canonical)
        if canonical in by_canonical:
            if experts in per_expert:
                raise CheckpointError(
                    f"{path}: {by_canonical[canonical]} and per-expert tensors under {per_expert[experts]} "
                    "both present; expected one layout of the experts"
                )
            sources[canonical] = Source(((by_canonical[canonical], shape),))
        elif experts in per_expert:
            source = _per_expert_source(per_expert[experts], canonical, shape)
            missing += [
                f"{name} (per-expert layout of {canonical} {list(shape)})"
                for name, _ in source.parts
                if name not in present
            ]
            sources[canonical] = source
        else:
            missing.append(canonical)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{path}: missing tensor(s) {shown}")
    used = {name for source in sources.values() for name, _ in source.parts}
    unexpected += [name for name in per_expert_names if name not in used]  # an expert id >= E
    if unexpected:
        shown = ", ".join(unexpected[:5])
        raise CheckpointError(f"{path}: unexpected tensor(s) {shown} for this config")
    return sources


def read_tensors(
    path: str | Path,
    expected: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device | str,
    ignorable: tuple[str, ...] = (),
    strip_model_prefix: bool = False,
    shards: dict[str, Shard | None] | None = None,
    reads: list[tuple[str, int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Read exactly the expected tensors, checking names and shapes before any load.

    Names in `ignorable` are skipped when the config does not expect them (for example
    `lm_head.weight` stored beside tied embeddings). MoE experts are read from either
    layout: fused (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, as transformers 5
    holds them) or per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, as
    `save_pretrained` writes them by default), and are returned fused.

    `shards` (tensor parallelism): for each expected name, the part to read (None: the
    whole); only that part's bytes are read from the file, and the tensor returned is the
    part. `reads`, when given, gets (checkpoint name, bytes read) for every read."""
    files = tensor_files(path)
    sources = _sources(path, list(files), expected, ignorable, strip_model_prefix)
    handles: dict[Path, Any] = {}

    def handle_of(name: str) -> Any:
        file = files[name]
        if file not in handles:
            handles[file] = open_safetensors(file)
        return handles[file]

    def read(name: str, shard: Shard | None) -> torch.Tensor:
        if shard is None:
            tensor = handle_of(name).get_tensor(name)
        else:  # each piece straight from the file, without the rest of the tensor
            whole = handle_of(name).get_slice(name)
            before = (slice(None),) * shard.dim
            pieces = [whole[(*before, slice(start, start + n))] for start, n in shard.pieces]
            tensor = _cat(pieces, shard.dim)
        if reads is not None:
            reads.append((name, tensor.numel() * tensor.element_size()))
        return tensor.to(device=device, dtype=dtype)

    try:
        for canonical, source in sources.items():
            for name, shape in source.parts:
                try:
                    found = tuple(handle_of(name).get_slice(name).get_shape())
                except SafetensorError:
                    raise CheckpointError(
                        f"{path}: the index maps {name} to {files[name].name}, which does not contain it"
                    ) from None
                if found != shape:
                    of = (
                        ""
                        if source.join == "one"
                        else f" (an expert of {canonical} {list(expected[canonical])})"
                    )
                    raise CheckpointError(
                        f"{path}: tensor {name} has shape {list(found)}, expected {list(shape)}{of}"
                    )
        tensors: dict[str, torch.Tensor] = {}
        for canonical, source in sources.items():
            shard = None if shards is None else shards[canonical]
            if source.join == "one":
                tensors[canonical] = read(source.parts[0][0], shard)
            else:
                tensors[canonical] = _read_experts(source, expected[canonical], shard, read)
    finally:
        handles.clear()
    return tensors


def _read_experts(
    source: Source,
    shape: tuple[int, ...],
    shard: Shard | None,
    read: Callable[[str, Shard | None], torch.Tensor],
) -> torch.Tensor:
    """A fused expert tensor (gate_up [E, 2I, H]: the experts' gates stacked, then their ups;
    down [E, H, I]) from the per-expert tensors, or the part `shard` names of it: along a
    dim past the experts', each piece is read from every expert's tensor (and from the gates
    or the ups, or both, by where the piece lies along gate_up's rows)."""
    names = [name for name, _ in source.parts]
    if source.join == "gate_up":
        half = len(names) // 2
        groups = [(names[:half], 0), (names[half:], shape[1] // 2)]  # (experts' names, first row)
    else:
        groups = [(names, 0)]
    if shard is None:
        return _cat([torch.stack([read(name, None) for name in group]) for group, _ in groups], dim=1)
    if shard.dim == 0:
        raise ValueError("a shard of the fused experts splits the experts' own dimensions, not their ids")
    dim, rows = shard.dim - 1, shape[1] // len(groups)  # an expert's dim; its rows in one group
    pieces = []
    for start, length in shard.pieces:
        parts = []
        for group, first in groups:
            if shard.dim == 1:  # only the rows of this piece within this group
                lo, hi = max(start, first), min(start + length, first + rows)
                if lo >= hi:
                    continue
                local = Shard(dim, ((lo - first, hi - lo),))
            else:
                local = Shard(dim, ((start, length),))
            parts.append(torch.stack([read(name, local) for name in group]))
        pieces.append(_cat(parts, dim=1))
    return _cat(pieces, dim=shard.dim)


def _cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)


def load_target(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tensor_parallel: TensorParallel | None = None,
    reads: list[tuple[str, int]] | None = None,
) -> CausalLM:
    """Load a target (any model_type of config.SUPPORTED_TARGET_TYPES) from a Hugging Face
    model directory. Under `tensor_parallel`, this rank's slice only: each tensor's part
    (`tensor_parallel.shard_of`) is read from the files, never the whole tensor. `reads`:
    as read_tensors'."""
    config = TargetConfig.from_hf(read_config(path))
    expected = expected_shapes(config)
    shards = None if tensor_parallel is None else shard_plan(config, expected, tensor_parallel)
    tensors = read_tensors(
        path, expected, dtype, device, ignorable=("lm_head.weight",), shards=shards, reads=reads
    )
    if tensor_parallel is None:
        model = assemble_target(config, tensors, device)
    else:
        model = sharded_target(config, tensors, tensor_parallel, device)
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
    return _assemble(lambda: build_draft(config), tensors, draft_rotary(config).to(device))


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
    """Load a z-lab DFlash or DFlash2 draft and check it against its target (dtype/device default to
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
