#!/bin/bash
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 130 python3 -m pytest -q -rfE -p no:cacheprovider -m "gpu or kernels" tests/test_gpu.py gates/test_exact_gpu.py -k "first_token or ahead or demo or cuda_graphs" > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc=$? t=$(( $(date +%s)-T0 ))"; tail -4 $OUT/gpu-tests.log
A="--concurrency 16 --block-size 8 --commit-strategy per_token --output-len 128 --num-prompts 512 --repeats 3"
for spt in 4 1; do
  left=$(( 290 - ($(date +%s)-T0) )); [ $left -lt 25 ] && break
  timeout $left python3 scripts/bench_engine.py $A --steps-per-turn $spt --out $OUT/spt$spt.csv > /tmp/spt$spt.log 2>&1
  echo "spt$spt rc=$?"
  python3 -c "
import csv
for r in csv.DictReader(open('$OUT/spt$spt.csv')): print('spt$spt', r['mode'], round(float(r['output_tokens_per_s'])), 'steps', r['steps'], 'ms/step', r['ms_per_step'])
" 2>/dev/null
done
