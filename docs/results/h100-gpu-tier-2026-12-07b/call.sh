#!/bin/bash
# H200: make bench c16, turns of four against one; otherwise the GPU tier's leftovers
set -u
export T0=$(date +%s)
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$name"
case "$name" in
  *H200*)
    RUNS="warm-1 spt4-1 spt1-1 spt4-2 spt1-2 spt4-3 spt1-3" GUARD=470 NP=512 bash ../h100-make-bench-c16-steps-per-turn-2026-12-06/call1-bench.sh > $OUT/bench.txt 2>&1
    grep -E "BENCH|POOLED|rc=|identical" $OUT/bench.txt | tail -24;;
  *)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    R=$OUT/r; mkdir -p $R
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
    python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $R/gpu.txt
    git log --oneline -1 > $R/tree.txt 2>/dev/null
    timeout 540 python3 -m pytest -q -rfE -p no:cacheprovider -n 2 --durations=10 -m "gpu or kernels" \
      tests/test_kernels_attention_delta_contracts.py tests/test_kernels_compile.py tests/test_kernels.py \
      > $R/kernels.log 2>&1 &
    timeout 540 python3 -m pytest -q -rfE -p no:cacheprovider --durations=25 -m "gpu or kernels" \
      gates/test_exact_gpu.py gates/test_exact_gpu_dflash2.py gates/test_exact_gpu_long.py \
      > $R/tier.log 2>&1 &
    wait
    echo "t=$(( $(date +%s)-T0 ))"
    for f in kernels tier; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" $R/$f.log | tail -15; done;;
esac
