"""Fixtures for the gates: the draft/target pairs under test.

By default: a tiny dense (Qwen3) pair and a tiny hybrid (Qwen3.5) pair with DFlash drafts and
the dense target with a DFlash2 draft, written by our own code in the real on-disk formats,
loaded in float64 on the CPU. With --target-model and
--draft-model (see gates/options.py) the same gates run on a user's own checkpoints.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target, parse_dtype

from .checks import Pair
from .prompts import gate_prompt_ids

# name -> (target arch, draft arch): every pair gate runs on a DFlash2 draft too (on the dense
# target: what DFlash2 changes is the draft's side, and the hybrid pair's commit strategies
# are the DFlash pair's)
TINY_PAIRS = {
    "dense": ("qwen3", "dflash"),
    "hybrid": ("qwen3_5", "dflash"),
    "dense-dflash2": ("qwen3", "dflash2"),
}
TINY_BLOCK_SIZE = 16
SMALL_VOCAB = 16  # the sampling gate's target: few enough outcomes to count
USER_PROMPTS = 32  # prompts a user's pair runs by default (built-in mixed set)
USER_MAX_TOKENS = 128


def tiny_prompts(vocab: int, lengths: tuple[int, ...] = (1, 17, 300)) -> tuple[tuple[int, ...], ...]:
    rng = random.Random(1234)
    return tuple(tuple(rng.randrange(vocab - 16) for _ in range(n)) for n in lengths)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "pair_name" in metafunc.fixturenames:
        user = metafunc.config.getoption("--target-model")
        names = ["user"] if user else list(TINY_PAIRS)
        metafunc.parametrize("pair_name", names, scope="session")


@pytest.fixture(scope="session")
def tiny_pair_dirs(tiny_pair) -> dict[str, tuple[Path, Path]]:
    return {
        name: tiny_pair(arch, block_size=TINY_BLOCK_SIZE, draft_layers=2, draft_seed=7, draft_arch=draft)
        for name, (arch, draft) in TINY_PAIRS.items()
    }


_loaded: dict[str, Pair] = {}


@pytest.fixture(scope="session")
def pair(pair_name: str, request: pytest.FixtureRequest, tiny_pair_dirs) -> Pair:
    if pair_name in _loaded:
        return _loaded[pair_name]
    if pair_name == "user":
        config = request.config
        target_dir = config.getoption("--target-model")
        draft_dir = config.getoption("--draft-model")
        if not draft_dir:
            pytest.fail("--target-model needs --draft-model (or DFLASH_GATE_DRAFT)")
        dtype = parse_dtype(config.getoption("--gate-dtype") or "bfloat16")
        device = config.getoption("--gate-device")
        target = load_target(target_dir, dtype=dtype, device=device)
        draft = load_draft(draft_dir, target)
        prompts = tuple(tuple(ids) for ids in gate_prompt_ids(config, target_dir, USER_PROMPTS))
        loaded = Pair(
            f"user pair ({Path(target_dir).name})",
            target,
            draft,
            prompts,
            config.getoption("--gate-max-tokens") or USER_MAX_TOKENS,
            config.getoption("--gate-numerics"),
        )
    else:
        target_dir, draft_dir = tiny_pair_dirs[pair_name]
        target = load_target(target_dir, dtype=torch.float64)
        draft = load_draft(draft_dir, target)
        loaded = Pair(pair_name, target, draft, tiny_prompts(target.config.vocab_size))
    _loaded[pair_name] = loaded
    return loaded


@pytest.fixture(scope="session")
def small_vocab_pair(tiny_pair):
    target_dir, draft_dir = tiny_pair(
        "qwen3", block_size=4, draft_seed=5, seed=3, vocab=SMALL_VOCAB, with_tokenizer=False
    )
    target = load_target(target_dir, dtype=torch.float64)
    return target, load_draft(draft_dir, target)


# ------------------------------------------------------------------ demo-pair servers
@pytest.fixture(scope="session")
def demo_plain_server():
    """Our plain server on the shipped demo target, float32 (shared by the HTTP gates)."""
    from reference_engine.demo import DEMO_TARGET
    from tests.server_process import ServerProcess

    server = ServerProcess("--model", str(DEMO_TARGET), "--dtype", "float32", "--served-model-name", "demo")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def demo_dflash_server():
    """Our DFlash server (block size 8) on the shipped demo pair, float32."""
    from reference_engine.demo import DEMO_DRAFT, DEMO_TARGET
    from tests.server_process import ServerProcess

    server = ServerProcess(
        "--model",
        str(DEMO_TARGET),
        "--dflash-draft-model-path",
        str(DEMO_DRAFT),
        "--block-size",
        "8",
        "--dtype",
        "float32",
        "--served-model-name",
        "demo",
    )
    yield server
    server.stop()
