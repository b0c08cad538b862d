#!/bin/bash
# alternate make bench c16 on the CPU between /tmp/abold (before) and /work/main (after)
N=${1:-3}
mkdir -p /tmp/abres
for i in $(seq ${START:-1} $N); do
  for t in new old; do
    dir=/work/main; [ $t = old ] && dir=/tmp/abold
    out=/tmp/abres/$t-$i; rm -rf $out
    (cd $dir && PATH=/work/main/.venv/bin:$PATH make bench PYTHON=/work/main/.venv/bin/python BENCH_ARGS="--concurrency 16 --output-len 128 --repeats 3 --dataset reference_engine/assets/demo/heldout_prompts.jsonl" BENCH_OUT=$out > $out.log 2>&1)
    echo "$t-$i $(grep -o 'delivers [0-9.]*x[^(]*([^)]*)' $out/report.md | head -1) $(grep -o 'Outputs identical: [0-9/]*' $out/report.md)"
  done
done
