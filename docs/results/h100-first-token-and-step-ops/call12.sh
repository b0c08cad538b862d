#!/bin/bash
# 1) GPU tests of the graph paths; 2) to_device microbenchmark; 3) engine-only demo c16 A/B
# against base.tgz (1e444d0), alternating, three each
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
t0=$(date +%s)
timeout 250 python3 -m pytest -q -rfE -p no:cacheprovider --durations=10 -m "gpu" tests/test_gpu.py gates/test_exact_gpu.py -k "demo or test_gpu" > $R/gpu-tests.log 2>&1
echo "gpu tests rc=$? t=$(( $(date +%s)-t0 ))"; tail -3 $R/gpu-tests.log; grep -E "FAILED|ERROR" $R/gpu-tests.log | head
timeout 60 python3 docs/results/h100-first-token-and-step-ops/stagebench.py > $R/stage.log 2>&1; echo "stage rc=$?"; cat $R/stage.log | tail -3
BT=/tmp/base; mkdir -p $BT && tar xzf base.tgz -C $BT && ln -s $PWD/reference_engine/assets $BT/reference_engine/assets
for run in before-1 after-1 before-2 after-2 before-3 after-3; do
  [ $(( $(date +%s)-t0 )) -gt 520 ] && break
  dir=$PWD; [ ${run%-*} = before ] && dir=$BT
  (cd $dir && NOPROF=1 PYTHONPATH=/tmp/site:$dir timeout 70 python3 $OLDPWD/docs/results/h100-first-token-and-step-ops/hostprof.py 256 $R > $R/eng-$run.log 2>&1)
  echo "$run rc=$? t=$(( $(date +%s)-t0 ))"; grep -h "ENGINE" $R/eng-$run.log
done
for f in $R/eng-*.log; do echo $f; grep -h "phases host" $f; done
cd $OUT && tar czf r.tgz r && rm -rf r
