#!/bin/bash
# make bench c16: steps per turn 1 against 4, alternating, same tree
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; cat $R/gpu.txt
git log --oneline -1 > $R/tree.txt 2>/dev/null
t0=${T0:-$(date +%s)}
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
for run in ${RUNS:-warm-1 spt1-1 spt4-1 spt1-2 spt4-2 spt1-3 spt4-3}; do
  [ $(( $(date +%s)-t0 )) -gt ${GUARD:-470} ] && break
  n=${run%-*}; n=${n#spt}; [ "$n" = warm ] && n=1
  timeout 110 make bench PYTHON=python3 BENCH_STEP_COSTS="--steps-per-turn $n" BENCH_ARGS="--concurrency 16 --output-len 128 --repeats 3 --num-prompts ${NP:-512} --dataset $D/heldout_prompts.jsonl" BENCH_OUT=$R/$run > $R/$run.log 2>&1
  echo "$run rc=$? t=$(( $(date +%s)-t0 ))"; [ -f $R/$run/summary.csv ] && summ $R/$run
done
for f in $R/*-[0-9]; do [ -f $f/summary.csv ] && summ $f; done
python3 - $R <<'PY'
import csv, glob, statistics, sys
for tag in ("spt1", "spt4"):
    a, b = [], []
    for d in glob.glob(sys.argv[1] + f"/{tag}-*/summary.csv"):
        for r in csv.DictReader(open(d)):
            (a if r["label"] == "A" else b).append(float(r["output_tokens_per_s"]))
    if a and b:
        print("POOLED", tag, "plain", round(statistics.median(a)), "dflash", round(statistics.median(b)), "ratio", round(statistics.median(b) / statistics.median(a), 3), len(a), len(b))
PY
find $R -name "*.jsonl" -size +2M -delete
cd $OUT && tar czf r.tgz r && rm -rf r
