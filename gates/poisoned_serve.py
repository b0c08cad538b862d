"""Our server with an engine failure planted (tests/poison.py: a request whose prompt starts
with POISON gets NaN logits after a few tokens, and the engine fails it alone) and, unless
FAULT is `none`, one deliberate fault of gates/faults.py: the metrics gate's server, on which
requests end every way there is. Testing only.

    python -m gates.poisoned_serve FAULT|none [serve options...]

`serving_here` runs the same server inside the calling process, for runs that would spend
most of a subprocess on its imports.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import uvicorn

from reference_engine.serving.app import create_app
from reference_engine.serving.args import ServeArgs
from reference_engine.serving.server import main
from reference_engine.serving.service import Server
from tests.poison import poisoned
from tests.server_process import free_port

from .faults import FAULTS, planted


@contextmanager
def serving_here(fault: str | None, serve_args: Sequence[str], timeout: float = 60.0) -> Iterator[str]:
    """Our server (its app, engine thread and uvicorn) on a free loopback port of this
    process, poisoned and with `fault` planted until the block ends; yields its URL."""
    port = free_port()
    with poisoned(), planted(fault):
        server = Server(ServeArgs.parse([*serve_args, "--port", str(port)]))
        config = uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning")
        http = uvicorn.Server(config)
        thread = threading.Thread(target=http.run, name="server", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while not http.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on port {port} did not start")
            time.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            http.should_exit = True
            thread.join(timeout)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in (*FAULTS, "none"):
        sys.exit(
            f"usage: python -m gates.poisoned_serve FAULT|none [serve options]; FAULT is "
            f"one of {', '.join(FAULTS)}"
        )
    with poisoned(), planted(None if sys.argv[1] == "none" else sys.argv[1]):
        sys.exit(main(sys.argv[2:]))
