#!/usr/bin/env bash
# The one-GPU benchmark suite of docs/results/h200-long-context in one command, each part
# under a time limit so that the whole fits a budget: the Qwen3-8B real-shape exact gates,
# long-context decode and prefill (32K, both numerics, floors measured in the same process),
# DFlash/plain by concurrency (c1, c16, c32, c64), the Qwen3.5-4B per_token step at c16, and
# `make bench` at c16 with the DFlash and the DFlash2 demo drafts. Every log and CSV goes to
# OUT (default results/gpu-suite-<time>); the last lines printed are each part's summary.
#
#   bash scripts/bench_gpu_suite.sh [OUT] [SECONDS]     # SECONDS: the whole budget (550)
set -u
OUT=${1:-results/gpu-suite-$(date +%Y%m%d-%H%M%S)}
BUDGET=${2:-550}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
python_has_cuda=$("$PYTHON" -c "import torch; print(int(torch.cuda.is_available()))")
if [ "$python_has_cuda" != 1 ]; then
    echo "bench_gpu_suite.sh: needs a CUDA device (torch sees none)" >&2
    exit 2
fi
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
# the seconds a part may take: at most $1, at most what is left (a part is skipped below 30)
limit() { local l; l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
part() {
    echo "== $1 at $((SECONDS - T0)) s, $(left) s left"
    [ "$(left)" -ge 30 ] || { echo "   skipped: under 30 s left"; return 1; }
}
B="$PYTHON scripts/bench_engine.py --oracle-acceptance 6.5 --block-size 16 --repeats 3 --floor"

part "exact gates, Qwen3-8B shape" &&
DFLASH_GATE_SHAPES=qwen3-8b timeout "$(limit 150)" "$PYTHON" -m pytest -q -rf --tb=short -p no:cacheprovider \
    -m gpu gates/test_exact_gpu.py -k "real_shapes or graphs" > "$OUT/gates-8b.log" 2>&1
tail -1 "$OUT/gates-8b.log" 2>/dev/null

part "long context: 32K prompt, c1, exact and fast" &&
timeout "$(limit 160)" $B --random-shape qwen3-8b --concurrency 1 --input-len 32768 --output-len 128 \
    --numerics exact,fast --out "$OUT/long-32768.csv" > "$OUT/long-32768.log" 2>&1
tail -6 "$OUT/long-32768.log" 2>/dev/null

part "DFlash/plain by concurrency" &&
timeout "$(limit 170)" $B --random-shape qwen3-8b --concurrency 1,16,32,64 --input-len 128 --output-len 256 \
    --out "$OUT/sweep-8b.csv" > "$OUT/sweep-8b.log" 2>&1
tail -14 "$OUT/sweep-8b.log" 2>/dev/null

part "Qwen3.5-4B per_token at c16" &&
timeout "$(limit 80)" "$PYTHON" scripts/bench_engine.py --random-shape qwen3.5-4b \
    --commit-strategy per_token --oracle-acceptance 6.5 --block-size 16 --concurrency 16 --input-len 128 \
    --output-len 256 --repeats 3 --out "$OUT/4b-c16.csv" > "$OUT/4b-c16.log" 2>&1
tail -4 "$OUT/4b-c16.log" 2>/dev/null

for draft in dflash dflash2; do
    part "make bench at c16, $draft demo draft" &&
    timeout "$(limit 120)" make bench PYTHON="$PYTHON" BENCH_DRAFT=$draft \
        BENCH_OUT="$OUT/make-bench-$draft-c16" \
        BENCH_ARGS="--concurrency 16 --output-len 128 --repeats 3 --dataset reference_engine/assets/demo/heldout_prompts.jsonl" \
        > "$OUT/make-bench-$draft.log" 2>&1
    grep -E "Concurrency|identical|acceptance length" "$OUT/make-bench-$draft-c16/report.md" 2>/dev/null | head -4
done
echo "== done at $((SECONDS - T0)) s"
