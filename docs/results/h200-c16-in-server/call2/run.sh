#!/bin/bash
# call 2: make bench at c16 on this tree, 32 prompts (the default) and 256, 3 repeats each
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
D=reference_engine/assets/demo
t0=$(date +%s)
git rev-parse --short HEAD > $R/tree.txt 2>/dev/null
for n in 32 256; do
  timeout 200 make bench PYTHON=python3 BENCH_ARGS="--concurrency 16 --output-len 128 --repeats 3 --num-prompts $n --dataset $D/heldout_prompts.jsonl" BENCH_OUT=$R/c16-n$n > $R/c16-n$n.log 2>&1
  echo "n=$n rc=$? t=$(( $(date +%s)-t0 ))"
  python3 - $R/c16-n$n <<'PY'
import csv, statistics, sys
by = {}
for r in csv.DictReader(open(sys.argv[1] + "/summary.csv")):
    by.setdefault(r["label"], []).append(r)
a, b = by["A"], by["B"]
m = lambda rows, k: statistics.median(float(r[k]) for r in rows if r.get(k))
print("BENCH", sys.argv[1].split("/")[-1], "ratio", round(m(b, "output_tokens_per_s") / m(a, "output_tokens_per_s"), 2),
      "plain", [round(float(r["output_tokens_per_s"])) for r in a], "dflash", [round(float(r["output_tokens_per_s"])) for r in b],
      "cpu client/server/engine A", [(r.get("client_cpu"), r.get("server_cpu"), r.get("engine_cpu")) for r in a],
      "B", [(r.get("client_cpu"), r.get("server_cpu"), r.get("engine_cpu")) for r in b], "procs", a[0].get("client_processes"), "acc", [r.get("acceptance_length", "")[:5] for r in b])
PY
  grep -h "identical" $R/c16-n$n/report.md | head -2
done
cd $OUT && tar czf r.tgz r && rm -rf r
