"""Command-line options and environment variables that point the gates at a user's own
checkpoints (registered from the repository's root conftest.py).

    pytest gates --target-model PATH --draft-model PATH [--gate-device cuda]
                 [--gate-dtype bfloat16]

or DFLASH_GATE_TARGET, DFLASH_GATE_DRAFT, DFLASH_GATE_DEVICE, DFLASH_GATE_DTYPE. Without a
target the gates build tiny dense and hybrid pairs and run them in float64 on the CPU.
"""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dflash gates")
    group.addoption("--target-model", default=os.environ.get("DFLASH_GATE_TARGET"),
                    help="target checkpoint directory (env DFLASH_GATE_TARGET)")
    group.addoption("--draft-model", default=os.environ.get("DFLASH_GATE_DRAFT"),
                    help="DFlash draft directory for --target-model (env DFLASH_GATE_DRAFT)")
    group.addoption("--gate-device", default=os.environ.get("DFLASH_GATE_DEVICE", "cpu"),
                    help="device for the gate models (env DFLASH_GATE_DEVICE)")
    group.addoption("--gate-dtype", default=os.environ.get("DFLASH_GATE_DTYPE"),
                    help="float64 | float32 | bfloat16; default float64 for tiny pairs, "
                    "bfloat16 for a user's checkpoints (env DFLASH_GATE_DTYPE)")
