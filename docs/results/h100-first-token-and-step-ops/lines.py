import collections, sys
path, proc = sys.argv[1], sys.argv[2]
incl = collections.Counter(); tot = 0
for line in open(path):
    stack, _, count = line.rstrip("\n").rpartition(" ")
    frames = stack.split(";")
    if not any(proc in f for f in frames[:5]): continue
    c = int(count); tot += c
    seen = set()
    for f in frames:
        if f not in seen:
            incl[f] += c; seen.add(f)
print("total", tot)
for f, c in incl.most_common(150):
    if "reference_engine" in f and "process" not in f[:8]:
        print(f"{c:6d} {100*c/tot:5.1f}% {f[:130]}")
