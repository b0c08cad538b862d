"""Other projects' benchmark clients, run as subprocesses against our server (gates/test_peer_*.py).

`make setup` installs them with --no-deps into .peers/ (requirements/peers.txt, scripts/setup.sh),
a folder on the clients' own PYTHONPATH only: their modules (uvloop, aiohttp, vLLM) never reach
the server or the tests. A client installed in the environment itself is found as well.

A peer test's run (`peer_job`: the import probe, our server, the client, /metrics before and
after) is one of the session's background jobs (tests/together.py); the test then checks
what the run left.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.server_process import REPO, ServerProcess

PEERS = REPO / ".peers"
RECIPE = "make setup installs it into .peers/ (requirements/peers.txt; PEERS=no leaves it out)"


def client_env() -> dict[str, str]:
    """The environment a peer client runs in: .peers/ first on its path, and offline (a client
    that asks the hub for a tokenizer gets a local path instead of a network wait)."""
    paths = [str(PEERS)] if PEERS.is_dir() else []
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "HF_HUB_OFFLINE": "1"}


def client_missing(module: str, client: str) -> str | None:
    """Why `client` cannot run (its `module` does not import, with the import's last line), or
    None when it can."""
    probe = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        cwd=REPO,
        env=client_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode == 0:
        return None
    last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
    return f"{client} cannot be imported ({last}); {RECIPE}"


@dataclass
class PeerRun:
    """What a peer client's run left: why it was skipped, or the client's run and our
    server's /metrics text before and after it."""

    skipped: str | None = None
    url: str = ""
    before: str = ""
    done: subprocess.CompletedProcess | None = None
    after: str = ""


def peer_job(
    pair: tuple[Path, Path],
    module: str,
    client: str,
    options: tuple[str, ...],
    run_client: Callable[[str], subprocess.CompletedProcess],
) -> Callable[[], PeerRun]:
    """A peer test's run: once `client` (its `module`) is found to import, our DFlash server
    on `pair` started with `options`, its /metrics, `run_client(url)`, its /metrics again, the
    server stopped."""

    def job() -> PeerRun:
        missing = client_missing(module, client)
        if missing:
            return PeerRun(skipped=missing)
        target, draft = pair
        server = ServerProcess("--model", str(target), "--dflash-draft-model-path", str(draft), *options)
        try:
            before = httpx.get(server.url + "/metrics", timeout=10).text
            done = run_client(server.url)
            after = httpx.get(server.url + "/metrics", timeout=10).text
        finally:
            server.stop()
        return PeerRun(None, server.url, before, done, after)

    return job
