#!/bin/bash
# py-spy of the engine alone at c16 (DFlash only) at --steps-per-turn 4 and 1
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .prof/dev/spy/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
SPY=/tmp/site/bin/py-spy; [ -x $SPY ] || SPY=$(find /tmp/site -name py-spy -type f | head -1)
nvidia-smi --query-gpu=name --format=csv,noheader
A="--concurrency 16 --block-size 8 --commit-strategy per_token --output-len 128 --num-prompts 512 --repeats 3 --modes dflash"
for spt in ${SPTS:-4 1}; do
  t0=$(date +%s)
  timeout 200 $SPY record --rate 1000 --format raw --output /tmp/spt$spt.raw -- python3 scripts/bench_engine.py $A --steps-per-turn $spt --out /tmp/spt$spt.csv > /tmp/spt$spt.log 2>&1
  echo "spt$spt rc=$? t=$(( $(date +%s)-t0 ))"
  grep "Engine.step (" /tmp/spt$spt.raw > /tmp/f$spt.raw; python3 .prof/dev/rawtop.py /tmp/f$spt.raw 100 > $OUT/top-spt$spt.txt; head -3 /tmp/spt$spt.raw | cut -c1-300
  python3 -c "
import csv
for r in csv.DictReader(open('/tmp/spt$spt.csv')): print('spt$spt', r['mode'], round(float(r['output_tokens_per_s'])), 'steps', r['steps'], 'ms/step', r['ms_per_step'])
"
done
