#!/bin/bash
# 1) GPU tests of the graph paths (first tokens left on the device); 2) engine-only demo c16 A/B
# against base.tgz (1e444d0), alternating; 3) py-spy of this tree's DFlash engine loop
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
t0=$(date +%s)
timeout 230 python3 -m pytest -q -rfE -p no:cacheprovider --durations=10 -m "gpu" tests/test_gpu.py gates/test_exact_gpu.py -k "demo or test_gpu" > $R/gpu-tests.log 2>&1
echo "gpu tests rc=$? t=$(( $(date +%s)-t0 ))"; tail -3 $R/gpu-tests.log
BT=/tmp/base; mkdir -p $BT && tar xzf base.tgz -C $BT && ln -s $PWD/reference_engine/assets $BT/reference_engine/assets
for run in before-1 after-1 before-2 after-2; do
  dir=$PWD; [ ${run%-*} = before ] && dir=$BT
  (cd $dir && NOPROF=1 PYTHONPATH=/tmp/site:$dir timeout 80 python3 $OLDPWD/docs/results/h100-first-token-and-step-ops/hostprof.py 256 $R > $R/eng-$run.log 2>&1)
  echo "$run rc=$? t=$(( $(date +%s)-t0 ))"; grep -h "ENGINE" $R/eng-$run.log
done
if [ $(( $(date +%s)-t0 )) -lt 480 ]; then
  SPY=/tmp/site/bin/py-spy
  python3 docs/results/h100-first-token-and-step-ops/hostprof.py 256 /tmp dflash 40 > $R/spy-loop.log 2>&1 &
  LP=$!
  sleep 25
  timeout 20 $SPY record --pid $LP --nonblocking -r 250 -d 8 -f raw -o $R/spy-eng-dflash.txt > $R/spy-rec.log 2>&1; echo "spy rc=$? t=$(( $(date +%s)-t0 ))"
  kill $LP; wait $LP
  python3 docs/results/h100-first-token-and-step-ops/lines.py $R/spy-eng-dflash.txt "" > $R/spy-eng-dflash-lines.txt 2>&1
fi
for f in $R/eng-*.log; do echo $f; grep -h "phases host" $f; done
cd $OUT && tar czf r.tgz r && rm -rf r
