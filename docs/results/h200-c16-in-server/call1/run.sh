#!/bin/bash
# (as kept here: the summary scripts are read from their folders in docs/results; the call ran copies of them)
# call 1: GPU tier subset on this tree; engine alone c16; then py-spy + /metrics of a process-mode server under c16 load
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
t0=$(date +%s)
D=reference_engine/assets/demo
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; python3 -c "import torch,triton;print(torch.__version__,triton.__version__)" >> $R/gpu.txt; nproc >> $R/gpu.txt
timeout 260 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu.py "gates/test_exact_gpu.py" -k "demo or not exact_gpu" > $R/tier.log 2>&1; echo "tier rc=$? t=$(( $(date +%s)-t0 ))"; tail -3 $R/tier.log
timeout 100 python3 -m pytest -q -rfE -p no:cacheprovider -m "gpu or kernels" tests/test_kernels.py -k "gated_delta or delta" > $R/kernels.log 2>&1; echo "kernels rc=$? t=$(( $(date +%s)-t0 ))"; tail -2 $R/kernels.log
timeout 90 python3 -m reference_engine.bench --model $D/target --draft $D/draft --prompts $D/heldout_prompts.jsonl --concurrency 16 --num-prompts 64 --output-len 128 --commit-strategy per_token --block-size 8 --repeats 3 --out $R/engine-c16 > $R/engine-c16.log 2>&1; echo "engine rc=$? t=$(( $(date +%s)-t0 ))"; tail -8 $R/engine-c16.log
SPY=/tmp/site/bin/py-spy
for side in plain dflash; do
  extra=""; [ $side = dflash ] && extra="--dflash-draft-model-path $D/draft --block-size 8"
  python3 -m reference_engine.serve --model $D/target --device cuda --commit-strategy per_token --max-num-seqs 16 --engine-loop process $extra --port 8300 > $R/spy-server-$side.log 2>&1 &
  SP=$!
  for i in $(seq 120); do curl -s localhost:8300/health >/dev/null && break; sleep 1; done
  timeout 60 python3 -m harness bench --base-url http://127.0.0.1:8300 --concurrency 16 --num-prompts 64 --output-len 128 --dataset $D/heldout_prompts.jsonl --out $R/warm-$side > /dev/null 2>&1
  curl -s localhost:8300/metrics > $R/metrics-before-$side.txt
  timeout 60 python3 -m harness bench --base-url http://127.0.0.1:8300 --concurrency 16 --num-prompts 768 --output-len 128 --dataset $D/heldout_prompts.jsonl --out $R/spy-load-$side > $R/spy-load-$side.log 2>&1 &
  LP=$!
  sleep 1.5
  (for i in $(seq 60); do curl -s localhost:8300/metrics | grep '^dflash:num_requests_running'; sleep 0.04; done > $R/running-$side.txt) &
  timeout 30 $SPY record --pid $SP --subprocesses --threads --idle -r 400 -d 3 -f raw -o $R/spy-$side.txt > $R/spy-rec-$side.log 2>&1; echo "spy $side rc=$? t=$(( $(date +%s)-t0 ))"
  wait $LP; curl -s localhost:8300/metrics > $R/metrics-after-$side.txt; kill -TERM $SP; wait $SP
done
python3 docs/results/h200-engine-process/call2/spy_summary.py $R/spy-plain.txt $R/spy-dflash.txt > $R/spy-summary.txt 2>&1
python3 docs/results/h200-c16-in-server/call1/summ.py $R
cd $OUT && tar czf r.tgz r && rm -rf r
