#!/bin/bash
# make bench at c16 on this tree: DFlash block 8 against block 16, 256 prompts, 3 repeats each, alternating;
# then the default make bench (c1, 4, 8, 16; 32 prompts) at block 16
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
D=reference_engine/assets/demo
t0=$(date +%s)
git rev-parse --short HEAD > $R/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
summ() {
  python3 - $1 <<'PY'
import csv, statistics, sys
by = {}
for r in csv.DictReader(open(sys.argv[1] + "/summary.csv")):
    by.setdefault((r["label"], r["concurrency"]), []).append(r)
m = lambda rows, k: statistics.median(float(r[k]) for r in rows if r.get(k))
for c in sorted({c for _, c in by}, key=int):
    a, b = by[("A", c)], by[("B", c)]
    print("BENCH", sys.argv[1].split("/")[-1], "c", c, "ratio", round(m(b, "output_tokens_per_s") / m(a, "output_tokens_per_s"), 2),
          "plain", [round(float(r["output_tokens_per_s"])) for r in a], "dflash", [round(float(r["output_tokens_per_s"])) for r in b],
          "acc", round(m(b, "acceptance_length"), 2))
PY
  grep -h "identical" $1/report.md | head -1
}
for run in b8-1 b16-1 b8-2 b16-2; do
  blk=${run%-*}; blk=${blk#b}
  timeout 120 make bench PYTHON=python3 BENCH_BLOCK=$blk BENCH_ARGS="--concurrency 16 --output-len 128 --repeats 3 --num-prompts 256 --dataset $D/heldout_prompts.jsonl" BENCH_OUT=$R/$run > $R/$run.log 2>&1
  echo "$run rc=$? t=$(( $(date +%s)-t0 ))"; summ $R/$run
done
timeout 200 make bench PYTHON=python3 BENCH_BLOCK=16 BENCH_OUT=$R/full-b16 > $R/full-b16.log 2>&1
echo "full-b16 rc=$? t=$(( $(date +%s)-t0 ))"; summ $R/full-b16
cd $OUT && tar czf r.tgz r && rm -rf r
