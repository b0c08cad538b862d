#!/bin/bash
# engine alone c16 on the demo pair at --steps-per-turn 4, 1, 2 (one process each), then GPU tests
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/eng
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
A="--concurrency 16 --block-size 8 --commit-strategy per_token --output-len 128 --num-prompts 512 --repeats 3"
for spt in ${SPTS:-4 1 2}; do
  t0=$(date +%s)
  timeout 150 python3 scripts/bench_engine.py $A --steps-per-turn $spt --out $OUT/eng/spt$spt.csv > $OUT/eng/spt$spt.log 2>&1
  echo "spt$spt rc=$? t=$(( $(date +%s)-t0 ))"
done
python3 - $OUT/eng <<'PY' | tee $OUT/eng-summary.txt
import csv, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.csv")):
    rows = {r["mode"]: r for r in csv.DictReader(open(f))}
    p, d = rows.get("plain"), rows.get("dflash")
    for r in rows.values():
        print("RUN", f.split("/")[-1], r["mode"], round(float(r["output_tokens_per_s"])), "ms/step", round(float(r["ms_per_step"]), 3), "acc", r["mean_acceptance_length"][:5], "ahead", r.get("draft_ahead_used", ""))
    if p and d:
        print("RATIO", f.split("/")[-1], round(float(d["output_tokens_per_s"]) / float(p["output_tokens_per_s"]), 3))
PY
left=$(( ${LIMIT:-560} - ($(date +%s)-T0) ))
t0=$(date +%s)
timeout $(( left > 60 ? left : 60 )) python3 -m pytest -q -rfE -p no:cacheprovider -m "gpu or kernels" tests/test_gpu.py gates/test_exact_gpu.py -k "first_token or ahead or demo or cuda_graphs" > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc=$? t=$(( $(date +%s)-t0 ))"; tail -8 $OUT/gpu-tests.log
