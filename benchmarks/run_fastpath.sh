#!/usr/bin/env bash
# The CPU fast-path benchmark: AR (on the fastest weight format found here), llama.cpp's own
# generation of the same file, and SD / NSD with -k auto beside fixed k = 2 and 4, on
# HumanEval (20 problems) and Spec-Bench (2 questions x 13 categories), at temperature 0
# and 0.8 (top-p 0.95). One interleaved run per dataset and temperature; resumable.
#
#   bash benchmarks/run_fastpath.sh [humaneval-t0 specbench-t0 humaneval-t0.8 specbench-t0.8]
#
# Results: benchmarks/results/fastpath/<name>/{report.md,results.json,journal.jsonl,*.png}
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/bench_grid.sh
OUT=benchmarks/results/fastpath
COMMON=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --proposers draft
        --methods ar,sd,nsd,llama-generate --theta 0.9 --ks auto,2,4 --max-new-tokens 128)
for name in "${@:-humaneval-t0 specbench-t0 humaneval-t0.8 specbench-t0.8}"; do
    for one in $name; do
        case "$one" in
            humaneval-t0)   run "$one" --dataset humaneval --limit 20 --temperature 0 ;;
            specbench-t0)   run "$one" --dataset spec-bench --limit 2 --per-category --temperature 0 ;;
            humaneval-t0.8) run "$one" --dataset humaneval --limit 20 --temperature 0.8 --top-p 0.95 ;;
            specbench-t0.8) run "$one" --dataset spec-bench --limit 2 --per-category --temperature 0.8 --top-p 0.95 ;;
            *) echo "unknown run $one" >&2; exit 2 ;;
        esac
    done
done
