"""Engine-level benchmark: plain vs DFlash. See reference_engine/bench/__init__.py for options."""

import sys

from reference_engine.bench import main

if __name__ == "__main__":
    sys.exit(main())
