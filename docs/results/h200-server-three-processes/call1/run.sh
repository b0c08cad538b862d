#!/bin/bash
# session call 1: GPU tests + demo exact gates on this tree; engine alone and make bench at c16
# with the default 32 prompts and a longer run; py-spy of a DFlash server under steady c16 load.
set -u
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
R=$OUT/r; mkdir -p $R
D=reference_engine/assets/demo
SPY=/tmp/site/bin/py-spy
t0=$(date +%s)
timeout 170 python3 -m pytest -q tests/test_gpu.py > $R/gpu-tests.log 2>&1; echo "gpu tests rc=$? $(tail -1 $R/gpu-tests.log)  t=$(( $(date +%s)-t0 ))"
timeout 200 python3 -m pytest -q gates/test_exact_gpu.py -k demo > $R/gpu-gates.log 2>&1; echo "gpu gates rc=$? $(tail -1 $R/gpu-gates.log)  t=$(( $(date +%s)-t0 ))"
for n in 32 512; do
A="--model $D/target --draft $D/draft --prompts $D/heldout_prompts.jsonl --concurrency 16 --num-prompts $n --commit-strategy per_token --block-size 8 --output-len 128 --repeats 3"
timeout 90 python3 scripts/bench_engine.py $A --out $R/eng-n$n.csv > $R/eng-n$n.log 2>&1; echo "engine n=$n rc=$?  t=$(( $(date +%s)-t0 ))"
done
for n in 32 256; do
C16="--concurrency 16 --output-len 128 --repeats 3 --num-prompts $n --dataset $D/heldout_prompts.jsonl"
timeout 120 make bench PYTHON=python3 BENCH_ARGS="$C16" BENCH_OUT=$R/c16-n$n > $R/c16-n$n.log 2>&1; echo "bench n=$n rc=$?  t=$(( $(date +%s)-t0 ))"
done
python3 -m reference_engine.serve --model $D/target --commit-strategy per_token --max-num-seqs 16 --engine-loop process --dflash-draft-model-path $D/draft --block-size 8 --port 8300 > $R/srv.log 2>&1 &
SP=$!
for i in $(seq 120); do curl -s localhost:8300/health >/dev/null && break; sleep 1; done
timeout 60 python3 -m harness bench --base-url http://127.0.0.1:8300 --concurrency 16 --num-prompts 512 --output-len 128 --dataset $D/heldout_prompts.jsonl --out $R/load-dflash > $R/load.log 2>&1 &
LP=$!
sleep 3
timeout 30 $SPY record --pid $SP --subprocesses --threads -r 500 -d 4 -f raw -o $R/spy-dflash.txt > $R/spy-rec.log 2>&1; echo "spy rc=$?"
wait $LP; kill -TERM $SP; wait $SP
echo "t=$(( $(date +%s)-t0 ))"
python3 - <<'PY'
import csv, glob, os, statistics
out = os.environ["OUT"] + "/r"
for f in sorted(glob.glob(out + "/eng-*.csv")):
    for r in csv.DictReader(open(f)):
        print(f"{os.path.basename(f):12s} {r['mode']:7s} c{r['concurrency']:<3s} tok/s {float(r['output_tokens_per_s']):8.0f} ({float(r['output_tokens_per_s_min']):.0f}-{float(r['output_tokens_per_s_max']):.0f}) acc {float(r['mean_acceptance_length']):.2f} ms/step {float(r['ms_per_step']):.3f} decode {float(r['ms_per_decode_step']):.3f} steps {r['steps']}")
for d in sorted(glob.glob(out + "/c16-*/summary.csv")):
    by = {}
    for r in csv.DictReader(open(d)):
        by.setdefault(r["label"], []).append((float(r["output_tokens_per_s"]), float(r["duration_s"]), float(r["ttft_ms_median"])))
    a, b = by.get("A", []), by.get("B", [])
    if a and b:
        ma, mb = statistics.median(x[0] for x in a), statistics.median(x[0] for x in b)
        print(f"{os.path.basename(os.path.dirname(d)):8s} plain {ma:7.0f} dflash {mb:7.0f} ratio {mb/ma:.2f} plain {[round(x[0]) for x in a]} dflash {[round(x[0]) for x in b]} dur {[round(x[1],2) for x in a]} {[round(x[1],2) for x in b]} ttft {[round(x[2]) for x in a]} {[round(x[2]) for x in b]}")
p = out + "/load-dflash/summary.csv"
if os.path.exists(p):
    for r in csv.DictReader(open(p)):
        print("dflash server under spy tok/s", round(float(r["output_tokens_per_s"])))
PY
grep -h "identical" $R/c16-*/report.md
cd $OUT && tar czf r.tgz r && rm -rf r
