#!/bin/bash
# call 3: the GPU gates (exact bf16 gates of the real shapes, long context, DFlash2, graphs) on this tree
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r
git rev-parse --short HEAD > $OUT/r/tree.txt 2>/dev/null
set -o pipefail
timeout 230 python3 -m pytest -q -rfE -p no:cacheprovider --durations=15 -m "gpu or kernels" gates/test_exact_gpu.py gates/test_exact_gpu_long.py -k "real_shapes_dflash_equals or long_context" 2>&1 | tee $OUT/r/gates.log | tail -40
echo "rc=$?"
