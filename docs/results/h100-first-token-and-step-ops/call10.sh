#!/bin/bash
# engine-only demo pair at c16: plain vs DFlash per step, cProfiles, and py-spy of each loop
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
t0=$(date +%s)
timeout 200 python3 docs/results/h100-first-token-and-step-ops/hostprof.py 256 $R plain,dflash > $R/hostprof.log 2>&1; echo "hostprof rc=$? t=$(( $(date +%s)-t0 ))"
SPY=/tmp/site/bin/py-spy
for m in dflash plain; do
  timeout 90 $SPY record -r 1000 -f raw -o $R/spy-eng-$m.txt -- python3 docs/results/h100-first-token-and-step-ops/hostprof.py 256 /tmp $m 12 > $R/spy-eng-$m.log 2>&1; echo "spy $m rc=$? t=$(( $(date +%s)-t0 ))"
  python3 docs/results/h100-first-token-and-step-ops/lines.py $R/spy-eng-$m.txt "" > $R/spy-eng-$m-lines.txt 2>&1
done
grep -h "ENGINE\|phases\|widths" $R/hostprof.log
head -50 $R/spy-eng-dflash-lines.txt
cd $OUT && tar czf r.tgz r && rm -rf r
