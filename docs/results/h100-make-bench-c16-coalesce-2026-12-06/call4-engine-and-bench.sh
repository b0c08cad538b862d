#!/bin/bash
# 1) the engine alone at c16 on the demo pair (no HTTP: the ceiling of make bench's ratio),
# plain and DFlash, 3 repeats of 512 prompts; 2) make bench c16, this tree (after) against
# prev.tgz (before), alternating, as many runs as the time allows
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/sum
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
t0=$(date +%s)
D=reference_engine/assets/demo
timeout 150 python3 scripts/bench_engine.py --concurrency 16 --block-size 8 --commit-strategy per_token --num-prompts 512 --output-len 128 --repeats 3 --out $OUT/engine-c16.csv > $OUT/engine-c16.log 2>&1
echo "engine rc=$? t=$(( $(date +%s)-t0 ))"
python3 - $OUT/engine-c16.csv <<'PY'
import csv, sys
rows = {r["mode"]: r for r in csv.DictReader(open(sys.argv[1]))}
for mode, r in rows.items():
    print("ENGINE", mode, "tok/s", round(float(r["output_tokens_per_s"])), "[", round(float(r["output_tokens_per_s_min"])), round(float(r["output_tokens_per_s_max"])), "] ms/step", round(float(r["ms_per_step"]), 3), "acc", round(float(r["mean_acceptance_length"]), 2), "widths", r.get("verify_widths", ""))
if {"plain", "dflash"} <= rows.keys():
    print("ENGINE ratio", round(float(rows["dflash"]["output_tokens_per_s"]) / float(rows["plain"]["output_tokens_per_s"]), 3))
PY
RUNS=${RUNS:-"after-1 before-1 after-2 before-2"} GUARD=${GUARD:-300} bash docs/results/h100-make-bench-c16-coalesce-2026-12-06/call1-bench.sh | grep -v "^NVIDIA"
