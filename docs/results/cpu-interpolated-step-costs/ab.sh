#!/bin/bash
# interleaved engine A/B: the old tree (a `git archive` of it unpacked at .prof/oldhead) against the working tree; CONC=8,16 here
REPO=${REPO:-$PWD}; cd $REPO && . .venv/bin/activate
D=reference_engine/assets/demo
out=${1:-/tmp/exp/ab}; mkdir -p $out
for i in 1 2; do
  for tree in old new; do
    pp=$PWD; [ $tree = old ] && pp=$PWD/.prof/oldhead
    (cd /tmp && PYTHONPATH=$pp OMP_NUM_THREADS=1 python -m reference_engine.bench --model $REPO/$D/target --draft $REPO/$D/draft --prompts $REPO/$D/heldout_prompts.jsonl --concurrency ${CONC:-4,8,16} --num-prompts 32 --output-len 128 --block-size 8 --commit-strategy per_token --measure-step-costs --repeats 3 --out $out/$tree-$i.csv) > $out/$tree-$i.log 2>&1
    echo "== $tree $i"; grep -A5 "DFlash/plain tok/s" $out/$tree-$i.log
  done
done
