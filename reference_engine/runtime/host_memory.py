"""Host memory of a CPU engine: keep the blocks a step frees for the next step.

A step on the CPU allocates and frees activations of a megabyte or more (a Gated DeltaNet
state of 16 rows is 16 x 4 x 64 x 64 floats, 1 MiB, and each token of a verify makes
several). glibc's malloc serves a block above its mmap threshold with a fresh mapping and
unmaps it on free; the threshold starts at 128 KiB and rises only as such blocks are freed,
and a step's mix of sizes keeps it low. Every new mapping then costs a page fault per 4 KiB
touched: on the demo pair at 16 rows, a speculative step that verifies the anchor alone took
about twice a plain decode step, and the same step with the freed blocks kept took about
1.1 of one (docs/engine.md, "Host memory on the CPU").

`keep_freed_memory` fixes the threshold at glibc's largest (32 MiB on 64-bit) and raises the
trim threshold, so freed blocks stay in the heap and the next step reuses them. It changes
no value computed, only where the bytes come from. It is process-wide, as malloc is: a CPU
engine applies it once when it is built. Other C libraries (and other systems) have no such
switches, and where the environment already sets glibc's own (MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_, GLIBC_TUNABLES) they are the user's choice and are left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)  # glibc's upper bound: 32 MiB
TRIM_THRESHOLD = 1 << 30  # free heap kept at the top before it goes back to the system
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

_applied: bool | None = None  # the outcome of the first call (None: not called yet)


def glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl and others lack it)
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds so that freed blocks are reused, once per process;
    True when the thresholds are (or were already) set here, False when they cannot be (not
    glibc) or the environment sets malloc's own."""
    global _applied
    if _applied is not None:
        return _applied
    libc = None if any(name in os.environ for name in USER_SETTINGS) else glibc()
    _applied = (
        libc is not None
        and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
        and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    )
    return _applied
