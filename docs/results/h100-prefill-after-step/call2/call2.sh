#!/bin/bash
# 1) engine alone c16 A/B (callB.sh), 2) the GPU tests this change touches, 3) make bench c16
# after/before while the call's time allows
set -u
T0=$(date +%s)
TESTS_S=150 ROUNDS=${ROUNDS:-2} bash .prof/dev/callB.sh 2>&1 | grep -v "^RUN"
grep -h "^RUN" /dev/null
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R $OUT/sum
D=reference_engine/assets/demo
BT=/tmp/before; [ -e $BT/reference_engine/assets ] || ln -s $PWD/reference_engine/assets $BT/reference_engine/assets
for run in ${RUNS:-after-1 before-1}; do
  left=$(( ${LIMIT:-540} - ($(date +%s)-T0) ))
  [ $left -lt 130 ] && { echo "no time for $run ($left s left)"; break; }
  dir=$PWD; [ ${run%-*} = before ] && dir=$BT
  t1=$(date +%s)
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout $(( left - 10 )) make bench PYTHON=python3 BENCH_ARGS="--concurrency 16 --output-len 128 --repeats 3 --num-prompts 512 --dataset $D/heldout_prompts.jsonl" BENCH_OUT=$R/$run > $R/$run.log 2>&1)
  echo "$run rc=$? t=$(( $(date +%s)-t1 ))"
  [ -f $R/$run/summary.csv ] && cp $R/$run/summary.csv $OUT/sum/$run-summary.csv && python3 - $R/$run <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1] + "/summary.csv")))
a = [float(r["output_tokens_per_s"]) for r in rows if r["label"] == "A"]
b = [float(r["output_tokens_per_s"]) for r in rows if r["label"] == "B"]
print("BENCH", sys.argv[1].split("/")[-1], "plain", [round(x) for x in a], "dflash", [round(x) for x in b], "ratio", round(statistics.median(b) / statistics.median(a), 3))
PY
  grep -h "identical" $R/$run/report.md 2>/dev/null | head -1
done
grep "^RUN" -h $OUT/eng/*.log 2>/dev/null | head -0
