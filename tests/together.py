"""Slow, independent jobs of a module's tests (mostly commands in a subprocess, seconds of
imports each) run side by side in the background, so that the machine's other cores do
them while the tests wait for one.

    @pytest.fixture(scope="module")
    def runs(request, qwen3_checkpoint):
        return together(request, {
            "test_a": lambda: cli("--model", str(qwen3_checkpoint)),
            "test_b[x]": lambda: cli("--model", str(qwen3_checkpoint), "--x"),
        })

    def test_a(runs, request):
        done = runs[request.node.name]

Each job is keyed by the name of the test that checks its result, and only the jobs of the
tests selected in this session are started. A test gets its own job's result, or the
exception the job raised.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

# jobs running at once: one per core (the tests themselves mostly wait for them)
WORKERS = max(1, min(4, os.cpu_count() or 1))


class Results(Mapping[str, Any]):
    def __init__(self, futures: dict[str, Future]) -> None:
        self._futures = futures

    def __getitem__(self, name: str) -> Any:
        return self._futures[name].result()

    def __iter__(self):
        return iter(self._futures)

    def __len__(self) -> int:
        return len(self._futures)


def together(request: pytest.FixtureRequest, jobs: dict[str, Callable[[], Any]]) -> Results:
    """Starts the jobs of the selected tests of `request`'s module; returns their results by
    test name (each waits for its own job)."""
    selected = {item.name for item in request.session.items if item.module is request.module}
    chosen = {name: job for name, job in jobs.items() if name in selected}
    pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="together")
    futures = {name: pool.submit(job) for name, job in chosen.items()}
    pool.shutdown(wait=False)
    return Results(futures)
