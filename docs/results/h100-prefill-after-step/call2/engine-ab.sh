#!/bin/bash
# engine alone c16 on the demo pair: this tree (after) against prev.tgz (before), alternating, ROUNDS rounds
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
rm -rf /tmp/before && mkdir -p /tmp/before && tar xzf .prof/dev/prev.tgz -C /tmp/before
cp -r reference_engine/assets /tmp/before/reference_engine/ 2>/dev/null
mkdir -p $OUT/eng
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
A="--concurrency 16 --block-size 8 --commit-strategy per_token --output-len 128 --num-prompts 512 --repeats 3"
for r in $(seq ${ROUNDS:-2}); do
  for side in after before; do
    dir=$PWD; [ $side = before ] && dir=/tmp/before
    t0=$(date +%s)
    (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 200 python3 scripts/bench_engine.py $A --out $OUT/eng/$side-$r.csv > $OUT/eng/$side-$r.log 2>&1)
    echo "$side-$r rc=$? t=$(( $(date +%s)-t0 ))"
  done
done
python3 - $OUT/eng <<'PY' | tee $OUT/eng-summary.txt
import csv, glob, statistics, sys
res = {}
for f in sorted(glob.glob(sys.argv[1] + "/*.csv")):
    side = f.split("/")[-1].split("-")[0]
    for r in csv.DictReader(open(f)):
        res.setdefault((side, r["mode"]), []).append((float(r["output_tokens_per_s"]), float(r["ms_per_step"]), float(r["mean_acceptance_length"] or 0), r.get("draft_ahead_used", "")))
        print("RUN", f.split("/")[-1], r["mode"], round(float(r["output_tokens_per_s"])), "ms/step", round(float(r["ms_per_step"]), 3), "acc", r["mean_acceptance_length"][:5], "ahead used", r.get("draft_ahead_used", ""))
for side in ("before", "after"):
    p = [x[0] for x in res.get((side, "plain"), [])]; d = [x[0] for x in res.get((side, "dflash"), [])]
    if p and d:
        print(f"SUMMARY {side}: plain {statistics.median(p):.0f} dflash {statistics.median(d):.0f} ratio {statistics.median(d)/statistics.median(p):.3f} (runs {len(p)}) dflash ms/step {statistics.median(x[1] for x in res[(side,'dflash')]):.3f} plain ms/step {statistics.median(x[1] for x in res[(side,'plain')]):.3f}")
PY
# the GPU tests this change touches
t0=$(date +%s)
PYTHONPATH=/tmp/site:$PWD timeout ${TESTS_S:-240} python3 -m pytest -q -rfE -p no:cacheprovider -m "gpu or kernels" tests/test_gpu.py gates/test_exact_gpu.py -k "first_token or demo or cuda_graphs or pooled" > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc=$? t=$(( $(date +%s)-t0 ))"; tail -5 $OUT/gpu-tests.log
