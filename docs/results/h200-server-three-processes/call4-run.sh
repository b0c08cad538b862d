#!/bin/bash
set -u
export PYTHONPATH=/tmp/site:$PWD
[ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
[ -d /tmp/before ] || { mkdir -p /tmp/before && git archive ab1973e | tar -x -C /tmp/before; }
R=$OUT/r; mkdir -p $R
export UTIL_N=384
timeout 100 python3 docs/results/h200-server-three-processes/util.py /tmp/before before dflash $R 2>&1 | grep -v "^server"
timeout 100 python3 docs/results/h200-server-three-processes/util.py $PWD after dflash $R 2>&1 | grep -v "^server"
D=reference_engine/assets/demo
A="--model $D/target --draft $D/draft --prompts $D/heldout_prompts.jsonl --concurrency 16 --num-prompts 512 --commit-strategy per_token --block-size 8 --output-len 128 --repeats 3"
timeout 60 python3 scripts/bench_engine.py $A --out $R/eng-after.csv > /dev/null 2>&1
python3 -c "
import csv
for r in csv.DictReader(open('$R/eng-after.csv')): print('engine after', r['mode'], round(float(r['output_tokens_per_s'])), r['output_tokens_per_s_min'][:6], r['output_tokens_per_s_max'][:6], 'ms/step', r['ms_per_step'][:5])
"
