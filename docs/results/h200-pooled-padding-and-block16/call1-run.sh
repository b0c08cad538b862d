#!/bin/bash
# the GPU gates not yet run on this tree: captured prefill padding on a pooled cache (new),
# the long-context gate, the DFlash2 real-shape gates; then the rest of the GPU tier
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r
git rev-parse --short HEAD > $OUT/r/tree.txt 2>/dev/null
timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider --durations=10 -m "gpu or kernels" gates/test_exact_gpu.py -k "pooled or padding" 2>&1 | tee $OUT/r/padding.log | tail -8
timeout 360 python3 -m pytest -q -rfE -p no:cacheprovider --durations=10 -m "gpu or kernels" gates/test_exact_gpu_long.py gates/test_exact_gpu_dflash2.py 2>&1 | tee $OUT/r/long-dflash2.log | tail -12
