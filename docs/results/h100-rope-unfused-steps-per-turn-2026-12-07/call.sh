#!/bin/bash
# the RoPE kernel without FP fusion (timing against fusion, its compiled tests), then make bench c16
set -u
export T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r5; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
git log --oneline -1 > $R/tree.txt 2>/dev/null
timeout 70 python3 .prof/dev/rope_ab.py > $R/rope_ab.log 2>&1
echo "rope_ab t=$(( $(date +%s)-T0 ))"
timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider -m "gpu or kernels" tests/test_kernels_attention_delta_contracts.py -k "round_each_step or rope or greedy or norm" > $R/contracts.log 2>&1
echo "contracts rc=$? t=$(( $(date +%s)-T0 ))"
RUNS="warm-1 spt4-1 spt1-1 spt4-2 spt1-2 spt4-3 spt1-3" GUARD=480 NP=512 bash .prof/dev/spt.sh > $R/bench.txt 2>&1
grep -E "BENCH|POOLED|rc=|identical" $R/bench.txt | tail -24
tail -6 $R/contracts.log; grep -v -i warn $R/rope_ab.log
