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
from dataclasses import dataclass, field
from typing import Any

from .checkpoint import DTYPES
from .kernels import NUMERICS
from .runtime.commit import COMMIT_STRATEGIES

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
        ("--dtype",), "weights and activations", {"default": "float32", "choices": list(DTYPES)}
    ),
    "device": EngineOption(("--device",), "cpu, cuda or cuda:N", {"default": "cpu"}),
    "max_num_seqs": EngineOption(
        ("--max-num-seqs",), "slots: requests decoded at once", {"type": int, "default": 8}
    ),
    "max_model_len": EngineOption(
        ("--max-model-len",),
        "context length (default: the target's max_position_embeddings)",
        {"type": int, "default": None},
    ),
    "numerics": EngineOption(("--numerics",), NUMERICS_HELP, {"choices": NUMERICS, "default": None}),
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
