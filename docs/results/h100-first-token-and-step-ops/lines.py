"""Summarise py-spy raw output (`record -f raw`) by line: each frame's inclusive samples, the
engine's frames first. `python lines.py SPY_RAW_FILE FILTER`: only stacks whose first five
frames contain FILTER ("" for all)."""

import collections
import sys

path, wanted = sys.argv[1], sys.argv[2]
inclusive: collections.Counter = collections.Counter()
total = 0
for line in open(path):
    stack, _, count = line.rstrip("\n").rpartition(" ")
    frames = stack.split(";")
    if not any(wanted in f for f in frames[:5]):
        continue
    samples = int(count)
    total += samples
    for frame in set(frames):
        inclusive[frame] += samples
print("total", total)
for frame, samples in inclusive.most_common(150):
    if "reference_engine" in frame and "process" not in frame[:8]:
        print(f"{samples:6d} {100 * samples / total:5.1f}% {frame[:130]}")
