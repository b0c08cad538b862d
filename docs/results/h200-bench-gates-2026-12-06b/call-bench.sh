#!/bin/bash
# 1) make bench c16 A/B, this tree against prev.tgz (aadf62c), alternating; 2) the kernel contract tests compiled
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; cat $R/gpu.txt
t0=$(date +%s)
D=reference_engine/assets/demo
summ() {
  python3 - $1 <<'PY'
import csv, statistics, sys
by = {}
for r in csv.DictReader(open(sys.argv[1] + "/summary.csv")):
    by.setdefault((r["label"], r["concurrency"]), []).append(r)
m = lambda rows, k: statistics.median(float(r[k]) for r in rows if r.get(k))
for c in sorted({c for _, c in by}, key=int):
    a, b = by[("A", c)], by[("B", c)]
    print("BENCH", sys.argv[1].split("/")[-1], "c", c, "ratio", round(m(b, "output_tokens_per_s") / m(a, "output_tokens_per_s"), 3),
          "plain", [round(float(r["output_tokens_per_s"])) for r in a], "dflash", [round(float(r["output_tokens_per_s"])) for r in b],
          "acc", round(m(b, "acceptance_length"), 2))
PY
  grep -h "identical" $1/report.md | head -1
}
BT=/tmp/base; mkdir -p $BT && tar xzf .prof/dev/prev.tgz -C $BT && ln -s $PWD/reference_engine/assets $BT/reference_engine/assets
for run in after-1 before-1 after-2 before-2 after-3 before-3; do
  [ $(( $(date +%s)-t0 )) -gt ${GUARD:-420} ] && break
  dir=$PWD; [ ${run%-*} = before ] && dir=$BT
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 100 make bench PYTHON=python3 BENCH_ARGS="--concurrency 16 --output-len 128 --repeats 3 --num-prompts 256 --dataset $D/heldout_prompts.jsonl" BENCH_OUT=$R/$run > $R/$run.log 2>&1)
  echo "$run rc=$? t=$(( $(date +%s)-t0 ))"; summ $R/$run
done
left=$(( ${TOTAL:-560} - ($(date +%s)-t0) ))
if [ $left -gt 30 ]; then
  timeout $left python3 -m pytest -q -rfE -p no:cacheprovider tests/test_kernels_runtime_contracts.py 2>&1 | tee $R/kernels.log | tail -5
fi
for f in $R/*-[0-9]; do [ -f $f/summary.csv ] && summ $f; done
cd $OUT && tar czf r.tgz r && rm -rf r
