"""The output folder of a harness command (bench, ab, compare; scripts/profile.sh checks its
own through `python -m harness.output DIR`): checked before anything runs, and held by one
process at a time.

A benchmark that cannot write its results wastes the time it ran, and a traceback for a full
disk says less than one line. `claim` creates the folder, writes and removes a probe file,
checks the free space, and takes an exclusive lock on DIR/.lock, so that two processes never
interleave their rows in one folder. The lock is flock(2): the system releases it when the
process ends, however it ends, so a crashed run leaves no stale lock.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import time
from pathlib import Path
from typing import IO

LOCK = ".lock"
MIN_FREE_BYTES = 16 * 2**20  # a sweep's rows, plots and report take a few MiB


class OutputError(Exception):
    """The output folder cannot be used: the one-line reason."""


def check(out: Path, min_free_bytes: int = MIN_FREE_BYTES) -> None:
    """Create `out` and prove it takes a file and has room; OutputError otherwise."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create the output folder {out}: {exc.strerror or exc}") from None
    probe = out / ".write-check"
    try:
        probe.write_bytes(b"\0" * 4096)
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"cannot write into the output folder {out}: {exc.strerror or exc}") from None
    free = shutil.disk_usage(out).free
    if free < min_free_bytes:
        raise OutputError(
            f"the output folder {out} has {free / 2**20:.1f} MiB free; "
            f"a run needs at least {min_free_bytes / 2**20:.0f} MiB"
        )


class OutputLock:
    """The exclusive hold of one output folder; `release` (or the process's end) lets go."""

    def __init__(self, out: Path, file: IO[str]) -> None:
        self.out, self.file = out, file

    def release(self) -> None:
        if not self.file.closed:
            self.file.close()


def claim(out: Path, min_free_bytes: int = MIN_FREE_BYTES) -> OutputLock:
    """`check` the folder, then lock it for this process; OutputError when another holds it."""
    check(out, min_free_bytes)
    try:
        file = (out / LOCK).open("a+")
    except OSError as exc:
        raise OutputError(
            f"cannot open the output folder's lock {out / LOCK}: {exc.strerror or exc}"
        ) from None
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read().strip() or "a process that did not say which"
        file.close()
        raise OutputError(
            f"the output folder {out} is in use by another run ({holder}): "
            "wait for it to end or give another --out"
        ) from None
    file.truncate(0)
    file.write(f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    file.flush()
    return OutputLock(out, file)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m harness.output DIR")
    try:
        check(Path(sys.argv[1]))
    except OutputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
