"""Summarise py-spy raw output (--subprocesses --threads --idle): per process and thread, its
samples and the top functions by self and by inclusive samples."""

import collections
import sys

for path in sys.argv[1:]:
    print("=" * 30, path)
    try:
        lines = open(path).read().splitlines()
    except OSError as exc:
        print(exc)
        continue
    groups = collections.defaultdict(list)
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        # first frames: process, then thread
        key = (frames[0][:60], frames[1][:60] if len(frames) > 1 else "")
        groups[key].append((frames[2:], int(count)))
    for key, items in sorted(groups.items(), key=lambda kv: -sum(c for _, c in kv[1])):
        total = sum(c for _, c in items)
        if total < 50:
            continue
        selfc, incl = collections.Counter(), collections.Counter()
        for frames, c in items:
            if frames:
                selfc[frames[-1][:110]] += c
            for f in set(frames):
                incl[f[:110]] += c
        print(f"\n-- {key[0]} | {key[1]}: {total} samples")
        print("  self:")
        for f, c in selfc.most_common(14):
            print(f"   {c:6d} {100 * c / total:5.1f}% {f}")
        print("  inclusive:")
        for f, c in incl.most_common(22):
            print(f"   {c:6d} {100 * c / total:5.1f}% {f}")
