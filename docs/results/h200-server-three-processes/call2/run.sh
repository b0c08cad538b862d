#!/bin/bash
# session call 2: CPU use of client / HTTP process / engine process under c16 load, plain and
# DFlash, the tree before (HEAD ab1973e) and the working tree (metrics settled at render).
set -u
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
R=$OUT/r; mkdir -p $R
mkdir -p /tmp/before && git archive ab1973e | tar -x -C /tmp/before
t0=$(date +%s)
for m in plain dflash; do
  timeout 150 python3 docs/results/h200-server-three-processes/util.py /tmp/before before $m $R > $R/u-before-$m.txt 2>&1; echo "before $m rc=$? t=$(( $(date +%s)-t0 ))"
  timeout 150 python3 docs/results/h200-server-three-processes/util.py $PWD after $m $R > $R/u-after-$m.txt 2>&1; echo "after $m rc=$? t=$(( $(date +%s)-t0 ))"
done
cat $R/u-*.txt | grep -v "^server"
cd $OUT && tar czf r.tgz r && rm -rf r
