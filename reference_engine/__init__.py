"""Reference DFlash engine: Qwen3 / Qwen3.5 targets, plain greedy decode, speculative decoding."""

__version__ = "0.1.0"
