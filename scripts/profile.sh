#!/usr/bin/env bash
# Phase profile of the engine benchmark, plain decode vs DFlash, per concurrency: each mode
# and concurrency runs in its own process under Nsight Systems (NVTX phase ranges, GPU time
# projected onto them, kernels), recording the measured repeats only; then OUT/profile.md
# and OUT/plots/phase_breakdown.png (python -m reports profile OUT). With --timer, or
# NSYS=none, no nsys: one benchmark run gives the same breakdown from the engine's built-in
# phase timer.
#
#   scripts/profile.sh [--timer] [--out DIR] [--concurrency 1,8] [--threads N] WORKLOAD...
#
# WORKLOAD is passed to scripts/bench_engine.py: --random-shape NAME or --model DIR --draft
# DIR (none: the shipped demo pair on its held-out prompts), and --oracle-acceptance,
# --commit-strategy, --input-len, --output-len, --repeats, ...
# (not --concurrency, --modes, --out or --profile-capture, which this script sets).
# --threads N: CPU threads per operator of each benchmark process (OMP_NUM_THREADS, which
# torch reads), as make bench gives its servers: on a few busy cores, operators whose threads
# wait on each other for a core make repeats swing several-fold. Empty: torch's default.
# Environment: NSYS (the nsys to use, or "none"), PYTHON (default python3), PROFILE_OUT,
# PROFILE_CONCURRENCY and PROFILE_THREADS (defaults of --out, --concurrency and --threads). nsys is looked for in $NSYS,
# then on PATH, then in the usual install folders.
set -euo pipefail

NSYS_FOLDERS=(
    "/opt/nvidia/nsight-systems/*/bin/nsys"
    "/opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys"
    "/usr/local/cuda*/bin/nsys"
    "/usr/local/cuda*/nsight-systems*/bin/nsys"
)
MODES=(plain dflash)

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}

