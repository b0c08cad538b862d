#!/bin/bash
# Line-level py-spy: the engine alone (plain and DFlash, c16) and the process-mode server under
# c16 load (both processes), demo pair on the H200.
set -u
: "${OUT:?set OUT to the folder the results go to}"
# the server's and the profiler's wheels (.whl), installed beside the tree: the machine has no network
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
R=$OUT/r; mkdir -p $R
SPY=/tmp/site/bin/py-spy
D=reference_engine/assets/demo
A="--model $D/target --draft $D/draft --prompts $D/heldout_prompts.jsonl --concurrency 16 --num-prompts 512 --commit-strategy per_token --block-size 8 --output-len 128 --repeats 3"
for m in plain dflash; do
  timeout 150 $SPY record -r 1000 -f raw -o $R/eng-$m.txt -- python3 scripts/bench_engine.py $A --modes $m --out $R/eng-$m.csv > $R/eng-$m.log 2>&1; echo "engine $m rc=$?"
done
for side in plain dflash; do
  extra=""; [ $side = dflash ] && extra="--dflash-draft-model-path $D/draft --block-size 8"
  python3 -m reference_engine.serve --model $D/target --commit-strategy per_token --max-num-seqs 16 --engine-loop process $extra --port 8300 > $R/srv-$side.log 2>&1 &
  SP=$!
  for i in $(seq 120); do curl -s localhost:8300/health >/dev/null && break; sleep 1; done
  timeout 60 python3 -m harness bench --base-url http://127.0.0.1:8300 --concurrency 16 --num-prompts 1024 --output-len 128 --dataset $D/heldout_prompts.jsonl --out $R/load-$side > $R/load-$side.log 2>&1 &
  LP=$!
  sleep 3
  timeout 30 $SPY record --pid $SP --subprocesses --threads -r 1000 -d 5 -f raw -o $R/spy-$side.txt > $R/spy-rec-$side.log 2>&1; echo "spy $side rc=$?"
  wait $LP; kill -TERM $SP; wait $SP
done
python3 - <<'PY'
import csv, glob, os
out = os.environ["OUT"] + "/r"
for f in sorted(glob.glob(out + "/eng-*.csv")):
    for r in csv.DictReader(open(f)):
        print(f"{os.path.basename(f):14s} {r['mode']:7s} c{r['concurrency']:<3s} tok/s {float(r['output_tokens_per_s']):8.0f} acc {float(r['mean_acceptance_length']):.2f}")
for side in ("plain", "dflash"):
    p = f"{out}/load-{side}/summary.csv"
    if os.path.exists(p):
        for r in csv.DictReader(open(p)):
            print(side, "server tok/s", round(float(r["output_tokens_per_s"])), "ttft", round(float(r["ttft_ms_median"]), 1), "tpot", round(float(r["tpot_ms_median"]), 3))
PY
cd $OUT && tar czf r.tgz r && rm -rf r
