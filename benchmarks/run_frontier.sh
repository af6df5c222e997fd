#!/usr/bin/env bash
# The quality-speed frontier (fidelity): AR, exact SD, NSD at θ = 0.5, 0.7, 0.9, 0.95, NSD
# with a fidelity budget B = 1 and 4 (at θ = 0.95, the loosest nucleus), and typical
# acceptance with Medusa's defaults, all with the 0.5B draft at a fixed k = 4, on all 164
# HumanEval problems (pass@1) and Spec-Bench (3 questions x 13 categories), at temperature
# 0 and at 0.8 with top-p 0.95 (seed 0 for every problem and method); 256 new tokens at
# most for HumanEval (complete functions), 128 for Spec-Bench. One interleaved run
# per dataset and temperature; resumable (a run cut short continues from its journal).
#
# k is fixed at 4 rather than auto because on a CPU where speculation does not pay, -k auto
# takes plain steps and every method would coincide with AR: the frontier would be empty.
#
#   bash benchmarks/run_frontier.sh [specbench-t0 specbench-t0.8 humaneval-t0 humaneval-t0.8]
#
# Results: benchmarks/results/frontier/<name>/{report.md,results.json,journal.jsonl,*.png}
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/bench_grid.sh
OUT=benchmarks/results/frontier
COMMON=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --proposers draft
        --methods ar,sd,nsd,nsd-budget,typical --theta 0.5,0.7,0.9,0.95 --budget 1,4
        -k 4 --seed 0)
for name in ${@:-specbench-t0 specbench-t0.8 humaneval-t0 humaneval-t0.8}; do
    case "$name" in
        humaneval-t0)   run "$name" --dataset humaneval --max-new-tokens 256 --temperature 0 ;;
        specbench-t0)   run "$name" --dataset spec-bench --limit 3 --per-category --max-new-tokens 128 --temperature 0 ;;
        humaneval-t0.8) run "$name" --dataset humaneval --max-new-tokens 256 --temperature 0.8 --top-p 0.95 ;;
        specbench-t0.8) run "$name" --dataset spec-bench --limit 3 --per-category --max-new-tokens 128 --temperature 0.8 --top-p 0.95 ;;
        *) echo "unknown run $name" >&2; exit 2 ;;
    esac
done
