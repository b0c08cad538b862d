"""The engine's command-line options, defined once for every command that builds an engine:
`generate`, `serve`, the engine benchmark, and the gates (whose pytest options carry other
names but these definitions).

    parser = argparse.ArgumentParser()
    add_engine_options(parser, "model", "draft", "dtype", device="cuda")

Each option has one name (the draft's also answers to `--dflash-draft-model-path`, the name
vLLM's and our server's users know), one help text and one set of choices; a command picks
the ones it takes and may give its own default.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .checkpoint import DTYPES, parse_dtype, read_config
from .errors import ConfigError, RequestError
from .kernels import NUMERICS
from .runtime.commit import COMMIT_STRATEGIES
from .runtime.engine_config import EngineConfig
from .runtime.verify_width import VERIFY_WIDTHS

NUMERICS_HELP = (
    "kernels: exact (batch- and verify-invariant: DFlash equals plain greedy bit "
    "for bit in bfloat16) or fast (cuBLAS matrix products); default exact on "
    "cuda; the CPU runs the PyTorch references"
)


@dataclass(frozen=True)
class EngineOption:
    flags: tuple[str, ...]
    help: str
    kwargs: dict[str, Any] = field(default_factory=dict)


ENGINE_OPTIONS: dict[str, EngineOption] = {
    "model": EngineOption(("--model",), "target checkpoint directory (Hugging Face layout)"),
    "draft": EngineOption(
        ("--draft", "--dflash-draft-model-path"),
        "DFlash draft checkpoint directory; without it, plain decode",
    ),
    "block_size": EngineOption(
        ("--block-size",),
        "DFlash block size: tokens per draft block, anchor included (default: the draft's)",
        {"type": int, "default": None},
    ),
    "commit_strategy": EngineOption(
        ("--commit-strategy",),
        "how hybrid (Gated DeltaNet) state reaches the accepted boundary",
        {"default": "replay", "choices": COMMIT_STRATEGIES},
    ),
    "dtype": EngineOption(
        ("--dtype",),
        "weights and activations; auto: the checkpoint's torch_dtype (float32 on the CPU for a "
        "half-precision checkpoint)",
        {"default": "auto", "choices": ["auto", *DTYPES]},
    ),
    "device": EngineOption(
        ("--device",), "cpu, cuda or cuda:N; auto: cuda when there is one, else cpu", {"default": "auto"}
    ),
    "gpu_memory_utilization": EngineOption(
        ("--gpu-memory-utilization",),
        "share of the GPU's memory the engine may use, in (0, 1]: the state (KV caches, Gated "
        "DeltaNet states) gets what the weights and the activations leave of it, and a "
        "configuration that does not fit stops at start (ignored on the CPU)",
        {"type": float, "default": 0.9},
    ),
    "max_num_seqs": EngineOption(
        ("--max-num-seqs",), "slots: requests decoded at once", {"type": int, "default": 8}
    ),
    "max_model_len": EngineOption(
        ("--max-model-len",),
        "context length (default, and most: the target's max_position_embeddings; a longer one is "
        "refused, as vLLM refuses it)",
        {"type": int, "default": None},
    ),
    "prefill_chunk": EngineOption(
        ("--prefill-chunk",), "prompt tokens a request prefills per step", {"type": int, "default": 2048}
    ),
    "max_num_batched_tokens": EngineOption(
        ("--max-num-batched-tokens",),
        "target tokens a step may run: the running requests' decode and verify tokens plus the "
        "prefill chunks that fit beside them, oldest first (the oldest's always runs); at least "
        "--prefill-chunk (default: every prefilling request runs one chunk per step)",
        {"type": int, "default": None},
    ),
    "verify_width": EngineOption(
        ("--verify-width",),
        "draft tokens a DFlash step verifies: auto (the most committed tokens per second from "
        "the requests' acceptance and the measured step costs) or fixed (all B-1); output is "
        "the same either way",
        {"default": "auto", "choices": VERIFY_WIDTHS},
    ),
    "measure_step_costs": EngineOption(
        ("--measure-step-costs",),
        "without CUDA graphs (the CPU, --enforce-eager), time whole speculative steps at "
        "start-up (each row count and verify width), so that --verify-width auto weighs "
        "measured costs and, on the CPU, may take plain steps (with graphs the costs are "
        "always measured; docs/engine.md, Verify width)",
        {"action": "store_true"},
    ),
    "kv_cache_tokens": EngineOption(
        ("--kv-cache-tokens",),
        "a pooled KV cache of this many tokens that all requests share: each takes the cells "
        "its prompt, max_tokens and one block need, so short requests leave room for long ones "
        "(default: every slot holds max_model_len + one block; docs/engine.md, Memory)",
        {"type": int, "default": None},
    ),
    "kv_cell_tokens": EngineOption(
        ("--kv-cell-tokens",),
        "tokens of one cell of the pooled KV cache (--kv-cache-tokens): a request takes whole cells",
        {"type": int, "default": 256},
    ),
    "checkpoint_every": EngineOption(
        ("--checkpoint-every",),
        "per_token commit: a verify keeps the Gated DeltaNet state every N block tokens and the "
        "commit runs a row on from the last one over fewer than N tokens (memory and the verify's "
        "writes against the commit's work; default 8 with the Triton kernels; none on the CPU's "
        "references, whose verify keeps the rows each token writes instead); output is the same "
        "either way",
        {"type": int, "default": None},
    ),
    "numerics": EngineOption(("--numerics",), NUMERICS_HELP, {"choices": NUMERICS, "default": None}),
    "tensor_parallel_size": EngineOption(
        ("--tensor-parallel-size",),
        "processes, one per device, that each hold a slice of every layer; above 1, start the "
        "command under torchrun with as many processes (docs/engine.md, Tensor parallelism)",
        {"type": int, "default": 1},
    ),
    "device_phase_times": EngineOption(
        ("--device-phase-times",),
        "on a GPU, time each engine phase on the device as well (two CUDA events a phase: about "
        "8%% of a DFlash engine process's profile samples at c16 on the demo pair, on an H100): "
        "dflash:phase_seconds_total then counts device seconds; off (the default), host seconds",
        {"action": "store_true"},
    ),
    "steps_per_turn": EngineOption(
        ("--steps-per-turn",),
        "DFlash steps of the same rows queued before the host reads their results (one wait "
        "for the device per turn; a request that ends mid-turn leaves its row idle to the "
        "turn's end, one that arrives joins at the next); output is the same at any count "
        "(default 1)",
        {"type": int, "default": 1},
    ),
    "draft_span": EngineOption(
        ("--draft-span",),
        "the positions a draft forward runs: 'block' (the default) the anchor and all B-1 mask "
        "tokens, as DFlash drafts are trained; 'verify' the anchor and only as many mask tokens "
        "as the step verifies (--verify-width), a smaller forward whose proposals differ, for "
        "drafts trained on shorter blocks too (the demo pair's); output is the same either way; "
        "eager forwards only (the CPU, --enforce-eager; docs/engine.md, Draft span)",
        {"choices": ("block", "verify"), "default": "block"},
    ),
    "enforce_eager": EngineOption(
        ("--enforce-eager",), "run every forward eagerly (no CUDA graphs)", {"action": "store_true"}
    ),
}


def add_engine_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, *names: str, **overrides: Any
) -> None:
    """Add the named engine options to `parser`; `overrides` replace keyword arguments of
    argparse by option name (`device="cuda"` sets a default, `model={"required": True}` any
    keyword)."""
    unknown = sorted(set(names) - set(ENGINE_OPTIONS))
    if unknown:
        raise ValueError(f"unknown engine option(s) {unknown}, expected some of {', '.join(ENGINE_OPTIONS)}")
    for name in names:
        option = ENGINE_OPTIONS[name]
        kwargs = {**option.kwargs, "help": option.help, "dest": name}
        override = overrides.get(name)
        if isinstance(override, dict):
            kwargs.update(override)
        elif name in overrides:
            kwargs["default"] = override
        parser.add_argument(*option.flags, **kwargs)


def engine_config(args: Any, **settings: Any) -> EngineConfig:
    """The EngineConfig of the engine options `args` carries (a command's parsed arguments):
    each option it has that names an EngineConfig field, as given; `settings` set the others
    a command decides itself, or replace a given one."""
    names = {f.name for f in fields(EngineConfig)}
    given = {name: getattr(args, name) for name in ENGINE_OPTIONS if name in names and hasattr(args, name)}
    try:
        return EngineConfig(**{**given, **settings})
    except ConfigError as exc:  # named by its flag, the name the user gave it by
        flag = next((ENGINE_OPTIONS[n].flags[0] for n in given if str(exc).startswith(f"{n} ")), None)
        if flag is None:
            raise
        raise ConfigError(f"{flag}: {exc}") from None


HALF_PRECISION = ("bfloat16", "float16")


def resolve_device(name: str) -> torch.device:
    """`--device`: auto is cuda when a CUDA device is available, else cpu; a named device must
    exist here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise RequestError(f"unknown --device {name!r}, expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RequestError(f"--device {name} asked for, but no CUDA device is available here")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise RequestError(
            f"--device {name} asked for, but this machine has {count} CUDA device(s): "
            f"cuda:0 to cuda:{count - 1}"
        )
    return device


def checkpoint_dtype(config: dict) -> str | None:
    """The dtype a Hugging Face config.json names (`torch_dtype`, or transformers 5's `dtype`;
    a multimodal wrapper's from its `text_config` when the top level has none)."""
    text_config = config.get("text_config")
    for source in (config, text_config if isinstance(text_config, dict) else {}):
        for key in ("torch_dtype", "dtype"):
            if isinstance(source.get(key), str):
                return source[key]
    return None


def resolve_dtype(name: str, model_dir: str | None, device: torch.device) -> torch.dtype:
    """`--dtype`: auto is the checkpoint's own dtype (float32 when it names none), except that a
    half-precision checkpoint runs in float32 on the CPU, where the references are slow and
    inexact in half precision; a note on stderr says so. A named dtype is used as it is."""
    if name != "auto":
        return parse_dtype(name)
    found = checkpoint_dtype(read_config(model_dir)) if model_dir is not None else None
    if found is None:
        return torch.float32
    if device.type == "cpu" and found in HALF_PRECISION:
        # --dtype offers only what runs everywhere: float16 runs by auto alone, on cuda
        keep = f"--dtype {found} keeps its own" if found in DTYPES else f"{found} runs on cuda only"
        print(
            f"note: --dtype auto runs the {found} checkpoint in float32 on the CPU ({keep})", file=sys.stderr
        )
        return torch.float32
    if found == "float16":
        return torch.float16
    if found not in DTYPES:
        raise ConfigError(f"the checkpoint's dtype {found!r} is not one of {', '.join(DTYPES)}; pass --dtype")
    return DTYPES[found]
