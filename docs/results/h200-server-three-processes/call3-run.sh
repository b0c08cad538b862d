#!/bin/bash
# session call 3: GPU tests + demo exact gates on this tree (packed graph inputs); engine alone
# before (ab1973e) / after interleaved; server CPU + TTFT before/after; make bench (default args).
set -u
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
R=$OUT/r; mkdir -p $R
mkdir -p /tmp/before && git archive ab1973e | tar -x -C /tmp/before
D=reference_engine/assets/demo
t0=$(date +%s)
timeout 170 python3 -m pytest -q tests/test_gpu.py > $R/gpu-tests.log 2>&1; echo "gpu tests rc=$? $(tail -1 $R/gpu-tests.log)  t=$(( $(date +%s)-t0 ))"
timeout 200 python3 -m pytest -q gates/test_exact_gpu.py -k demo > $R/gpu-gates.log 2>&1; echo "gpu gates rc=$? $(tail -1 $R/gpu-gates.log)  t=$(( $(date +%s)-t0 ))"
A="--model $D/target --draft $D/draft --prompts $D/heldout_prompts.jsonl --concurrency 16 --num-prompts 512 --commit-strategy per_token --block-size 8 --output-len 128 --repeats 3"
for k in 1 2; do
  (cd /tmp/before && PYTHONPATH=/tmp/before timeout 80 python3 scripts/bench_engine.py $A --out $R/eng-before-$k.csv > $R/eng-before-$k.log 2>&1); echo "eng before $k rc=$?"
  timeout 80 python3 scripts/bench_engine.py $A --out $R/eng-after-$k.csv > $R/eng-after-$k.log 2>&1; echo "eng after $k rc=$? t=$(( $(date +%s)-t0 ))"
done
for m in dflash plain; do
  timeout 150 python3 docs/results/h200-server-three-processes/util.py /tmp/before before $m $R > $R/u-before-$m.txt 2>&1; echo "util before $m rc=$?"
  timeout 150 python3 docs/results/h200-server-three-processes/util.py $PWD after $m $R > $R/u-after-$m.txt 2>&1; echo "util after $m rc=$? t=$(( $(date +%s)-t0 ))"
done
timeout 240 make bench PYTHON=python3 BENCH_OUT=$R/bench-default > $R/bench-default.log 2>&1; echo "make bench rc=$? t=$(( $(date +%s)-t0 ))"
python3 - <<'PY'
import csv, glob, os, statistics
out = os.environ["OUT"] + "/r"
for f in sorted(glob.glob(out + "/eng-*.csv")):
    for r in csv.DictReader(open(f)):
        print(f"{os.path.basename(f):16s} {r['mode']:7s} c{r['concurrency']:<3s} tok/s {float(r['output_tokens_per_s']):8.0f} ({float(r['output_tokens_per_s_min']):.0f}-{float(r['output_tokens_per_s_max']):.0f}) acc {float(r['mean_acceptance_length']):.2f} ms/step {float(r['ms_per_step']):.3f} decode {float(r['ms_per_decode_step']):.3f}")
d = out + "/bench-default/summary.csv"
if os.path.exists(d):
    by = {}
    for r in csv.DictReader(open(d)):
        by.setdefault((r["concurrency"], r["label"]), []).append(float(r["output_tokens_per_s"]))
    for c in sorted({k[0] for k in by}, key=int):
        a, b = by.get((c, "A"), []), by.get((c, "B"), [])
        if a and b:
            print(f"make bench c{c}: plain {statistics.median(a):7.0f} dflash {statistics.median(b):7.0f} ratio {statistics.median(b)/statistics.median(a):.2f}  plain {[round(x) for x in a]} dflash {[round(x) for x in b]}")
PY
grep -h "identical" $R/bench-default/report.md
cat $R/u-*.txt | grep -v "^server"
cd $OUT && tar czf r.tgz r && rm -rf r
