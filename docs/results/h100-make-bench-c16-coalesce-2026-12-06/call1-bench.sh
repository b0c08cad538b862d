#!/bin/bash
# make bench c16 A/B/C, alternating after a warm-up run: this tree (after), the tree in
# .prof/dev/prev.tgz (before), this tree with uvloop importable (uv: uvicorn's loop="auto" takes it)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-uv .prof/dev/uvloop/*.whl > /dev/null 2>&1 || echo "pip uv failed"
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R $OUT/sum
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
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
          "acc", round(m(b, "acceptance_length"), 2), "srvA", [r["server_cpu"] for r in a], "srvB", [r["server_cpu"] for r in b],
          "engA", [r["engine_cpu"] for r in a], "engB", [r["engine_cpu"] for r in b], "cli", [r["client_cpu"] for r in b])
PY
  grep -h "identical" $1/report.md | head -1
  cp $1/summary.csv $OUT/sum/$(basename $1)-summary.csv
}
BT=/tmp/base; mkdir -p $BT && tar xzf .prof/dev/prev.tgz -C $BT && ln -s $PWD/reference_engine/assets $BT/reference_engine/assets
bench() {  # tree dir, out name, prompts, repeats, limit, extra PYTHONPATH
  (cd $1 && PYTHONPATH=${6:-}/tmp/site:$1 timeout $5 make bench PYTHON=python3 BENCH_ARGS="--concurrency 16 --output-len 128 --repeats $4 --num-prompts $3 --dataset $D/heldout_prompts.jsonl" BENCH_OUT=$R/$2 > $R/$2.log 2>&1)
  echo "$2 rc=$? t=$(( $(date +%s)-t0 ))"
}
bench $BT warm 64 1 130
for run in ${RUNS:-after-1 before-1 uv-1 after-2 before-2 uv-2 after-3 before-3 uv-3}; do
  [ $(( $(date +%s)-t0 )) -gt ${GUARD:-480} ] && break
  dir=$PWD; [ ${run%-*} = before ] && dir=$BT
  extra=""; [ ${run%-*} = uv ] && extra=/tmp/site-uv:
  bench $dir $run 512 3 120 $extra; summ $R/$run
done
python3 - $R <<'PY'
import csv, glob, statistics, sys
for side in ("after", "before", "uv"):
    a, b = [], []
    for f in sorted(glob.glob(sys.argv[1] + f"/{side}-*/summary.csv")):
        for r in csv.DictReader(open(f)):
            (a if r["label"] == "A" else b).append(float(r["output_tokens_per_s"]))
    if a and b:
        print("POOLED", side, "plain", round(statistics.median(a)), "dflash", round(statistics.median(b)), "ratio", round(statistics.median(b) / statistics.median(a), 3), "n", len(a), len(b))
PY
