#!/bin/bash
# 1) the changed kernels compiled (argmax NaN, matmul bias) with the new contract tests; 2) the long-context and real-shape exact gates
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; cat $R/gpu.txt
t0=$(date +%s)
timeout 90 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_kernels_runtime_contracts.py tests/test_kernels.py -k "greedy or argmax or matmul or nan or bias" > $R/kernels.log 2>&1
echo "kernels rc=$? t=$(( $(date +%s)-t0 ))"; tail -2 $R/kernels.log; grep -E "FAILED|ERROR" $R/kernels.log | head
left=$(( ${TOTAL:-300} - ($(date +%s)-t0) ))
timeout $left python3 -m pytest -q -rfEs -p no:cacheprovider --durations=12 -m gpu gates/test_exact_gpu_long.py gates/test_exact_gpu.py > $R/gates.log 2>&1
echo "gates rc=$? t=$(( $(date +%s)-t0 ))"; tail -3 $R/gates.log; grep -E "FAILED|ERROR" $R/gates.log | head
grep -E "passed|failed" $R/kernels.log $R/gates.log | tail -3
