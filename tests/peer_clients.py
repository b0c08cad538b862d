"""Other projects' benchmark clients, run as subprocesses against our server (gates/test_peer_*.py).

`make setup` installs them with --no-deps into .peers/ (requirements/peers.txt, scripts/setup.sh),
a folder on the clients' own PYTHONPATH only: their modules (uvloop, aiohttp, vLLM) never reach
the server or the tests. A client installed in the environment itself is found as well.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

from tests.server_process import REPO, ServerProcess
from tests.together import WORKERS

PEERS = REPO / ".peers"
RECIPE = "make setup installs it into .peers/ (requirements/peers.txt; PEERS=no leaves it out)"


def client_env() -> dict[str, str]:
    """The environment a peer client runs in: .peers/ first on its path, and offline (a client
    that asks the hub for a tokenizer gets a local path instead of a network wait)."""
    paths = [str(PEERS)] if PEERS.is_dir() else []
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "HF_HUB_OFFLINE": "1"}


# the modules of the peer clients the gates run (gates/test_peer_*.py): the first probe starts
# them all, side by side, and each later test finds its own probe done or under way
PEER_MODULES = ("guidellm.benchmark", "vllm.benchmarks.serve", "sglang.bench_serving")
_probes: dict[str, Future] = {}


def _probe(module: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        cwd=REPO,
        env=client_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def client_missing(module: str, client: str) -> str | None:
    """Why `client` cannot run (its `module` does not import, with the import's last line), or
    None when it can."""
    if module not in _probes:
        pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="peer-probe")
        for name in (module, *PEER_MODULES):
            if name not in _probes:
                _probes[name] = pool.submit(_probe, name)
        pool.shutdown(wait=False)
    probe = _probes[module].result()
    if probe.returncode == 0:
        return None
    last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
    return f"{client} cannot be imported ({last}); {RECIPE}"


def peer_server(tiny_pair, module: str, client: str, *options: str):
    """A peer test's server: our DFlash server on the tiny Qwen3 pair, started with `options`,
    once `client` (its `module`) is found to import (else the test is skipped with why).
    Yields (server, target directory); stops the server after."""
    import pytest

    missing = client_missing(module, client)
    if missing:
        pytest.skip(missing)
    target, draft = tiny_pair("qwen3", block_size=4)
    server = ServerProcess("--model", str(target), "--dflash-draft-model-path", str(draft), *options)
    yield server, target
    server.stop()
