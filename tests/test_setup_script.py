"""scripts/setup.sh's checks before it installs anything: its options, and the disk space."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_setup(tmp_path: Path, free_kb: int, **env: str) -> subprocess.CompletedProcess:
    """setup.sh with a `df` that reports `free_kb` free and an interpreter that fails at once,
    so the script stops at its first install."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    df = bin_dir / "df"
    df.write_text(
        "#!/bin/sh\n"
        'echo "Filesystem 1024-blocks Used Available Capacity Mounted on"\n'
        f'echo "/dev/x 100000000 1 {free_kb} 1% /"\n'
    )
    df.chmod(0o755)
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": "false", **env}
    return subprocess.run(
        ["bash", str(ROOT / "scripts/setup.sh")], env=full, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("peers", "free_gb", "warned"),
    [("yes", 1, True), ("yes", 4.5, True), ("yes", 6, False), ("no", 3, True), ("no", 4.5, False)],
)
def test_setup_warns_of_a_disk_too_full_for_a_fresh_install(tmp_path, peers, free_gb, warned):
    """Less than 5 GB free (4 GB without the peer clients) gets a warning naming the free
    space and the need before the first install; more gets none."""
    free_kb = int(free_gb * 1024 * 1024)
    done = run_setup(tmp_path, free_kb, PEERS=peers)
    assert done.returncode != 0  # the interpreter that fails at once stopped it
    need = 5 if peers == "yes" else 4
    line = f"warning: {free_kb // 1024} MiB free on this disk; a fresh install needs about {need} GB"
    assert (line in done.stderr) is warned, done.stderr


@pytest.mark.parametrize(("name", "value"), [("DEPS", "latest"), ("PEERS", "maybe")])
def test_setup_refuses_an_unknown_option_before_anything(tmp_path, name, value):
    """An unknown DEPS or PEERS stops setup with exit code 2 and the accepted values, before the
    disk check or any install."""
    done = run_setup(tmp_path, 1024, **{name: value})
    assert done.returncode == 2
    assert f"error: {name}={value}: expected" in done.stderr
    assert "warning" not in done.stderr
