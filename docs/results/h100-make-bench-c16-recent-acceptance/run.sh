#!/bin/bash
# 1) make bench c16 (256 prompts, 3 repeats): this tree (after) against 6d1c47d (before), alternating;
# 2) if time is left: line-level py-spy of a DFlash server under c16 load (both processes)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
t0=$(date +%s)
D=reference_engine/assets/demo
summ() {
  python3 - $1 <<'PY'
import csv, statistics, sys
by = {}
for r in csv.DictReader(open(sys.argv[1] + "/summary.csv")):
    by.setdefault((r["label"], r["concurrency"]), []).append(r)
m = lambda rows, k: statistics.median(float(r[k]) for r in rows if r.get(k))
for c in sorted({c for _, c in by}, key=int):
    a, b = by[("A", c)], by[("B", c)]
    print("BENCH", sys.argv[1].split("/")[-1], "c", c, "ratio", round(m(b, "output_tokens_per_s") / m(a, "output_tokens_per_s"), 3),
          "plain", [round(float(r["output_tokens_per_s"])) for r in a], "dflash", [round(float(r["output_tokens_per_s"])) for r in b],
          "acc", round(m(b, "acceptance_length"), 2))
PY
  grep -h "identical" $1/report.md | head -1
}
BT=/tmp/before; mkdir -p $BT && tar xzf .prof/dev/before.tgz -C $BT && ln -s $PWD/reference_engine/assets $BT/reference_engine/assets
for run in after-1 before-1 after-2 before-2; do
  dir=$PWD; [ ${run%-*} = before ] && dir=$BT
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 110 make bench PYTHON=python3 BENCH_ARGS="--concurrency 16 --output-len 128 --repeats 3 --num-prompts 256 --dataset $D/heldout_prompts.jsonl" BENCH_OUT=$R/$run > $R/$run.log 2>&1)
  echo "$run rc=$? t=$(( $(date +%s)-t0 ))"; summ $R/$run
done
if [ $(( $(date +%s)-t0 )) -lt 330 ]; then
  SPY=/tmp/site/bin/py-spy
  python3 -m reference_engine.serve --model $D/target --commit-strategy per_token --max-num-seqs 16 --engine-loop process --dflash-draft-model-path $D/draft --block-size 8 --port 8300 > $R/srv-dflash.log 2>&1 &
  SP=$!
  for i in $(seq 120); do curl -s localhost:8300/health >/dev/null && break; sleep 1; done
  timeout 30 python3 -m harness bench --base-url http://127.0.0.1:8300 --concurrency 16 --num-prompts 1024 --output-len 128 --dataset $D/heldout_prompts.jsonl --out $R/load-dflash > $R/load-dflash.log 2>&1 &
  LP=$!
  sleep 4
  timeout 20 $SPY record --pid $SP --subprocesses --threads -r 500 -d 5 -f raw -o $R/spy-dflash.txt > $R/spy-rec-dflash.log 2>&1; echo "spy rc=$? t=$(( $(date +%s)-t0 ))"
  wait $LP; kill -TERM $SP; wait $SP
fi
cd $OUT && tar czf r.tgz r && rm -rf r
