"""Our server with one deliberate fault planted (gates/faults.py), for the HTTP gate's test
that the gate fails on a broken engine. Testing only.

    python -m gates.faulty_serve FAULT [serve options...]
"""

from __future__ import annotations

import sys

from reference_engine.serving.server import main

from .faults import FAULTS, planted

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in FAULTS:
        sys.exit(
            f"usage: python -m gates.faulty_serve FAULT [serve options]; FAULT is one of {', '.join(FAULTS)}"
        )
    with planted(sys.argv[1]):
        sys.exit(main(sys.argv[2:]))
