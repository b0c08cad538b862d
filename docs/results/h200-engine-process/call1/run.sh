#!/bin/bash
# make bench at c16 on the demo pair: the engine in a process of its own against on a thread,
# interleaved, then the full make bench with the default (auto) loop.
set -u
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
C16="--concurrency 16 --output-len 128 --repeats 3 --dataset reference_engine/assets/demo/heldout_prompts.jsonl"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/r/gpu.txt
git rev-parse --short HEAD > $OUT/r/tree.txt; git status --short >> $OUT/r/tree.txt
for round in 1 2; do
  for loop in process thread; do
    timeout 100 make bench PYTHON=python3 BENCH_ENGINE_LOOP=$loop BENCH_ARGS="$C16" BENCH_OUT=$OUT/r/c16-$loop-$round > $OUT/r/c16-$loop-$round.log 2>&1
    echo "c16 $loop round $round rc=$?"
  done
done
timeout 150 make bench PYTHON=python3 BENCH_OUT=$OUT/r/full-auto > $OUT/r/full-auto.log 2>&1; echo "full rc=$?"
python3 - <<'PY'
import csv, glob, os, statistics
out = os.environ["OUT"] + "/r"
for d in sorted(glob.glob(out + "/*/summary.csv")):
    rows = list(csv.DictReader(open(d)))
    by = {}
    for r in rows:
        by.setdefault((int(r["concurrency"]), r["label"]), []).append(float(r["output_tokens_per_s"]))
    for c in sorted({k[0] for k in by}):
        a, b = by.get((c, "A"), []), by.get((c, "B"), [])
        if a and b:
            print(f"{os.path.basename(os.path.dirname(d)):22s} c{c:<3d} plain {statistics.median(a):8.0f} dflash {statistics.median(b):8.0f} ratio {statistics.median(b)/statistics.median(a):.2f}  plain {[round(x) for x in a]} dflash {[round(x) for x in b]}")
PY
cd $OUT && tar czf r.tgz r && rm -rf r
