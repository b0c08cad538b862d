"""CPU use of the client, the HTTP process and the engine process under steady c16 load.

usage: python3 docs/results/h200-server-three-processes/util.py TREE LABEL MODE OUTDIR   (MODE plain|dflash)
Starts TREE's server (process mode), runs loads with the harness client from TREE, samples
/proc/<pid>/stat every 50 ms, prints tok/s and each process's CPU share over the load window.
"""

import csv
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

tree, label, mode, out = sys.argv[1:5]
os.makedirs(out, exist_ok=True)
D = "reference_engine/assets/demo"
env = dict(os.environ, PYTHONPATH="/tmp/site:" + tree)
tick = os.sysconf("SC_CLK_TCK")
port = 8400 + (hash(label + mode) % 500)
cmd = [
    "python3",
    "-m",
    "reference_engine.serve",
    "--model",
    f"{D}/target",
    "--commit-strategy",
    "per_token",
    "--max-num-seqs",
    "16",
    "--engine-loop",
    "process",
    "--port",
    str(port),
]
if mode == "dflash":
    cmd += ["--dflash-draft-model-path", f"{D}/draft", "--block-size", "8"]
srv = subprocess.Popen(
    cmd, cwd=tree, env=env, stdout=open(f"{out}/srv-{label}-{mode}.log", "w"), stderr=subprocess.STDOUT
)
for _ in range(240):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
        break
    except Exception:
        time.sleep(0.5)


def children(pid):
    try:
        return [int(x) for x in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


def cpu(pid):
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / tick
    except OSError:
        return 0.0


def engine_pid():
    for c in children(srv.pid):
        try:
            if "spawn_main" in open(f"/proc/{c}/cmdline").read():
                return c
        except OSError:
            pass
    return None


eng = engine_pid()
print("server", srv.pid, "engine", eng, flush=True)


def scrape():
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    got = {}
    for line in text.splitlines():
        for key in (
            "dflash:time_to_first_token_seconds_sum",
            "dflash:time_to_first_token_seconds_count",
            "dflash:spec_decode_num_drafts_total",
            "dflash:generation_tokens_total",
        ):
            if line.startswith(key + " "):
                got[key] = float(line.split()[-1])
    return got


def load(name, clients, conc, n):
    m0 = scrape()
    procs = []
    for k in range(clients):
        procs.append(
            subprocess.Popen(
                [
                    "python3",
                    "-m",
                    "harness",
                    "bench",
                    "--base-url",
                    f"http://127.0.0.1:{port}",
                    "--concurrency",
                    str(conc),
                    "--num-prompts",
                    str(n),
                    "--output-len",
                    "128",
                    "--dataset",
                    f"{D}/heldout_prompts.jsonl",
                    "--seed",
                    str(k),
                    "--out",
                    f"{out}/{label}-{mode}-{name}-{k}",
                ],
                cwd=tree,
                env=env,
                stdout=open(f"{out}/{label}-{mode}-{name}-{k}.log", "w"),
                stderr=subprocess.STDOUT,
            )
        )
    samples = []
    while any(p.poll() is None for p in procs):
        samples.append(
            (time.monotonic(), [cpu(p.pid) for p in procs], cpu(srv.pid), cpu(eng) if eng else 0.0)
        )
        time.sleep(0.05)
    # the load window: where the HTTP process is busy (> 20% of a core between samples)
    busy = [
        i
        for i in range(1, len(samples))
        if max(samples[i][2] - samples[i - 1][2], samples[i][3] - samples[i - 1][3])
        / (samples[i][0] - samples[i - 1][0])
        > 0.3
    ]
    if len(busy) < 4:
        return None
    a, b = samples[busy[0] - 1], samples[busy[-1]]
    dt = b[0] - a[0]
    client = max((b[1][k] - a[1][k]) / dt for k in range(clients))
    tps, ttft = 0.0, []
    for k in range(clients):
        for r in csv.DictReader(open(f"{out}/{label}-{mode}-{name}-{k}/summary.csv")):
            tps += float(r["output_tokens_per_s"])
            ttft.append(float(r["ttft_ms_mean"]))
    m1 = scrape()
    d = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1}
    srv_ttft = (
        1000
        * d["dflash:time_to_first_token_seconds_sum"]
        / max(d["dflash:time_to_first_token_seconds_count"], 1)
    )
    steps = d.get("dflash:spec_decode_num_drafts_total", 0)
    return dict(
        name=name,
        tps=tps,
        window=dt,
        client=client,
        http=(b[2] - a[2]) / dt,
        engine=(b[3] - a[3]) / dt,
        ttft=statistics.mean(ttft),
        srv_ttft=srv_ttft,
        steps=steps,
        tokens=d.get("dflash:generation_tokens_total", 0),
    )


rows = []
N = int(os.environ.get("UTIL_N", "384"))
load("warm", 1, 16, min(64, N))
for rep in range(3):
    rows.append(load(f"c16-{rep}", 1, 16, N))
rows.append(load("2x8", 2, 8, N // 2))
srv.terminate()
srv.wait(30)
for r in rows:
    if not r:
        continue
    per_step = r["tokens"] / r["steps"] if r["steps"] else 0
    print(
        f"{label:6s} {mode:6s} {r['name']:7s} tok/s {r['tps']:7.0f}  cpu: client {r['client']:.2f} "
        f"http {r['http']:.2f} engine {r['engine']:.2f}  window {r['window']:.2f}s  "
        f"ttft client {r['ttft']:.1f} server {r['srv_ttft']:.1f} ms  tok/step {per_step:.1f}"
    )
json.dump(rows, open(f"{out}/util-{label}-{mode}.json", "w"))
