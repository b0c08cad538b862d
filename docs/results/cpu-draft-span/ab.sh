#!/bin/bash
# alternate make bench c16 on the CPU: side B with the whole block's draft (block) and with the verify's span (verify)
N=${1:-3}
for i in $(seq ${START:-1} $N); do
  for t in verify block; do
    extra=""; [ $t = verify ] && extra="--draft-span verify"
    out=/tmp/spanab/$t-$i; rm -rf $out
    (cd /work/main && PATH=/work/main/.venv/bin:$PATH make bench PYTHON=/work/main/.venv/bin/python BENCH_STEP_COSTS="--measure-step-costs $extra" BENCH_ARGS="--concurrency 16 --output-len 128 --repeats 3 --dataset reference_engine/assets/demo/heldout_prompts.jsonl" BENCH_OUT=$out > $out.log 2>&1)
    echo "$t-$i $(grep -o 'delivers [0-9.]*x[^(]*([^)]*)' $out/report.md | head -1) $(grep -o 'Outputs identical: [0-9/]*' $out/report.md)"
  done
done
