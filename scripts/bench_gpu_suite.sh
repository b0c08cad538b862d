#!/usr/bin/env bash
# The one-GPU benchmarks of docs/results (h200-long-context, h200-moe, h200-dflash2-demo) in
# one command, each part under a time limit so that the whole fits a budget. Parts, in order
# (PARTS picks and orders them; default all but reach):
#   gates     the Qwen3-8B real-shape exact gates and the graphs gate
#   long      long-context decode and prefill: 32K prompt, c1, exact and fast, floors measured
#   sweep     DFlash/plain by concurrency on the 8B shape (c1, c16, c32, c64)
#   4b        the Qwen3.5-4B per_token step at c16
#   bench     `make bench` at c16 with the DFlash and the DFlash2 demo drafts
#   dflash2   DFlash2 against DFlash on the 8B shape: with graphs, and eager (the convolution's
#             and the selector's shares of the draft phase are timed only eagerly)
#   reach     the Qwen3-30B-A3B, Qwen3.5-35B-A3B, Llama-3.1-8B and Qwen3-8B shapes, c1 and c16,
#             floors measured (the MoE goals, and Llama against Qwen3-8B in one run)
# Every log and CSV goes to OUT (default results/gpu-suite-<time>); the last lines printed
# are each part's summary.
#
#   bash scripts/bench_gpu_suite.sh [OUT] [SECONDS]     # SECONDS: the whole budget (550)
#   PARTS="dflash2 reach" bash scripts/bench_gpu_suite.sh
set -u
OUT=${1:-results/gpu-suite-$(date +%Y%m%d-%H%M%S)}
BUDGET=${2:-550}
PARTS=${PARTS:-gates long sweep 4b bench dflash2}
PYTHON=${PYTHON:-python3}
for name in $PARTS; do
    case $name in
        gates | long | sweep | 4b | bench | dflash2 | reach) ;;
        *) echo "bench_gpu_suite.sh: unknown part '$name' (gates, long, sweep, 4b, bench, dflash2, reach)" >&2; exit 2 ;;
    esac
done
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
B="$PYTHON scripts/bench_engine.py --oracle-acceptance 6.5 --block-size 16 --repeats 3"

run_gates() {
    part "exact gates, Qwen3-8B shape" || return
    DFLASH_GATE_SHAPES=qwen3-8b timeout "$(limit 150)" "$PYTHON" -m pytest -q -rf --tb=short -p no:cacheprovider \
        -m gpu gates/test_exact_gpu.py -k "real_shapes or graphs" > "$OUT/gates-8b.log" 2>&1
    tail -1 "$OUT/gates-8b.log"
}
run_long() {
    part "long context: 32K prompt, c1, exact and fast" || return
    timeout "$(limit 160)" $B --floor --random-shape qwen3-8b --concurrency 1 --input-len 32768 --output-len 128 \
        --numerics exact,fast --out "$OUT/long-32768.csv" > "$OUT/long-32768.log" 2>&1
    tail -6 "$OUT/long-32768.log"
}
run_sweep() {
    part "DFlash/plain by concurrency" || return
    timeout "$(limit 170)" $B --floor --random-shape qwen3-8b --concurrency 1,16,32,64 --input-len 128 --output-len 256 \
        --out "$OUT/sweep-8b.csv" > "$OUT/sweep-8b.log" 2>&1
    tail -14 "$OUT/sweep-8b.log"
}
run_4b() {
    part "Qwen3.5-4B per_token at c16" || return
    timeout "$(limit 80)" $B --random-shape qwen3.5-4b --commit-strategy per_token --concurrency 16 \
        --input-len 128 --output-len 256 --out "$OUT/4b-c16.csv" > "$OUT/4b-c16.log" 2>&1
    tail -4 "$OUT/4b-c16.log"
}
run_bench() {
    local draft
    for draft in dflash dflash2; do
        part "make bench at c16, $draft demo draft" || return
        timeout "$(limit 120)" make bench PYTHON="$PYTHON" BENCH_DRAFT=$draft \
            BENCH_OUT="$OUT/make-bench-$draft-c16" \
            BENCH_ARGS="--concurrency 16 --output-len 128 --repeats 3 --dataset reference_engine/assets/demo/heldout_prompts.jsonl" \
            > "$OUT/make-bench-$draft.log" 2>&1
        grep -E "Concurrency|identical|acceptance length" "$OUT/make-bench-$draft-c16/report.md" | head -4
    done
}
run_dflash2() {
    local eager
    for eager in "" --enforce-eager; do
        part "DFlash2 against DFlash, 8B shape ${eager:-with graphs}" || return
        timeout "$(limit 110)" $B --floor --random-shape qwen3-8b --draft-arch dflash,dflash2 --concurrency 1,16 \
            --input-len 128 --output-len 256 $eager --out "$OUT/dflash2-8b${eager:+-eager}.csv" \
            > "$OUT/dflash2-8b${eager:+-eager}.log" 2>&1
        grep -A3 -E "^numerics \| concurrency \| (DFlash ms|DFlash2 conv)" "$OUT/dflash2-8b${eager:+-eager}.log"
    done
}
run_reach() {
    local shape strategy
    for shape in qwen3-30b-a3b qwen3.5-35b-a3b llama3.1-8b qwen3-8b; do
        part "$shape, c1 and c16" || return
        strategy=replay
        [ "$shape" = qwen3.5-35b-a3b ] && strategy=per_token
        timeout "$(limit 130)" $B --floor --random-shape $shape --commit-strategy $strategy --concurrency 1,16 \
            --out "$OUT/reach-$shape.csv" > "$OUT/reach-$shape.log" 2>&1
        grep -A3 -E "^draft \| numerics \| concurrency \| DFlash/plain" "$OUT/reach-$shape.log"
    done
}

for name in $PARTS; do
    "run_$name"
done
echo "== done at $((SECONDS - T0)) s"
