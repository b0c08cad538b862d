#!/bin/bash
# the gated-delta inputs' softplus compiled (kernel tests, the demo pair's bf16 exact gates);
# then, on an H200, make bench c16 with turns of four against one; elsewhere the Qwen3.5 real-shape gate
set -u
export T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/t; mkdir -p $R
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $R/gpu.txt
git log --oneline -1 > $R/tree.txt 2>/dev/null
timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider -m "kernels or gpu" \
  tests/test_kernels.py tests/test_hardening_kernels.py -k "gated_delta or hardening_kernels" > $R/kernels.log 2>&1
echo "kernels rc=$? t=$(( $(date +%s)-T0 ))"
timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu gates/test_exact_gpu.py -k "demo and not replay" > $R/demo-gates.log 2>&1
echo "demo gates rc=$? t=$(( $(date +%s)-T0 ))"
case "$name" in
  *H200*)
    RUNS="spt4-1 spt1-1 spt4-2 spt1-2 spt4-3 spt1-3" GUARD=${GUARD:-470} NP=512 bash .prof/dev/spt.sh > $OUT/bench.txt 2>&1
    grep -E "BENCH|POOLED|rc=|identical" $OUT/bench.txt | tail -24;;
  *)
    DFLASH_GATE_SHAPES=qwen3.5-4b timeout 240 python3 -m pytest -q -rfE -p no:cacheprovider --durations=5 -m gpu gates/test_exact_gpu.py -k "real_shape" > $R/shape-gate.log 2>&1
    echo "shape gate rc=$? t=$(( $(date +%s)-T0 ))";;
esac
for f in $R/*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" $f | tail -8; done
