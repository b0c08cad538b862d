#!/bin/bash
# The phase timer's events reused and its phases plain objects: the engine alone on the demo
# pair (c1 and c16, plain and DFlash), the tree before (3114683: the runtime differs only in
# stats.py) against this one, interleaved twice; then the GPU tests of tests/test_gpu.py.
set -u
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p $R
mkdir -p /tmp/before && git archive 3114683 | tar -x -C /tmp/before
A="--model reference_engine/assets/demo/target --draft reference_engine/assets/demo/draft --concurrency 1,16 --num-prompts 32 --commit-strategy per_token --block-size 8 --output-len 128 --repeats 3"
for round in 1 2; do
  (cd /tmp/before && PYTHONPATH=/tmp/before timeout 80 python3 scripts/bench_engine.py $A --out $R/eng-before-$round.csv > $R/eng-before-$round.log 2>&1); echo "before $round rc=$?"
  timeout 80 python3 scripts/bench_engine.py $A --out $R/eng-after-$round.csv > $R/eng-after-$round.log 2>&1; echo "after $round rc=$?"
done
timeout 120 python3 -m pytest -q tests/test_gpu.py > $R/gpu-tests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/gpu-tests.log
python3 - <<'PY'
import csv, glob, os
out = os.environ["OUT"] + "/r"
for f in sorted(glob.glob(out + "/eng-*.csv")):
    for r in csv.DictReader(open(f)):
        print(f"{os.path.basename(f):18s} {r['mode']:7s} c{r['concurrency']:<3s} tok/s {float(r['output_tokens_per_s']):8.0f} ({float(r['output_tokens_per_s_min']):.0f}-{float(r['output_tokens_per_s_max']):.0f}) acc {float(r['mean_acceptance_length']):.2f}")
PY
cd $OUT && tar czf r.tgz r && rm -rf r
