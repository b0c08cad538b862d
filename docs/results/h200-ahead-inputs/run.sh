#!/bin/bash
# engine A/B old (HEAD before the change, $OLD) vs new, interleaved, each pinned to cores 2-5; then make bench c16
# OLD: a folder holding the earlier tree's reference_engine (git archive ef1a4e7 reference_engine | tar -x -C $OLD)
set -u
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
R=$OUT/r; mkdir -p $R
D=reference_engine/assets/demo
t0=$(date +%s)
for rep in 1 2 3; do for tree in old new; do
  if [ $tree = old ]; then P=/tmp/site:$PWD/$OLD:$PWD; else P=/tmp/site:$PWD; fi
  PYTHONPATH=$P timeout 80 taskset -c 2-5 python3 docs/results/h200-ahead-inputs/ab.py $tree > $R/ab-$tree-$rep.log 2>&1; grep "^AB" $R/ab-$tree-$rep.log
done; done
echo "t=$(( $(date +%s)-t0 ))"
show() { python3 - "$1" <<'PY'
import csv, statistics, sys
by = {}
for r in csv.DictReader(open(sys.argv[1] + "/summary.csv")):
    by.setdefault(r["label"], []).append(r)
a, b = by["A"], by["B"]
m = lambda rows, k: statistics.median(float(r[k]) for r in rows if r.get(k))
print("BENCH", sys.argv[1].split("/")[-1], "ratio", round(m(b, "output_tokens_per_s") / m(a, "output_tokens_per_s"), 2),
      "plain", [round(float(r["output_tokens_per_s"])) for r in a], "dflash", [round(float(r["output_tokens_per_s"])) for r in b],
      "cpu client/server/engine A", [(r.get("client_cpu"), r.get("server_cpu"), r.get("engine_cpu")) for r in a][:1],
      "B", [(r.get("client_cpu"), r.get("server_cpu"), r.get("engine_cpu")) for r in b][:1], "procs", a[0].get("client_processes"))
PY
}
for n in 32 256; do
  timeout 170 make bench PYTHON=python3 BENCH_ARGS="--concurrency 16 --output-len 128 --repeats 3 --num-prompts $n --dataset $D/heldout_prompts.jsonl" BENCH_OUT=$R/c16-n$n > $R/c16-n$n.log 2>&1
  echo "n=$n rc=$? t=$(( $(date +%s)-t0 ))"; show $R/c16-n$n; grep -h identical $R/c16-n$n/report.md
done
cd $OUT && tar czf r.tgz r && rm -rf r
