"""Summaries of call 1: each side's load figures, /metrics differences, running gauge samples."""

import csv
import re
import statistics
import sys

R = sys.argv[1]


def metric(path):
    out = {}
    for line in open(path):
        if line.startswith("#"):
            continue
        m = re.match(r"(\S+?)(\{[^}]*\})? (\S+)$", line.strip())
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


for side in ("plain", "dflash"):
    try:
        rows = list(csv.DictReader(open(f"{R}/spy-load-{side}/summary.csv")))
        b, a = metric(f"{R}/metrics-before-{side}.txt"), metric(f"{R}/metrics-after-{side}.txt")
    except OSError as exc:
        print(side, exc)
        continue
    d = {k: a[k] - b.get(k, 0) for k in a if isinstance(a[k], float)}
    r = rows[0]
    print(
        side,
        "tok/s",
        round(float(r["output_tokens_per_s"])),
        "dur",
        r["duration_s"][:5],
        "cpu client/server/engine",
        r.get("client_cpu"),
        r.get("server_cpu"),
        r.get("engine_cpu"),
        "ttft med",
        r.get("ttft_ms_median", "")[:5],
        "itl chunk med",
        r.get("itl_chunk_ms_median", "")[:5],
        "acc",
        r.get("acceptance_length", "")[:5],
    )
    for k, v in sorted(d.items()):
        if v and any(
            s in k
            for s in (
                "num_drafts",
                "generation_tokens",
                "phase_seconds",
                "engine_cpu",
                "process_cpu",
                "verify_width",
                "fallback",
                "engine_steps",
                "draft_ahead",
            )
        ):
            print("   ", k, round(v, 4))
for side in ("plain", "dflash"):
    try:
        v = [float(l.split()[-1]) for l in open(f"{R}/running-{side}.txt") if l.strip()]
        print(
            side,
            "running gauge samples",
            len(v),
            "mean",
            round(statistics.mean(v), 2) if v else None,
            "values",
            v[:40],
        )
    except OSError as exc:
        print(exc)
