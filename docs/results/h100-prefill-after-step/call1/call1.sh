#!/bin/bash
# engine alone c16, then py-spy (line level) of the DFlash engine bench
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .prof/dev/spy/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
SPY=/tmp/site/bin/py-spy; [ -x $SPY ] || SPY=$(find /tmp/site -name py-spy -type f | head -1)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
A="--concurrency 16 --block-size 8 --commit-strategy per_token --output-len 128"
t0=$(date +%s)
timeout 200 python3 scripts/bench_engine.py $A --num-prompts 512 --repeats 3 --out $OUT/engine-c16.csv > $OUT/engine-c16.log 2>&1
echo "engine rc=$? t=$(( $(date +%s)-t0 ))"
grep "measured step ms" $OUT/engine-c16.log | cut -c1-600
python3 - $OUT/engine-c16.csv <<'PY'
import csv, sys
rows = {r["mode"]: r for r in csv.DictReader(open(sys.argv[1]))}
for mode, r in rows.items():
    print("ENGINE", mode, "tok/s", round(float(r["output_tokens_per_s"])), "[", round(float(r["output_tokens_per_s_min"])), round(float(r["output_tokens_per_s_max"])), "] ms/step", round(float(r["ms_per_step"]), 3), "acc", round(float(r["mean_acceptance_length"]), 2))
if {"plain", "dflash"} <= rows.keys():
    print("ENGINE ratio", round(float(rows["dflash"]["output_tokens_per_s"]) / float(rows["plain"]["output_tokens_per_s"]), 3))
PY
timeout 150 python3 scripts/bench_engine.py $A --num-prompts 6000 --repeats 1 --modes dflash --out $OUT/spy.csv > $OUT/spy-bench.log 2>&1 &
bp=$!
for i in $(seq 90); do grep -q "commit) in" $OUT/spy-bench.log 2>/dev/null && break; sleep 1; done
sleep 8
$SPY record --rate 1000 --pid $bp --format raw --output $OUT/dflash-engine.raw --duration 12 > $OUT/spy.log 2>&1
tail -2 $OUT/spy.log
kill $bp 2>/dev/null; wait $bp 2>/dev/null
python3 docs/results/h100-make-bench-c16-coalesce-2026-12-06/rawtop.py $OUT/dflash-engine.raw 70 > $OUT/dflash-engine-top.txt
head -45 $OUT/dflash-engine-top.txt
# nsys: GPU time per phase and kernel time per step, both modes, c16, 128 prompts
export LD_LIBRARY_PATH=$PWD/.nsyslibs:${LD_LIBRARY_PATH:-}
t0=$(date +%s)
timeout 240 bash scripts/profile.sh --out /tmp/nprof --concurrency 16 --block-size 8 --commit-strategy per_token --output-len 128 --num-prompts 128 --repeats 1 > $OUT/nprof.log 2>&1
echo "nsys rc=$? t=$(( $(date +%s)-t0 ))"
mkdir -p $OUT/nprof; cp /tmp/nprof/*.csv /tmp/nprof/*.md /tmp/nprof/*.log $OUT/nprof/ 2>/dev/null
python3 - <<'PY'
import csv, glob
for f in sorted(glob.glob("/tmp/nprof/*cuda_gpu_kern_sum*.csv")):
    rows = list(csv.DictReader(open(f)))
    tot = sum(float(r["Total Time (ns)"]) for r in rows); n = sum(int(r["Instances"]) for r in rows)
    print("KERN", f.split("/")[-1], "total ms", round(tot/1e6, 2), "kernels", n)
    for r in sorted(rows, key=lambda r: -float(r["Total Time (ns)"]))[:8]:
        print("   ", round(float(r["Total Time (ns)"])/1e6, 2), r["Instances"], r["Name"][:90])
for f in sorted(glob.glob("/tmp/nprof/*nvtx_gpu_proj_sum*.csv")):
    print("PROJ", f.split("/")[-1])
    for r in csv.DictReader(open(f)):
        print("   ", {k: r[k] for k in r if k in ("Range", "Projected Duration (ns)", "Total Proj Time (ns)", "Instances", "Total GPU Ops")})
PY
for f in /tmp/nprof/*.csv; do case $f in *_*) ;; *) python3 - $f <<'PY'
import csv, sys
for r in csv.DictReader(open(sys.argv[1])):
    print("NPROF", r["mode"], "steps", r["steps"], "ms_step", round(float(r["ms_step"]), 1), "per step", round(float(r["ms_per_step"]), 3))
PY
;; esac; done
