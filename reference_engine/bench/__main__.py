"""`python -m reference_engine.bench`: the engine benchmark (reference_engine/bench/__init__.py)."""

import sys

from . import main

sys.exit(main())
