#!/bin/bash
# timestamps along a request's path to its first token under c16 load (patched copy of the tree)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader
rm -rf /tmp/tp && mkdir /tmp/tp && cp -r reference_engine harness /tmp/tp/ && cd /tmp/tp && python3 $OLDPWD/docs/results/h100-make-bench-c16-wire-2026-12-06/trace_patch.py
export PYTHONPATH=/tmp/site:/tmp/tp PYTHONUNBUFFERED=1
D=reference_engine/assets/demo
run() {
  name=$1; shift
  rm -f /tmp/trace-*.log
  port=$((19000 + RANDOM % 500))
  python3 -m reference_engine.serve --model $D/target --commit-strategy per_token --device cuda --max-num-seqs 16 "$@" --port $port > $R/$name-server.log 2>&1 &
  spid=$!
  for i in $(seq 150); do curl -s localhost:$port/v1/models > /dev/null && break; sleep 1; done
  python3 -m harness bench --base-url http://localhost:$port --concurrency 16 --output-len 128 --num-prompts 512 --warmup 32 --dataset $D/heldout_prompts.jsonl --out $R/$name-bench > $R/$name-bench.log 2>&1
  kill $spid; wait $spid 2>/dev/null
  echo "== $name"; grep -E "^\| *[AB] " $R/$name-bench.log | head -2; tail -3 $R/$name-bench.log | head -1 | cut -c1-150
  python3 $OLDPWD/docs/results/h100-make-bench-c16-wire-2026-12-06/trace_analyse.py
  python3 - $R/$name-bench <<'PY'
import json, statistics as st, sys
rs = [json.loads(l) for l in open(sys.argv[1] + "/requests.jsonl")]
print("client ttft median ms", round(st.median(r["ttft_s"] for r in rs) * 1e3, 2), "e2e median", round(st.median(r["e2e_s"] for r in rs) * 1e3, 2), "n", len(rs))
PY
}
run dflash --dflash-draft-model-path $D/draft --block-size 8
run plain
