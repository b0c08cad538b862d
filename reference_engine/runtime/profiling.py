"""NVTX ranges over the engine's phases, through one small helper.

Ranges live in the `dflash` NVTX domain with stable names: `step` around each engine step,
and inside it `schedule`, `prefill`, `decode`, `draft`, `verify`, `accept`, `commit`,
`sample`; inside an eager DFlash2 `draft`, `conv` around each convolution and `selector`
(stats.NESTED). They are on when the `nvtx` package imports and profiling is asked for
(`DFLASH_NVTX=1`, or `NvtxRanges(enabled=True)`); otherwise every range is one shared
no-op context manager, so the engine pays an attribute lookup and a call per phase. No CUDA
import is needed. Under `nsys profile --trace=nvtx` the ranges show as `dflash:verify` etc.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

DOMAIN = "dflash"
RANGE_NAMES = (
    "step",
    "schedule",
    "prefill",
    "decode",
    "draft",
    "verify",
    "accept",
    "commit",
    "sample",
    "conv",
    "selector",
)
_OFF = nullcontext()


class _Range:
    __slots__ = ("api", "name")

    def __init__(self, api, name: str) -> None:
        self.api, self.name = api, name

    def __enter__(self) -> None:
        self.api.push_range(message=self.name, domain=DOMAIN)

    def __exit__(self, *exc) -> None:
        self.api.pop_range(domain=DOMAIN)


class NvtxRanges:
    def __init__(self, enabled: bool | None = None, api=None) -> None:
        """`api` is the `nvtx` module (or a test double with push_range/pop_range)."""
        if enabled is None:
            enabled = os.environ.get("DFLASH_NVTX", "") not in ("", "0")
        if enabled and api is None:
            try:
                import nvtx as api
            except ImportError:
                api = None  # profiling asked for, but no nvtx package: ranges stay off
        self.api = api
        self.enabled = bool(enabled and api is not None)

    def range(self, name: str):
        """A context manager that marks `name` (a no-op when off)."""
        return _Range(self.api, name) if self.enabled else _OFF
