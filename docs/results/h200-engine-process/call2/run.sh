#!/bin/bash
# 1) make bench c16: the previous tree (engine thread) against this tree on a thread and in a
#    process, one after another, twice; 2) py-spy of a process-mode server (both processes)
#    under c16 load, plain and DFlash.
set -u
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p $R
C16="--concurrency 16 --output-len 128 --repeats 3 --dataset reference_engine/assets/demo/heldout_prompts.jsonl"
mkdir -p /tmp/before && git archive 3114683 | tar -x -C /tmp/before
git rev-parse --short HEAD > $R/tree.txt
for round in 1 2; do
  (cd /tmp/before && PYTHONPATH=/tmp/site:/tmp/before timeout 100 make bench PYTHON=python3 BENCH_ARGS="$C16" BENCH_OUT=$R/c16-before-$round > $R/c16-before-$round.log 2>&1); echo "before $round rc=$?"
  for loop in thread process; do
    timeout 100 make bench PYTHON=python3 BENCH_ENGINE_LOOP=$loop BENCH_ARGS="$C16" BENCH_OUT=$R/c16-$loop-$round > $R/c16-$loop-$round.log 2>&1; echo "$loop $round rc=$?"
  done
done
SPY=/tmp/site/bin/py-spy; ls $SPY >/dev/null || SPY=$(python3 -c "import sys;print(sys.prefix)")/bin/py-spy
D=reference_engine/assets/demo
for side in plain dflash; do
  extra=""; [ $side = dflash ] && extra="--dflash-draft-model-path $D/draft --block-size 8"
  python3 -m reference_engine.serve --model $D/target --commit-strategy per_token --max-num-seqs 16 --engine-loop process $extra --port 8300 > $R/spy-server-$side.log 2>&1 &
  SP=$!
  for i in $(seq 120); do curl -s localhost:8300/health >/dev/null && break; sleep 1; done
  timeout 60 python3 -m harness bench --base-url http://127.0.0.1:8300 --concurrency 16 --num-prompts 1024 --output-len 128 --dataset $D/heldout_prompts.jsonl --out $R/spy-load-$side > $R/spy-load-$side.log 2>&1 &
  LP=$!
  sleep 3
  timeout 30 $SPY record --pid $SP --subprocesses --threads --idle -r 400 -d 5 -f raw -o $R/spy-$side.txt > $R/spy-rec-$side.log 2>&1; echo "spy $side rc=$?"
  wait $LP; kill -TERM $SP; wait $SP
done
python3 .prof/spy_summary.py $R/spy-plain.txt $R/spy-dflash.txt > $R/spy-summary.txt 2>&1
python3 - <<'PY'
import csv, glob, os, statistics
out = os.environ["OUT"] + "/r"
for d in sorted(glob.glob(out + "/c16-*/summary.csv")):
    by = {}
    for r in csv.DictReader(open(d)):
        by.setdefault(r["label"], []).append(float(r["output_tokens_per_s"]))
    a, b = by.get("A", []), by.get("B", [])
    if a and b:
        print(f"{os.path.basename(os.path.dirname(d)):18s} plain {statistics.median(a):7.0f} dflash {statistics.median(b):7.0f} ratio {statistics.median(b)/statistics.median(a):.2f} plain {[round(x) for x in a]} dflash {[round(x) for x in b]}")
for side in ("plain", "dflash"):
    p = f"{out}/spy-load-{side}/summary.csv"
    if os.path.exists(p):
        rows = list(csv.DictReader(open(p)))
        print(side, "load tok/s", [round(float(r["output_tokens_per_s"])) for r in rows])
PY
head -120 $R/spy-summary.txt
cd $OUT && tar czf r.tgz r && rm -rf r
