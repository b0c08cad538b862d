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
#             floors measured (the MoE goals, and Llama against Qwen3-8B in one run);
#             REACH_SHAPES picks and orders the shapes
# Every log and CSV goes to OUT (default results/gpu-suite-<time>); each part prints its
# summary tables. A part runs only if what is left of the budget is at least its usual
# length (else it says it was skipped), and one that reaches its time limit says so.
#
#   bash scripts/bench_gpu_suite.sh [OUT] [SECONDS]     # SECONDS: the whole budget (550)
#   PARTS=reach bash scripts/bench_gpu_suite.sh results/reach 540
#   PARTS=reach REACH_SHAPES="llama3.1-8b qwen3-8b" bash scripts/bench_gpu_suite.sh results/dense 280
set -u
set -f  # PARTS is a list of names, never a pattern
OUT=${1:-results/gpu-suite-$(date +%Y%m%d-%H%M%S)}
BUDGET=${2:-550}
PARTS=${PARTS-gates long sweep 4b bench dflash2}
PYTHON=${PYTHON:-python3}
KNOWN="gates long sweep 4b bench dflash2 reach"
REACH_SHAPES=${REACH_SHAPES-qwen3-30b-a3b qwen3.5-35b-a3b llama3.1-8b qwen3-8b}
[ -n "${PARTS// /}" ] || { echo "bench_gpu_suite.sh: PARTS names no part (${KNOWN// /, })" >&2; exit 2; }
for name in $PARTS; do
    case " $KNOWN " in
        *" $name "*) ;;
        *) echo "bench_gpu_suite.sh: unknown part '$name' (${KNOWN// /, })" >&2; exit 2 ;;
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
# the seconds a part may take: at most $1, at most what is left
limit() { local l; l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
# part TITLE MIN: announce a part; false (skipped) when under MIN seconds are left
part() {
    echo "== $1 at $((SECONDS - T0)) s, $(left) s left"
    [ "$(left)" -ge "$2" ] || { echo "   skipped: under $2 s left"; return 1; }
}
# timed LIMIT LOG COMMAND...: COMMAND under LIMIT seconds, its output in LOG
timed() {
    local seconds=$1 log=$2 rc
    shift 2
    timeout "$seconds" "$@" > "$log" 2>&1
    rc=$?
    [ $rc -eq 124 ] && echo "   timed out after $seconds s (partial output: $log)"
    [ $rc -ne 0 ] && [ $rc -ne 124 ] && echo "   exit status $rc (output: $log)"
    return 0
}
# tables LOG HEADER...: the last table of LOG whose header line starts with HEADER (a literal)
tables() {
    local log=$1 header
    shift
    for header in "$@"; do
        awk -v h="$header" '
            index($0, h) == 1 { start = NR }
            { line[NR] = $0 }
            END {
                if (!start) { print "   (no \"" h "\" table)"; exit }
                print line[start]  # then its rows, up to the header of the next table
                for (i = start + 1; i <= NR && line[i] ~ /^[^ ]+ [|]/ && line[i] !~ /^(mode|draft|numerics) [|]/; i++)
                    print line[i]
            }' "$log" 2> /dev/null || echo "   (no $log)"
    done
}
B=("$PYTHON" scripts/bench_engine.py --oracle-acceptance 6.5 --block-size 16 --repeats 3)
FLOOR="mode | numerics | concurrency | ms per decode step"
RATIO="draft | numerics | concurrency | DFlash/plain"

run_gates() {
    part "exact gates, Qwen3-8B shape" 100 || return 0
    DFLASH_GATE_SHAPES=qwen3-8b timed "$(limit 150)" "$OUT/gates-8b.log" "$PYTHON" -m pytest -q -rf --tb=short \
        -p no:cacheprovider -m gpu gates/test_exact_gpu.py -k "real_shapes or graphs"
    tail -1 "$OUT/gates-8b.log"
}
run_long() {
    part "long context: 32K prompt, c1, exact and fast" 90 || return 0
    timed "$(limit 160)" "$OUT/long-32768.log" "${B[@]}" --floor --random-shape qwen3-8b --concurrency 1 \
        --input-len 32768 --output-len 128 --numerics exact,fast --out "$OUT/long-32768.csv"
    tables "$OUT/long-32768.log" "$FLOOR" "mode | numerics | concurrency | ms prefill"
}
run_sweep() {
    part "DFlash/plain by concurrency" 100 || return 0
    timed "$(limit 170)" "$OUT/sweep-8b.log" "${B[@]}" --floor --random-shape qwen3-8b --concurrency 1,16,32,64 \
        --input-len 128 --output-len 256 --out "$OUT/sweep-8b.csv"
    tables "$OUT/sweep-8b.log" "$RATIO" "$FLOOR"
}
run_4b() {
    part "Qwen3.5-4B per_token at c16" 50 || return 0
    timed "$(limit 80)" "$OUT/4b-c16.log" "${B[@]}" --random-shape qwen3.5-4b --commit-strategy per_token \
        --concurrency 16 --input-len 128 --output-len 256 --out "$OUT/4b-c16.csv"
    tables "$OUT/4b-c16.log" "$RATIO"
}
run_bench() {
    local draft
    for draft in dflash dflash2; do
        part "make bench at c16, $draft demo draft" 70 || return 0
        timed "$(limit 120)" "$OUT/make-bench-$draft.log" make bench PYTHON="$PYTHON" BENCH_DRAFT=$draft \
            BENCH_OUT="$OUT/make-bench-$draft-c16" \
            BENCH_ARGS="--concurrency 16 --output-len 128 --repeats 3 --dataset reference_engine/assets/demo/heldout_prompts.jsonl"
        grep -E "^- (Concurrency|Outputs identical|Mean acceptance length)" "$OUT/make-bench-$draft-c16/report.md" 2> /dev/null \
            || echo "   (no report in $OUT/make-bench-$draft-c16)"
    done
}
run_dflash2() {
    local eager name
    for eager in "" --enforce-eager; do
        part "DFlash2 against DFlash, 8B shape ${eager:-with graphs}" 90 || return 0
        name=dflash2-8b${eager:+-eager}
        timed "$(limit 110)" "$OUT/$name.log" "${B[@]}" --floor --random-shape qwen3-8b --draft-arch dflash,dflash2 \
            --concurrency 1,16 --input-len 128 --output-len 256 $eager --out "$OUT/$name.csv"
        tables "$OUT/$name.log" "numerics | concurrency | DFlash ms" "numerics | concurrency | DFlash2 conv"
    done
}
run_reach() {
    local shape strategy
    for shape in $REACH_SHAPES; do
        part "$shape, c1 and c16" 100 || return 0
        strategy=replay
        [ "$shape" = qwen3.5-35b-a3b ] && strategy=per_token
        timed "$(limit 130)" "$OUT/reach-$shape.log" "${B[@]}" --floor --random-shape $shape \
            --commit-strategy $strategy --concurrency 1,16 --out "$OUT/reach-$shape.csv"
        tables "$OUT/reach-$shape.log" "$RATIO" "$FLOOR"
    done
}

for name in $PARTS; do
    "run_$name"
done
echo "== done at $((SECONDS - T0)) s"
