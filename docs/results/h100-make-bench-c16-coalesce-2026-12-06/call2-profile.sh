#!/bin/bash
# py-spy of the DFlash and plain servers' engine and HTTP processes under c16 load (10 s at 500 Hz each)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .prof/dev/spy/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
SPY=/tmp/site/bin/py-spy; ls -la $SPY || SPY=$(find /tmp/site -name py-spy -type f | head -1)
R=/tmp/p; mkdir -p $R $OUT/prof
nvidia-smi --query-gpu=name --format=csv,noheader
D=reference_engine/assets/demo
prof() {  # name, extra serve args
  name=$1; shift
  port=$((19000 + RANDOM % 500))
  python3 -m reference_engine.serve --model $D/target --commit-strategy per_token --device cuda --max-num-seqs 16 "$@" --port $port > $R/$name-server.log 2>&1 &
  spid=$!
  for i in $(seq 150); do curl -s localhost:$port/v1/models > /dev/null && break; sleep 1; done
  python3 -m harness bench --base-url http://localhost:$port --concurrency 16 --output-len 128 --num-prompts 256 --warmup 16 --dataset $D/heldout_prompts.jsonl --out $R/$name-warm > $R/$name-warm.log 2>&1
  ps -o pid,ppid,pcpu,rss,cmd --ppid $spid > $R/$name-ps.txt; ps -o pid,pcpu,cmd -p $spid >> $R/$name-ps.txt
  epid=$(ps -o pid=,cmd= --ppid $spid | grep -v resource_tracker | awk '{print $1}' | head -1)
  echo "$name serve $spid engine $epid"
  python3 -m harness bench --base-url http://localhost:$port --concurrency 16 --output-len 128 --num-prompts 3072 --warmup 0 --dataset $D/heldout_prompts.jsonl --out $R/$name-bench > $R/$name-bench.log 2>&1 &
  bpid=$!
  sleep 1
  $SPY record --rate 500 --pid $epid --format raw --output $R/$name-engine.raw --duration 10 > $R/$name-spy-e.log 2>&1 &
  p1=$!
  $SPY record --rate 500 --pid $spid --format raw --output $R/$name-http.raw --duration 10 > $R/$name-spy-h.log 2>&1 &
  p2=$!
  wait $p1 $p2; tail -2 $R/$name-spy-e.log
  wait $bpid; tail -3 $R/$name-bench.log | cut -c1-200
  curl -s localhost:$port/metrics > $R/$name-metrics.txt
  kill $spid; wait $spid 2>/dev/null
}
prof dflash --dflash-draft-model-path $D/draft --block-size 8
prof plain

for f in $R/*.raw; do python3 docs/results/h100-make-bench-c16-coalesce-2026-12-06/rawtop.py $f 70 > $OUT/prof/$(basename $f .raw)-top.txt; done; cp $R/*-ps.txt $OUT/prof/