fail() {  # an error line, then any further lines indented; exit 2
    printf 'error: %s\n' "$1" >&2
    shift
    (($#)) && printf '  %s\n' "$@" >&2
    exit 2
}

# The nsys to use, printed; nothing and status 1 when there is none.
find_nsys() {
    if [[ -n ${NSYS:-} ]]; then
        [[ -f $NSYS && -x $NSYS ]] || return 1
        printf '%s\n' "$NSYS"
        return 0
    fi
    if command -v nsys >/dev/null 2>&1; then
        command -v nsys
        return 0
    fi
    local pattern candidate matches i
    for pattern in "${NSYS_FOLDERS[@]}"; do
        # shellcheck disable=SC2206  # the glob is meant to expand
        matches=($pattern)
        for ((i = ${#matches[@]} - 1; i >= 0; i--)); do  # the highest version first
            candidate=${matches[i]}
            if [[ -f $candidate && -x $candidate ]]; then
                printf '%s\n' "$candidate"
                return 0
            fi
        done
    done
    return 1
}

nsys_missing() {
    local where
    if [[ -n ${NSYS:-} ]]; then
        where="NSYS=$NSYS is not an executable file"
    else
        where="not on PATH, NSYS unset, and none in ${NSYS_FOLDERS[*]}"
    fi
    fail "nsys (Nsight Systems) not found: $where" \
        "install Nsight Systems (the nsight-systems-cli package of NVIDIA's CUDA apt repository, or the CUDA toolkit) and put nsys on PATH, or point NSYS at it: make profile NSYS=/path/to/nsys" \
        "without nsys, 'make profile NSYS=none' (scripts/profile.sh --timer) gives the same phase breakdown from the engine's built-in timer"
}

# Run and record a command (commands.txt, shown in profile.md), its output also in LOG.
run_logged() {
    local log=$1
    shift
    local arg line=()
    for arg in "$@"; do  # quoted only where a shell needs it
        if [[ $arg =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then line+=("$arg"); else line+=("$(printf '%q' "$arg")"); fi
    done
    echo "${line[*]}" >>"$out/commands.txt"
    "$@" 2>&1 | tee "$log"
}

timer=0
out=${PROFILE_OUT:-}
concurrency=${PROFILE_CONCURRENCY:-1,8}
threads=${PROFILE_THREADS:-}
while (($#)); do
    case $1 in
        --timer) timer=1; shift ;;
        --out) out=${2:?--out needs a directory}; shift 2 ;;
        --concurrency) concurrency=${2:?--concurrency needs a list such as 1,8}; shift 2 ;;
        --threads) threads=${2:?--threads needs a count}; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        --) shift; break ;;
        *) break ;;
    esac
done
workload=("$@")
for arg in "${workload[@]}"; do
    case $arg in
        --concurrency | --concurrency=* | --modes | --modes=* | --out | --out=* | --profile-capture)
            fail "$arg is set by scripts/profile.sh; give the concurrency list as --concurrency (PROFILE_CONCURRENCY) and the folder as --out (PROFILE_OUT)" ;;
    esac
done
# no workload: the engine benchmark's default, the shipped demo pair on its held-out prompts
if [[ -n $threads ]]; then
    [[ $threads =~ ^[1-9][0-9]*$ ]] || fail "--threads must be a whole number >= 1, got '$threads'"
    export OMP_NUM_THREADS=$threads
fi

[[ ${NSYS:-} == none ]] && timer=1
if ((!timer)); then
    nsys=$(find_nsys) || nsys_missing
fi

case ${BASH_SOURCE[0]} in
    */*) root=$(cd "${BASH_SOURCE[0]%/*}/.." && pwd) ;;
    *) root=$(cd .. && pwd) ;;
esac
cd "$root"
python=${PYTHON:-python3}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
out=${out:-results/profile-$(date +%Y%m%d-%H%M%S)}
# the folder created, writable and with room (one line if not), then held by this run alone:
# the same lock file as the harness's (harness/output.py), released when this shell ends
"$python" -m harness.output "$out" || exit 2
if command -v flock >/dev/null 2>&1; then
    exec 9>>"$out/.lock"
    flock -n 9 || fail "the output folder $out is in use by another run ($(cat "$out/.lock")): wait for it to end or give another --out"
    echo "pid $$ since $(date '+%Y-%m-%d %H:%M:%S')" >"$out/.lock"
fi
: >"$out/commands.txt"

echo "# OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset} (torch threads per operator), nproc $(nproc 2>/dev/null || echo '?')" >>"$out/commands.txt"
if ((timer)); then
    echo "# phase profile from the built-in timer (no nsys) into $out"
    run_logged "$out/bench.log" "$python" scripts/bench_engine.py --concurrency "$concurrency" \
        --out "$out/bench.csv" "${workload[@]}"
else
    "$python" -c 'import nvtx' 2>/dev/null ||
        fail "the nvtx Python package is missing for $python: pip install nvtx (or pip install -e '.[profile]'); without it the engine emits no NVTX ranges"
    echo "# phase profile under $nsys ($("$nsys" --version 2>/dev/null | head -n 1)) into $out"
    IFS=, read -r -a levels <<<"$concurrency"
    for c in "${levels[@]}"; do
        for mode in "${MODES[@]}"; do
            label=$mode-c$c
            rm -f "$out/$label".{nsys-rep,qdstrm,sqlite} "$out/${label}"_*.csv
            run_logged "$out/$label.log" env DFLASH_NVTX=1 "$nsys" profile \
                --trace=cuda,nvtx,osrt --sample=none --cpuctxsw=none --cuda-graph-trace=node \
                --capture-range=cudaProfilerApi --capture-range-end=stop \
                -o "$out/$label" --force-overwrite=true \
                "$python" scripts/bench_engine.py --modes "$mode" --concurrency "$c" \
                --profile-capture --out "$out/$label.csv" "${workload[@]}"
            if [[ ! -f $out/$label.nsys-rep ]]; then
                hint="is the benchmark on a GPU (it opens the capture range only there)?"
                [[ -f $out/$label.qdstrm ]] &&
                    hint="$label.qdstrm is there, so its import failed: the importer needs libdw.so.1 and libelf.so.1 (put them in a folder on LD_LIBRARY_PATH)"
                fail "nsys wrote no $out/$label.nsys-rep; $hint"
            fi
            run_logged "$out/$label.stats.log" "$nsys" stats \
                --report nvtx_sum,nvtx_gpu_proj_sum,cuda_gpu_kern_sum --format csv \
                --output "$out/$label" --force-export=true "$out/$label.nsys-rep"
        done
    done
fi
"$python" -m reports profile "$out"
