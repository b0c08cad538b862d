"""Training the demo pair: a small Qwen3.5 hybrid target and its DFlash draft, trained on
the interpreter's own standard library with this package's model code
(`scripts/train_demo_pair.py`)."""
