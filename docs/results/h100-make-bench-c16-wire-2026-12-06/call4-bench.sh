#!/bin/bash
# 1) the GPU tests of the changed transfers and wire; 2) make bench c16 A/B, this tree (after) against prev.tgz (before), alternating, after a warm-up run
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; cat $R/gpu.txt
t0=$(date +%s)
timeout 60 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_kernels_runtime_contracts.py tests/test_gpu.py tests/test_serve_engine_loop.py -k "torch_tensor or refuses or list_it_came or copied_without_waiting or first_token_left or crosses or small_step_inputs" 2>&1 | tee $R/tests.log | tail -4
echo "tests t=$(( $(date +%s)-t0 ))"
D=reference_engine/assets/demo
summ() {
  python3 - $1 <<'PY'
import csv, statistics, sys
by = {}
for r in csv.DictReader(open(sys.argv[1] + "/summary.csv")):
    by.setdefault((r["label"], r["concurrency"]), []).append(r)
m = lambda rows, k: statistics.median(float(r[k]) for r in rows if r.get(k))
for c in sorted({c for _, c in by}, key=int):
    a, b = by[("A", c)], by[("B", c)]
    print("BENCH", sys.argv[1].split("/")[-1], "c", c, "ratio", round(m(b, "output_tokens_per_s") / m(a, "output_tokens_per_s"), 3),
          "plain", [round(float(r["output_tokens_per_s"])) for r in a], "dflash", [round(float(r["output_tokens_per_s"])) for r in b],
          "acc", round(m(b, "acceptance_length"), 2), "eng", [r["engine_cpu"] for r in b], "srv", [r["server_cpu"] for r in b])
PY
  grep -h "identical" $1/report.md | head -1
}
BT=/tmp/base; mkdir -p $BT && tar xzf .prof/dev/prev.tgz -C $BT && ln -s $PWD/reference_engine/assets $BT/reference_engine/assets
bench() {  # tree dir, out name, prompts, repeats, limit
  (cd $1 && PYTHONPATH=/tmp/site:$1 timeout $5 make bench PYTHON=python3 BENCH_ARGS="--concurrency 16 --output-len 128 --repeats $4 --num-prompts $3 --dataset $D/heldout_prompts.jsonl" BENCH_OUT=$R/$2 > $R/$2.log 2>&1)
  echo "$2 rc=$? t=$(( $(date +%s)-t0 ))"
}
bench $BT warm 64 1 130
for run in after-1 before-1 after-2 before-2 after-3 before-3 after-4 before-4; do
  [ $(( $(date +%s)-t0 )) -gt ${GUARD:-470} ] && break
  dir=$PWD; [ ${run%-*} = before ] && dir=$BT
  bench $dir $run 512 3 120; summ $R/$run
done
python3 - $R <<'PY'
import csv, glob, statistics, sys
for side in ("after", "before"):
    a, b = [], []
    for f in sorted(glob.glob(sys.argv[1] + f"/{side}-*/summary.csv")):
        for r in csv.DictReader(open(f)):
            (a if r["label"] == "A" else b).append(float(r["output_tokens_per_s"]))
    if a and b:
        print("POOLED", side, "plain", round(statistics.median(a)), "dflash", round(statistics.median(b)), "ratio", round(statistics.median(b) / statistics.median(a), 3), "n", len(a), len(b))
PY
cd $OUT && tar czf r.tgz r && rm -rf r
