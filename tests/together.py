"""Slow, independent jobs of the tests (mostly commands in a subprocess, seconds of imports
each) run in the background from the start of the session, so that the machine's other core
does them while the tests before them run in this process.

A test module declares its jobs in a module-level function, keyed by the name of the test
that checks each job's result:

    def background_jobs(made: Made) -> dict[str, Callable[[], Any]]:
        target = str(made.tiny_checkpoint("qwen3"))
        return {
            "test_a": lambda: cli("--model", target),
            "test_b[x]": lambda: cli("--model", target, "--x"),
        }

    def test_a(background):
        done = background()  # test_a's job's result, or the exception it raised

`background_jobs` runs in the main thread when the session starts (write checkpoints there,
not in the jobs), and only the jobs of the tests selected in this session are started, in
the order of the tests. A job whose name is not a test's (no "test_" prefix) is shared by
the module's tests and started when any of them is selected; `background("name")` gets it.
The jobs run at a low priority (NICE), so that they slow the tests beside them little.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

# jobs running at once: one per core (the tests mostly wait for them, or run beside them)
WORKERS = max(1, min(4, os.cpu_count() or 1))
# the jobs' threads, and every process they start, run at a low priority: they take the cores
# the tests leave idle, and mostly give them back when a test needs them (a test that waits
# for its job leaves its core idle). Not the lowest: on a machine loaded by other work, jobs
# at nice 19 starved past their own timeouts.
NICE = 10


def lower_priority() -> None:
    """This thread, and the processes it starts from now on, at nice NICE (Linux: the nice
    value is a thread's, and a child inherits its parent thread's)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):
        pass


@dataclass(frozen=True)
class Made:
    """The session's factories a module's `background_jobs` may use (conftest.py)."""

    tiny_checkpoint: Callable[..., Any]
    tiny_pair: Callable[..., Any]
    tmp_path_factory: pytest.TempPathFactory


_futures: dict[tuple[str, str], Future] = {}
_pool: ThreadPoolExecutor | None = None


def start(items: list[pytest.Item], made: Made) -> None:
    """Starts the background jobs of the selected `items`' modules, in the items' order."""
    global _pool
    modules = []
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "background_jobs") and module not in modules:
            modules.append(module)
    if not modules:
        return
    _pool = ThreadPoolExecutor(
        max_workers=WORKERS, thread_name_prefix="background", initializer=lower_priority
    )
    for module in modules:
        order = [item.name for item in items if getattr(item, "module", None) is module]
        jobs = module.background_jobs(made)
        shared = [name for name in jobs if not name.startswith("test_")]
        for name in shared + sorted((n for n in jobs if n in order), key=order.index):
            _futures[(module.__name__, name)] = _pool.submit(jobs[name])


def stop() -> None:
    """Drops the jobs not yet started (an interrupted session); running ones finish."""
    if _pool is not None:
        _pool.shutdown(wait=False, cancel_futures=True)


def result(request: pytest.FixtureRequest, name: str | None = None) -> Any:
    """The result of the background job of `request`'s test (or the module's shared job
    `name`), waiting for it if it is still running; the job's exception is raised here."""
    key = (request.module.__name__, name or request.node.name)
    if key not in _futures:
        raise KeyError(f"no background job {key[1]!r} in {key[0]} (background_jobs declares none)")
    return _futures[key].result()
