#!/bin/bash
set -u
: "${OUT:?set OUT to the folder the results go to}"
# the server's and the profiler's wheels (.whl), installed beside the tree: the machine has no network
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
R=$OUT/r; mkdir -p $R
mkdir -p /tmp/before && git archive 2eed7ac | tar -x -C /tmp/before
timeout 150 python3 -m pytest -q -x tests/test_gpu.py > $R/gpu-tests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/gpu-tests.log
timeout 150 python3 -m pytest -q -x gates/test_exact_gpu.py -k "cuda_graphs_change_no_bit or (demo_pair and 8-per_token)" > $R/gpu-gates.log 2>&1; echo "gpu gates rc=$?"; tail -3 $R/gpu-gates.log
A="--model reference_engine/assets/demo/target --draft reference_engine/assets/demo/draft --concurrency 1,16 --num-prompts 32 --commit-strategy per_token --block-size 8 --output-len 128 --repeats 3"
(cd /tmp/before && PYTHONPATH=/tmp/before timeout 70 python3 scripts/bench_engine.py $A --out $R/eng-before-1.csv > $R/eng-before-1.log 2>&1); echo "before rc=$?"
timeout 70 python3 scripts/bench_engine.py $A --out $R/eng-after-1.csv > $R/eng-after-1.log 2>&1; echo "after rc=$?"
C16="--concurrency 16 --output-len 128 --repeats 3 --dataset reference_engine/assets/demo/heldout_prompts.jsonl"
(cd /tmp/before && PYTHONPATH=/tmp/site:/tmp/before timeout 90 make bench PYTHON=python3 BENCH_ARGS="$C16" BENCH_OUT=$R/c16-before > $R/c16-before.log 2>&1); echo "bench before rc=$?"
timeout 90 make bench PYTHON=python3 BENCH_ARGS="$C16" BENCH_OUT=$R/c16-after > $R/c16-after.log 2>&1; echo "bench after rc=$?"
python3 - <<'PY'
import csv, glob, os, statistics
out = os.environ["OUT"] + "/r"
for f in sorted(glob.glob(out + "/eng-*.csv")):
    for r in csv.DictReader(open(f)):
        print(f"{os.path.basename(f):18s} {r['mode']:7s} c{r['concurrency']:<3s} tok/s {float(r['output_tokens_per_s']):8.0f} ({float(r['output_tokens_per_s_min']):.0f}-{float(r['output_tokens_per_s_max']):.0f}) acc {float(r['mean_acceptance_length']):.2f}")
for d in sorted(glob.glob(out + "/c16-*/summary.csv")):
    by = {}
    for r in csv.DictReader(open(d)):
        by.setdefault(r["label"], []).append(float(r["output_tokens_per_s"]))
    a, b = by.get("A", []), by.get("B", [])
    if a and b:
        print(f"{os.path.basename(os.path.dirname(d)):12s} plain {statistics.median(a):7.0f} dflash {statistics.median(b):7.0f} ratio {statistics.median(b)/statistics.median(a):.2f} plain {[round(x) for x in a]} dflash {[round(x) for x in b]}")
PY
grep -h "identical" $R/c16-*/report.md
cd $OUT && tar czf r.tgz r && rm -rf r
