#!/bin/bash
# call 2: two more rounds of call 1's A/B (after, before), then the py-spy profiles
set -u
cd $(git rev-parse --show-toplevel 2>/dev/null || pwd)
RUNS="after-3 before-3 after-4 before-4" GUARD=${GUARD:-330} bash docs/results/h100-make-bench-c16-coalesce-2026-12-06/call1-bench.sh
bash docs/results/h100-make-bench-c16-coalesce-2026-12-06/call2-profile.sh
