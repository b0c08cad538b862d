"""Shared pytest fixtures for tests/ and gates/: tiny checkpoints built once per session,
and the `gpu` marker that skips CUDA-only tests on machines without a GPU.

Use the factories for any variant:

    def test_something(tiny_checkpoint, tiny_pair):
        path = tiny_checkpoint("qwen3_5", hidden=96, layers=5, tie_word_embeddings=True)
        target_dir, draft_dir = tiny_pair("qwen3", block_size=4)

Each distinct set of options is written once per session and shared, so a test must
never modify the directory it gets; copy it first (`copy_checkpoint`) to corrupt it.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

# Without CUDA every Triton kernel runs under Triton's interpreter: the variable must be set
# before triton is first imported, by whichever test module comes first
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# The tests start commands from several threads at once (tests/together.py). A child made by
# vfork shares its parent's memory until it calls exec, and where the kernel mishandles that
# beside the parent's other threads a spawn fails with EFAULT ("Bad address") though the
# interpreter's path is right. A forked child has a copy of its own; this is the switch
# Python's subprocess documentation names for turning vfork off.
subprocess._USE_VFORK = False

from reference_engine.checkpoint.synthetic import make_tiny_draft, make_tiny_target  # noqa: E402

# --target-model / --draft-model / --gate-device / --gate-dtype for the gates
pytest_plugins = ("gates.options",)

TinyCheckpoint = Callable[..., Path]

_TINY_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(make_tiny_target).parameters.items()
    if p.default is not inspect.Parameter.empty
}

# options that point the gates at a user's own checkpoints (see gates/options.py)
pytest_plugins = ["gates.options"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    # Tiny models gain nothing from intra-op threads, and on a busy 2-core machine the
    # thread hand-off makes a 64-wide matmul take milliseconds instead of microseconds (so
    # each pytest-xdist worker of make test keeps to one core too).
    torch.set_num_threads(1)


def pytest_collection_finish(session: pytest.Session) -> None:
    # the tests that start servers fork them from a process that has imported the server's
    # dependencies (tests/server_process.py): started now, its imports overlap the first tests
    import sys

    server_process = sys.modules.get("tests.server_process")
    if server_process is not None and session.items and not server_process.fresh_servers():
        server_process.start_fork_server()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="marked gpu: torch.cuda.is_available() is False here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module", autouse=True)
def _device_memory_back_after_each_module() -> Any:
    """On a GPU, what a test module left for the garbage collector (a model, an engine's
    caches in a cycle of some test's own making) is collected when the module ends, so the
    GPU tier's later modules, run in the same process, find the device's memory free."""
    yield
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def _checkpoint_name(arch: str, options: dict[str, Any]) -> str:
    parts = [arch]
    for key, value in sorted(options.items()):
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        parts.append(f"{key}-{value}")
    return "_".join(parts)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A fresh event loop for a test that drives a connection's protocol by hand; its tasks
    are cancelled and it is closed after the test."""
    loop = asyncio.new_event_loop()
    yield loop
    for task in asyncio.all_tasks(loop):
        task.cancel()
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """`tiny_checkpoint(arch, **options) -> Path`: a tiny HF-layout checkpoint with a tokenizer,
    written by `make_tiny_target` on first use and cached by (arch, options) for the session.

    Options are `make_tiny_target`'s: seed, layers, hidden, vocab, tie_word_embeddings,
    multimodal_wrapper, shards, dtype (torch.float32 or torch.bfloat16 on disk), with_tokenizer."""
    built: dict[tuple[tuple[str, Any], ...], Path] = {}

    def make(arch: str = "qwen3", **options: Any) -> Path:
        unknown = sorted(set(options) - set(_TINY_DEFAULTS))
        if unknown:
            raise TypeError(f"tiny_checkpoint: unknown option(s) {unknown}")
        # spelled-out defaults share the checkpoint of the bare call
        full = {**_TINY_DEFAULTS, **options, "arch": arch}
        key = tuple(sorted(full.items(), key=lambda item: item[0]))
        if key not in built:
            changed = {k: v for k, v in options.items() if v != _TINY_DEFAULTS[k]}
            out = tmp_path_factory.mktemp(_checkpoint_name(arch, changed), numbered=True)
            built[key] = make_tiny_target(out, arch=arch, **options)
        return built[key]

    return make


TinyPair = Callable[..., tuple[Path, Path]]


@pytest.fixture(scope="session")
def tiny_pair(tiny_checkpoint: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    """`tiny_pair(arch="qwen3_5", block_size=8, draft_layers=2, draft_seed=0, draft_arch="dflash",
    **target_options) -> (target_dir, draft_dir)`: a tiny target (`tiny_checkpoint`) and a
    DFlash (or, `draft_arch` "dflash2", DFlash2) draft for it written by `make_tiny_draft`,
    each cached for the session by its options."""
    built: dict[tuple, Path] = {}

    def make(
        arch: str = "qwen3_5",
        block_size: int = 8,
        draft_layers: int = 2,
        draft_seed: int = 0,
        draft_arch: str = "dflash",
        **target_options: Any,
    ) -> tuple[Path, Path]:
        target = tiny_checkpoint(arch, **target_options)
        key = (target, block_size, draft_layers, draft_seed, draft_arch)
        if key not in built:
            out = tmp_path_factory.mktemp(f"{target.name}-{draft_arch}-b{block_size}", numbered=True)
            built[key] = make_tiny_draft(
                out, target, block_size=block_size, layers=draft_layers, seed=draft_seed, arch=draft_arch
            )
        return target, built[key]

    return make


@pytest.fixture(scope="session")
def qwen3_checkpoint(tiny_checkpoint: TinyCheckpoint) -> Path:
    """Dense Qwen3, untied embeddings, 4 layers, hidden 64, vocab 512."""
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="session")
def qwen3_tied_checkpoint(tiny_checkpoint: TinyCheckpoint) -> Path:
    return tiny_checkpoint("qwen3", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def qwen3_sharded_checkpoint(tiny_checkpoint: TinyCheckpoint) -> Path:
    """The same weights as `qwen3_checkpoint`, in 3 shards with an index."""
    return tiny_checkpoint("qwen3", shards=3)


@pytest.fixture(scope="session")
def qwen3_5_checkpoint(tiny_checkpoint: TinyCheckpoint) -> Path:
    """Hybrid Qwen3.5, text-only layout (qwen3_5_text), untied, 4 layers (2 linear, 2 full)."""
    return tiny_checkpoint("qwen3_5")


@pytest.fixture(scope="session")
def qwen3_5_tied_checkpoint(tiny_checkpoint: TinyCheckpoint) -> Path:
    return tiny_checkpoint("qwen3_5", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def qwen3_5_wrapper_checkpoint(tiny_checkpoint: TinyCheckpoint) -> Path:
    """The same weights as `qwen3_5_checkpoint` in the multimodal wrapper layout
    (model_type qwen3_5, tensors under model.language_model., plus mtp.* and model.visual.*)."""
    return tiny_checkpoint("qwen3_5", multimodal_wrapper=True)


@pytest.fixture(scope="session")
def qwen3_5_sharded_checkpoint(tiny_checkpoint: TinyCheckpoint) -> Path:
    """The same weights as `qwen3_5_checkpoint`, in 3 shards with an index."""
    return tiny_checkpoint("qwen3_5", shards=3)


@pytest.fixture
def copy_checkpoint(tmp_path: Path) -> Callable[[Path], Path]:
    """`copy_checkpoint(src) -> Path`: a private copy of a shared checkpoint, free to corrupt."""

    def copy(src: Path) -> Path:
        dst = tmp_path / src.name
        shutil.copytree(src, dst)
        return dst

    return copy


@pytest.fixture(scope="session")
def served_pair(tiny_pair: TinyPair) -> tuple[str, str]:
    """The qwen3 tiny pair at block size 4 as the directories `serve` is given (target, draft)."""
    target, draft = tiny_pair("qwen3", block_size=4)
    return str(target), str(draft)
