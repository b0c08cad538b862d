#!/bin/bash
# where a c16 step's time goes on the demo pair: GPU utilisation (nvidia-smi, 50 ms samples) during
# a c16 load, and the phases' device times against their host times (--device-phase-times)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader
D=reference_engine/assets/demo
load() {  # name, extra serve args
  name=$1; shift
  port=$((19000 + RANDOM % 500))
  python3 -m reference_engine.serve --model $D/target --commit-strategy per_token --device cuda --max-num-seqs 16 "$@" --port $port > $R/$name-server.log 2>&1 &
  spid=$!
  for i in $(seq 150); do curl -s localhost:$port/v1/models > /dev/null && break; sleep 1; done
  python3 -m harness bench --base-url http://localhost:$port --concurrency 16 --output-len 128 --num-prompts 256 --warmup 16 --dataset $D/heldout_prompts.jsonl --out $R/$name-warm > $R/$name-warm.log 2>&1
  curl -s localhost:$port/metrics | grep -E "^dflash:phase_seconds_total|^dflash:num_steps|steps_total" > $R/$name-m0.txt
  t1=$(date +%s.%N)
  python3 -m harness bench --base-url http://localhost:$port --concurrency 16 --output-len 128 --num-prompts 1536 --warmup 0 --dataset $D/heldout_prompts.jsonl --out $R/$name-bench > $R/$name-bench.log 2>&1 &
  bpid=$!
  sleep 1
  nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 50 > $R/$name-util.txt &
  upid=$!
  sleep 4; kill $upid
  wait $bpid
  t2=$(date +%s.%N)
  curl -s localhost:$port/metrics | grep -E "^dflash:phase_seconds_total|^dflash:num_steps|steps_total" > $R/$name-m1.txt
  kill $spid; wait $spid 2>/dev/null
  python3 - $R/$name $t1 $t2 <<'PY'
import sys, statistics
base, t1, t2 = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
u = [int(x) for x in open(base + "-util.txt").read().split() if x.strip().isdigit()]
print(base.split("/")[-1], "gpu util % median", statistics.median(u) if u else None, "mean", round(sum(u) / max(len(u), 1), 1), "n", len(u), "bench wall s", round(t2 - t1, 2))
def read(f):
    out = {}
    for line in open(f):
        k, v = line.rsplit(" ", 1); out[k] = float(v)
    return out
a, b = read(base + "-m0.txt"), read(base + "-m1.txt")
for k in sorted(b):
    print("  ", k, round(b[k] - a.get(k, 0.0), 3))
PY
  tail -2 $R/$name-bench.log | cut -c1-160
}
load dflash-dev --dflash-draft-model-path $D/draft --block-size 8 --device-phase-times
load dflash-host --dflash-draft-model-path $D/draft --block-size 8
load plain-dev --device-phase-times
