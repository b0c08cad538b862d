#!/bin/bash
# the last-layer feature on CUDA (graphs against eager), the GPU engine tests and the demo gates;
# then, on an H200 only, make bench c16 with turns of four against one
set -u
export T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/t; mkdir -p $R
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
git log --oneline -1 > $R/tree.txt 2>/dev/null
case "$name" in
  *H200*)
    timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/test_gpu.py -k last_layer > $R/gpu-tests.log 2>&1
    echo "gpu tests rc=$? t=$(( $(date +%s)-T0 ))"
    RUNS="warm-1 spt4-1 spt1-1 spt4-2 spt1-2 spt4-3 spt1-3" GUARD=${GUARD:-330} NP=512 bash .prof/dev/spt.sh > $OUT/bench.txt 2>&1
    grep -E "BENCH|POOLED|rc=|identical" $OUT/bench.txt | tail -24;;
  *)
    timeout 110 python3 -m pytest -q -rfE -p no:cacheprovider --durations=10 -m gpu tests/test_gpu.py -k "last_layer or batched" > $R/gpu-tests.log 2>&1
    echo "gpu tests rc=$? t=$(( $(date +%s)-T0 ))"
    timeout 100 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu gates/test_exact_gpu.py -k "demo and not replay" > $R/demo-gates.log 2>&1
    echo "demo gates rc=$? t=$(( $(date +%s)-T0 ))";;
esac
for f in $R/*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" $f | tail -8; done
