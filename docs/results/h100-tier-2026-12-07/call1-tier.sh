#!/bin/bash
# the GPU tier on this tree: kernels (3 workers) beside gates + test_gpu
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $R/gpu.txt
t0=$(date +%s)
timeout 530 python3 -m pytest -q -rfE -p no:cacheprovider -n 3 --durations=10 -m "gpu or kernels" \
  tests/test_kernels.py tests/test_kernels_gpu.py tests/test_kernels_moe.py tests/test_kernels_compile.py \
  tests/test_kernels_attention_delta_contracts.py tests/test_kernels_runtime_contracts.py \
  tests/test_fused_projections.py tests/test_commit_checkpoints.py tests/test_hardening_rows_table_service.py \
  > $R/kernels.log 2>&1 &
timeout 530 python3 -m pytest -q -rfE -p no:cacheprovider --durations=25 -m "gpu or kernels" \
  gates/test_exact_gpu_long.py gates/test_exact_gpu.py tests/test_gpu.py gates/test_exact_gpu_dflash2.py \
  > $R/tier.log 2>&1 &
wait
echo "t=$(( $(date +%s)-t0 ))"
for f in kernels tier; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" $R/$f.log | tail -15; done
