# ruff: noqa: E501, E701, E702 (a measurement's script, kept as it ran)
import collections
import glob
import statistics as st

ev = collections.defaultdict(dict)
steps = []
for f in glob.glob("/tmp/trace-*.log"):
    for line in open(f):
        parts = line.split()
        if len(parts) < 3:
            continue
        t, tag = float(parts[0]), parts[1]
        if tag == "H_arrive":
            rid = parts[2]
            ev[rid]["H_arrive"] = float(parts[3])
            ev[rid]["H_start"] = t
        elif tag in ("E_step0", "E_step1"):
            steps.append((t, tag, int(parts[2])))
        elif tag.startswith("C_"):
            ev["c" + parts[2] + "-" + str(len(ev))][tag] = t
        else:
            ev[parts[2]].setdefault(tag, t)
order = ["H_start", "H_submit", "E_add", "E_admit", "H_added", "E_first_out", "H_first_out", "H_first_get"]
full = [d for d in ev.values() if all(k in d for k in order + ["H_arrive"])]
full.sort(key=lambda d: d["H_arrive"])
full = full[len(full) // 5 : 4 * len(full) // 5]
print("requests", len(full))
prev = "H_arrive"
for k in order:
    d = [(x[k] - x[prev]) * 1e3 for x in full]
    print(f"{prev:>12s} -> {k:<12s} median {st.median(d):7.2f} ms  p90 {sorted(d)[9 * len(d) // 10]:7.2f}")
    prev = k
tot = [(x["H_first_get"] - x["H_arrive"]) * 1e3 for x in full]
print("arrive -> first get median", round(st.median(tot), 2))
steps.sort()
s0 = [t for t, tag, _ in steps if tag == "E_step0"]
rows = [n for t, tag, n in steps if tag == "E_step0"]
gaps = [(b - a) * 1e3 for a, b in zip(s0, s0[1:])]
print(
    "steps",
    len(s0),
    "step interval median ms",
    round(st.median(gaps), 3),
    "active rows mean",
    round(st.mean(rows), 2),
)


# the end of a request and its successor
def col(tag):
    return sorted(t for d in ev.values() for k, t in d.items() if k == tag)


def paired(tag_a, tag_b, shift=0):
    """each a to the first b after it not taken by an earlier a (greedy, in time order)"""
    import bisect

    a, b = col(tag_a), col(tag_b)
    used, d, _j = set(), [], 0
    for t in a:
        i = bisect.bisect_left(b, t)
        while i < len(b) and i in used:
            i += 1
        if i < len(b):
            used.add(i)
            d.append((b[i] - t) * 1e3)
    d = d[len(d) // 5 : 4 * len(d) // 5]
    return round(st.median(d), 2), round(sorted(d)[9 * len(d) // 10], 2)


ends = [d for d in ev.values() if all(k in d for k in ("E_last", "H_last_out", "H_done"))]
for a, b in (("E_last", "H_last_out"), ("H_last_out", "H_done")):
    d = [(x[b] - x[a]) * 1e3 for x in ends]
    print(
        f"{a:>12s} -> {b:<12s} median {st.median(d):7.2f} ms  p90 {sorted(d)[9 * len(d) // 10]:7.2f} (per request)"
    )
print(
    "by order: H_done -> C_done",
    paired("H_done", "C_done"),
    "C_done -> C_drained",
    paired("C_done", "C_drained"),
    "C_drained -> C_send",
    paired("C_drained", "C_send"),
    "C_send -> H_start",
    paired("C_send", "H_start"),
    "E_last -> E_admit",
    paired("E_last", "E_admit"),
)
