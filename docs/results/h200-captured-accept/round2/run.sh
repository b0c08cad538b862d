#!/bin/bash
# The GPU tests and the demo pair's exact gates on this tree, then a second round of the
# engine alone, the tree before (2eed7ac) against this one.
set -u
: "${OUT:?set OUT to the folder the results go to}"
# the server's and the profiler's wheels (.whl), installed beside the tree: the machine has no network
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R
mkdir -p /tmp/before && git archive 2eed7ac | tar -x -C /tmp/before
timeout 110 python3 -m pytest -q tests/test_gpu.py > $R/gpu-tests.log 2>&1; echo "gpu tests rc=$?"; tail -2 $R/gpu-tests.log
timeout 150 python3 -m pytest -q gates/test_exact_gpu.py -k "demo" > $R/gpu-gates.log 2>&1; echo "gpu gates rc=$?"; tail -2 $R/gpu-gates.log
A="--model reference_engine/assets/demo/target --draft reference_engine/assets/demo/draft --concurrency 1,16 --num-prompts 32 --commit-strategy per_token --block-size 8 --output-len 128 --repeats 3"
timeout 45 python3 scripts/bench_engine.py $A --out $R/eng-after-2.csv > $R/eng-after-2.log 2>&1; echo "after rc=$?"
(cd /tmp/before && PYTHONPATH=/tmp/before timeout 45 python3 scripts/bench_engine.py $A --out $R/eng-before-2.csv > $R/eng-before-2.log 2>&1); echo "before rc=$?"
python3 - <<'PY'
import csv, glob, os
out = os.environ["OUT"] + "/r"
for f in sorted(glob.glob(out + "/eng-*.csv")):
    for r in csv.DictReader(open(f)):
        print(f"{os.path.basename(f):18s} {r['mode']:7s} c{r['concurrency']:<3s} tok/s {float(r['output_tokens_per_s']):8.0f} ({float(r['output_tokens_per_s_min']):.0f}-{float(r['output_tokens_per_s_max']):.0f}) acc {float(r['mean_acceptance_length']):.2f}")
PY
cd $OUT && tar czf r.tgz r && rm -rf r
