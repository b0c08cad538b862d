"""Our server with one deliberate fault planted (gates/faults.py), for the HTTP gate's test
that the gate fails on a broken engine. Testing only.

    python -m gates.faulty_serve FAULT [serve options...]

With its engine in a process of its own (`--engine-loop process`), the engine process imports
this module as its main one, under the name `__mp_main__`, with the server's arguments: it
plants the same fault there, for the rest of its life.
"""

from __future__ import annotations

import sys

from reference_engine.serving.server import main

from .faults import FAULTS, planted

if __name__ == "__mp_main__" and len(sys.argv) > 1 and sys.argv[1] in FAULTS:
    # the engine process: the fault stays for its life (held here: a block collected early
    # would take the fault back out)
    _for_life = planted(sys.argv[1])
    _for_life.__enter__()

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in FAULTS:
        sys.exit(
            f"usage: python -m gates.faulty_serve FAULT [serve options]; FAULT is one of {', '.join(FAULTS)}"
        )
    with planted(sys.argv[1]):
        sys.exit(main(sys.argv[2:]))
