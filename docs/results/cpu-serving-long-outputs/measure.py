"""Event-loop time of one request's detokenisation (serving/stop_strings.py) for long outputs,
with and without stop strings, with the demo tokenizer, pushed one token at a time as a plain
server's chunks come. Run from the repository root:

    python docs/results/cpu-serving-long-outputs/measure.py

Each figure is one run, in seconds of one core; `per token` is microseconds."""

from __future__ import annotations

import time

from reference_engine.demo import DEMO_TARGET
from reference_engine.serving.stop_strings import StopStringText
from reference_engine.tokenizer import load_tokenizer

tok = load_tokenizer(DEMO_TARGET)
words = tok.encode("The quick brown fox jumps over the lazy dog. ").ids
stops = ("never there", "another stop", "<end>", "###")
print("| output tokens | stop strings | seconds | per token (us) |")
print("|---|---|---|---|")
for n in (16000, 64000, 256000):
    ids = (words * (n // len(words) + 1))[:n]
    for s in ((), stops):
        stream = StopStringText(tok.decode, s)
        start = time.perf_counter()
        for i, token in enumerate(ids):
            stream.push([token], final=i == len(ids) - 1)
        seconds = time.perf_counter() - start
        print(f"| {n} | {len(s)} | {seconds:.2f} | {seconds / n * 1e6:.1f} |", flush=True)
