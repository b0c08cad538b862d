#!/bin/bash
# The final tree on the H200: the GPU tier's engine tests and exact gates, the HTTP gate on the
# demo pair (its servers with the engine in a process of their own, the GPU's default), the
# engine-loop gate, then make bench (c1-c16) with the engine in a process and on a thread.
set -u
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/tree.txt; git status --short >> $R/tree.txt
timeout 170 python3 -m pytest -q -m gpu gates/test_exact_gpu.py tests/test_gpu.py -k "demo_pair or test_gpu" > $R/gpu-tests.log 2>&1; echo "gpu tests rc=$?"; tail -2 $R/gpu-tests.log
timeout 120 python3 -m pytest -q gates/test_http_equivalence.py -k "demo or in_a_process" gates/test_engine_loop.py > $R/http-gate.log 2>&1; echo "http gate rc=$?"; tail -2 $R/http-gate.log
for loop in process thread; do
  timeout 140 make bench PYTHON=python3 BENCH_ENGINE_LOOP=$loop BENCH_OUT=$R/full-$loop > $R/full-$loop.log 2>&1; echo "full $loop rc=$?"
done
python3 - <<'PY'
import csv, glob, os, statistics
out = os.environ["OUT"] + "/r"
for d in sorted(glob.glob(out + "/full-*/summary.csv")):
    by = {}
    for r in csv.DictReader(open(d)):
        by.setdefault((int(r["concurrency"]), r["label"]), []).append(float(r["output_tokens_per_s"]))
    for c in sorted({k[0] for k in by}):
        a, b = by.get((c, "A"), []), by.get((c, "B"), [])
        if a and b:
            print(f"{os.path.basename(os.path.dirname(d)):14s} c{c:<3d} plain {statistics.median(a):7.0f} dflash {statistics.median(b):7.0f} ratio {statistics.median(b)/statistics.median(a):.2f} plain {[round(x) for x in a]} dflash {[round(x) for x in b]}")
PY
grep -h "identical" $R/full-*/report.md
cd $OUT && tar czf r.tgz r && rm -rf r
