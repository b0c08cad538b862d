#!/bin/bash
# DFlash with --verify-width auto (the default) against --verify-width fixed, c16, this tree:
# two runs of harness ab, the sides' order swapped in the second
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "pip failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
D=reference_engine/assets/demo
S="python3 -m reference_engine.serve --model $D/target --commit-strategy per_token --device cuda --max-num-seqs 16 --dflash-draft-model-path $D/draft --block-size 8"
t0=$(date +%s)
one() {  # out, a width, b width, prompts, repeats
  timeout 240 python3 -m harness ab --a-cmd "$S --verify-width $2 --port {port}" --b-cmd "$S --verify-width $3 --port {port}" \
    --a-label $2 --b-label $3 --concurrency 16 --output-len 128 --repeats $5 --num-prompts $4 --dataset $D/heldout_prompts.jsonl --out /tmp/w/$1 > /tmp/w/$1.log 2>&1
  echo "$1 rc=$? t=$(( $(date +%s)-t0 ))"
  python3 - /tmp/w/$1 <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1] + "/summary.csv")))
for label in ("A", "B"):
    rs = [r for r in rows if r["label"] == label]
    print("WIDTHS", sys.argv[1].split("/")[-1], label, [round(float(r["output_tokens_per_s"])) for r in rs], "acc", [r["acceptance_length"] for r in rs], "eng", [r["engine_cpu"] for r in rs])
PY
  grep -h "identical" /tmp/w/$1/report.md | head -1
}
mkdir -p /tmp/w
one warm auto fixed 64 1
one ab-1 auto fixed 512 3
one ab-2 fixed auto 512 3
[ $(( $(date +%s)-t0 )) -lt ${GUARD:-330} ] && one ab-3 auto fixed 512 3
