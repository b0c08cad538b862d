"""Training the demo pair: a small Qwen3.5 hybrid target and its DFlash draft, trained on
the Python source of pinned PyPI wheels with this package's model code
(`scripts/train_demo_pair.py`)."""
