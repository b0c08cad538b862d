"""py-spy raw stacks: within stacks through FILTER, samples by the innermost frame of our code
(reference_engine/), and inclusive by function of our code."""

import collections
import re
import sys

path, filt = sys.argv[1], sys.argv[2]
top = int(sys.argv[3]) if len(sys.argv) > 3 else 40
selfc, incl, total = collections.Counter(), collections.Counter(), 0
for line in open(path):
    stack, _, count = line.rstrip("\n").rpartition(" ")
    if filt not in stack:
        continue
    c = int(count)
    total += c
    frames = stack.split(";")
    ours = [f for f in frames if "reference_engine/" in f]
    if not ours:
        continue
    i = max(k for k, f in enumerate(frames) if "reference_engine/" in f)
    below = frames[i + 1] if i + 1 < len(frames) else "(self)"
    selfc[frames[i].replace("reference_engine/", "") + "  ->  " + re.sub(r"\(.*/", "(", below)[:60]] += c
    for f in set(re.sub(r":\d+\)", ")", f) for f in ours):
        incl[f.replace("reference_engine/", "")] += c
print(f"{total} samples through {filt}")
print("innermost line of ours (-> what it called):")
for f, c in selfc.most_common(top):
    print(f"  {c:6d} {100 * c / total:5.1f}%  {f[:150]}")
print("inclusive by function:")
for f, c in incl.most_common(top):
    print(f"  {c:6d} {100 * c / total:5.1f}%  {f[:150]}")
