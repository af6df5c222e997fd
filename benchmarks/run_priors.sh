#!/usr/bin/env bash
# The stored acceptance priors of -k auto (src/nsd/draftlen/priors.py, src/nsd/acceptance_priors.json):
# SD and NSD θ 0.9 with the hybrid proposer (the draft model and prompt lookup, so both are
# counted) on the held-out calibration prompts (benchmarks/data/calibration_prompts.jsonl,
# built from Python's standard library, not a benchmark), at T = 0 and at T = 0.8 (top-p
# 0.95), starting from the default priors; then the counts become the stored estimates.
# GGML_NO_AMX=1 as in the other runs of a CPU without AMX (acceptance does not depend on the
# kernels beyond rounding). Resumable (each journal is continued).
# Usage: [OUT_ROOT=dir] bash benchmarks/run_priors.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_ROOT="${OUT_ROOT:-benchmarks/results/priors}"
run() {
    local out="$1"; shift
    env GGML_NO_AMX=1 NSD_ACCEPTANCE_PRIORS=default .venv/bin/nsd bench \
        --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
        --methods sd,nsd --theta 0.9 --proposers hybrid --max-new-tokens 128 --no-progress \
        --no-exec --no-loglik --dataset benchmarks/data/calibration_prompts.jsonl "$@" \
        --out "$OUT_ROOT/$out"
}
run t0
run t0.8 --temperature 0.8 --top-p 0.95
.venv/bin/python benchmarks/acceptance_priors.py --runs "$OUT_ROOT/t0" "$OUT_ROOT/t0.8" \
    --command "OUT_ROOT=$OUT_ROOT bash benchmarks/run_priors.sh"
