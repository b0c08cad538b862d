# ruff: noqa: E501, E701, E702 (a measurement's script, kept as it ran)
import collections
import sys

inc = collections.Counter()
selfc = collections.Counter()
total = 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n)
    total += n
    frames = stack.split(";")
    seen = set()
    for f in frames:
        key = f.split(" (")[0] + " " + (f.split("(")[-1].split(":")[0].split("/")[-1] if "(" in f else "")
        if key not in seen:
            inc[key] += n
            seen.add(key)
    selfc[frames[-1].split(" (")[0] + " " + frames[-1].split("(")[-1].split(":")[0].split("/")[-1]] += n
print("total", total)
k = int(sys.argv[2]) if len(sys.argv) > 2 else 60
for name, n in inc.most_common(k):
    print(f"{n:6d} {100 * n / total:5.1f}% {name}")
print("--- self")
for name, n in selfc.most_common(30):
    print(f"{n:6d} {100 * n / total:5.1f}% {name}")
