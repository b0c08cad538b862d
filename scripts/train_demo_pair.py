"""Train the demo pair shipped in reference_engine/assets/demo (see
reference_engine/training/recipe.py). `--smoke` runs tiny settings in seconds on a CPU;
`--draft-arch dflash2 --from-pair reference_engine/assets/demo` trains a DFlash2 draft for
the shipped target (docs/demo-pair.md)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reference_engine.training.recipe import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
