"""Start the reference server as a real process on a free loopback port.

A server is `python -m <module> <args> --port N` run in its own process, with its output
collected for `server.proc.stdout.read()`. By default that process is forked from a
process that has already imported the server's dependencies (torch, FastAPI, the engine),
so a start costs the model load instead of seconds of imports; the module itself is then
run as `__main__` with its arguments, as `python -m` runs it. DFLASH_TEST_FRESH_SERVERS=1
(or `fresh=True`) starts every server as a new interpreter instead.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]

# what `python -m reference_engine.serve` imports before it serves: the serving stack, and
# what building a model's modules imports on first use
PRELOAD = ["reference_engine.serving.server", "torch._dynamo", "triton"]


def sigint_as_default() -> None:
    """For a child a test interrupts with SIGINT (Ctrl-C): its own default handling, even when
    the tests run where SIGINT is ignored (a shell's background job passes that on to its
    children, and Python then never raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_servers() -> bool:
    return os.environ.get("DFLASH_TEST_FRESH_SERVERS") == "1"


def _standard_streams() -> None:
    """stdout and stderr on file descriptors 1 and 2, buffered as a new interpreter buffers
    them when they are not a terminal (stderr line-buffered, PYTHONUNBUFFERED honoured)."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))

    def stream(fd: int, line_buffering: bool, errors: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        buffer = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            buffer, encoding="utf-8", errors=errors, line_buffering=line_buffering, write_through=unbuffered
        )

    sys.stdout = sys.__stdout__ = stream(1, False, "strict")
    sys.stderr = sys.__stderr__ = stream(2, True, "backslashreplace")


def _run_module(module: str, argv: list[str], log: str, cwd: str, env: dict[str, str]) -> None:
    """In the forked process: `python -m module *argv` with stdout and stderr to `log`."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _standard_streams()
    sys.argv = [module, *argv]
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class _Output:
    """The collected output of a forked server, read as a pipe reads: to the end, once the
    process has exited."""

    def __init__(self, process: ForkedProcess, path: str) -> None:
        self._process = process
        self._path = path
        self._offset = 0

    def read(self) -> str:
        self._process.wait()
        with open(self._path, encoding="utf-8", errors="replace") as f:
            f.seek(self._offset)
            text = f.read()
            self._offset = f.tell()
        return text


class ForkedProcess:
    """The part of subprocess.Popen the tests use, for a process forked by multiprocessing's
    fork server."""

    def __init__(self, process: multiprocessing.process.BaseProcess, log: str) -> None:
        self._process = process
        self.pid = process.pid
        self.stdout = _Output(self, log)
        self._log = log

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"forked server {self.pid}", timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        if os.path.exists(self._log):
            os.unlink(self._log)


_forked: list[ForkedProcess] = []


def _kill_leftovers() -> None:
    """At exit, a server a failed test left running is killed (the fork server's children are
    otherwise waited for)."""
    for proc in _forked:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.close()


def start_fork_server() -> None:
    """Starts the fork server, which imports PRELOAD, if it is not running: in the background,
    so its imports overlap whatever runs before the first server."""
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


def _fork(module: str, argv: list[str]) -> ForkedProcess:
    context = multiprocessing.get_context("forkserver")
    if not _forked:
        start_fork_server()
        atexit.register(_kill_leftovers)
    fd, log = tempfile.mkstemp(prefix="server-", suffix=".log")
    os.close(fd)
    process = context.Process(
        target=_run_module, args=(module, argv, log, str(REPO), dict(os.environ)), name=f"server {module}"
    )
    process.start()
    proc = ForkedProcess(process, log)
    _forked.append(proc)
    return proc


class ServerProcess:
    def __init__(
        self,
        *args: str,
        timeout: float = 60.0,
        module: str = "reference_engine.serve",
        fresh: bool = False,
        wait: bool = True,
    ) -> None:
        """`module`: what `python -m` runs (gates.faulty_serve plants a fault first). `fresh`: a
        new interpreter (subprocess.Popen) instead of a forked process. `wait=False` returns
        at once; `ready()` then waits for health (several servers start side by side)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [*args, "--port", str(self.port)]
        if fresh or fresh_servers():
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, *argv],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        else:
            self.proc = _fork(module, argv)
        self.deadline = time.monotonic() + timeout
        if wait:
            self.ready()

    def ready(self) -> ServerProcess:
        """Waits until /health answers 200; raises if the server exits or the time runs out."""
        while time.monotonic() < self.deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("server did not become healthy in time")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_servers(*launches: tuple[str, ...] | dict) -> list[ServerProcess]:
    """Several servers started side by side, each returned healthy: a launch is the arguments
    of one server, or a dict {"args": (...), **ServerProcess keywords}. If one fails, the
    others are stopped."""
    servers: list[ServerProcess] = []
    try:
        for launch in launches:
            options = dict(launch) if isinstance(launch, dict) else {"args": tuple(launch)}
            servers.append(ServerProcess(*options.pop("args"), wait=False, **options))
        for server in servers:
            server.ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


@contextlib.contextmanager
def uvicorn_in_thread(app, port: int, http) -> Iterator[int]:
    """`app` served by uvicorn on 127.0.0.1:`port` with the protocol class `http` (the
    server's connection policy), in a thread of this process, until the block ends."""
    import threading

    import uvicorn

    options = dict(log_level="warning", lifespan="off", http=http, timeout_keep_alive=60)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(30)
