#!/bin/bash
# the GPU tier after the greedy change, and the Triton greedy on non-finite rows
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 | tee $OUT/tree.txt
python3 - <<'PY' 2>&1 | tee $OUT/greedy-check.log
import torch
from reference_engine.kernels import argmax, reference as ref
g = torch.Generator(device="cuda").manual_seed(0)
for V in (151936, 248320, 512, 2049):
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(8, V, generator=g, device="cuda").to(dtype)
        x[0, 5] = float("inf"); x[1, V - 1] = float("inf"); x[2] = float("-inf")
        x[3, V // 2] = float("nan"); x[4, 1] = float("inf"); x[4, V - 2] = float("nan")
        x[5, : V // 2] = float("-inf")
        got, want = argmax.greedy(x), ref.greedy(x)
        assert torch.equal(got, want), (V, dtype, got.tolist(), want.tolist())
        assert got[:5].tolist() == [V] * 5 and got[5] == x[5].float().argmax(), got.tolist()
print("GREEDY non-finite rows: triton == reference, ok")
PY
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "turn_nan" 2>&1 | tail -3
timeout 450 python3 -m pytest -q -p no:cacheprovider -m "gpu or kernels" tests gates 2>&1 | tee $OUT/gate-gpu.log | tail -15
echo "rc ${PIPESTATUS[0]}"
