"""One thread of one process from py-spy raw output: its functions by inclusive and self samples.

usage: spy_threads.py RAW 'process PID' THREAD [N]"""

import collections
import sys

path, proc_pat, thread_pat = sys.argv[1], sys.argv[2], sys.argv[3]
items = []
for line in open(path):
    stack, _, count = line.rstrip("\n").rpartition(" ")
    frames = stack.split(";")
    procs = [i for i, f in enumerate(frames[:3]) if f.startswith("process ")]
    pi = procs[-1] if procs else None
    if pi is None or not frames[pi].startswith(proc_pat):
        continue
    ti = next((i for i, f in enumerate(frames[pi : pi + 4], pi) if f.startswith("thread (")), None)
    if ti is None or thread_pat not in frames[ti]:
        continue
    items.append((frames[ti + 1 :], int(count)))
total = sum(c for _, c in items)
print(path, proc_pat, thread_pat, "samples", total)
incl, selfc = collections.Counter(), collections.Counter()
for frames, c in items:
    for f in set(frames):
        incl[f[:120]] += c
    selfc[frames[-1][:120]] += c
print(" inclusive:")
for f, c in incl.most_common(int(sys.argv[4]) if len(sys.argv) > 4 else 45):
    print(f"  {c:6d} {100 * c / total:5.1f}% {f}")
print(" self:")
for f, c in selfc.most_common(25):
    print(f"  {c:6d} {100 * c / total:5.1f}% {f}")
