"""`python -m reference_engine.serve`: the OpenAI-compatible reference server
(reference_engine/serving/server.py)."""

import sys

from .serving.server import main

if __name__ == "__main__":
    sys.exit(main())
