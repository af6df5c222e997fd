#!/usr/bin/env bash
# The AMX runs of BENCHMARKS.md's "Verification kernel" section (issue targets: NSD θ 0.9
# against AR and llama.cpp's own decoding at T = 0 and 0.8 on HumanEval and Spec-Bench).
# Resumable: rerunning continues each journal. Usage: bash benchmarks/run_amx.sh [run...]
set -euo pipefail
cd "$(dirname "$0")/.."
NSD=".venv/bin/nsd"
common=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --proposers draft
        --theta 0.9 --max-new-tokens 128 --no-progress --rerun-loaded)
run() {
    case "$1" in
        humaneval-t0) "$NSD" bench "${common[@]}" --dataset humaneval --limit 40 \
            --methods ar,sd,nsd,llama-generate,llama-speculative --out benchmarks/results/amx/humaneval-t0 ;;
        spec-bench-t0) "$NSD" bench "${common[@]}" --dataset spec-bench --limit 3 --per-category \
            --methods ar,sd,nsd,llama-generate,llama-speculative --out benchmarks/results/amx/spec-bench-t0 ;;
        humaneval-t0.8) "$NSD" bench "${common[@]}" --dataset humaneval --limit 20 \
            --methods ar,sd,nsd --temperature 0.8 --top-p 0.95 --out benchmarks/results/amx/humaneval-t0.8 ;;
        spec-bench-t0.8) "$NSD" bench "${common[@]}" --dataset spec-bench --limit 1 --per-category \
            --methods ar,sd,nsd --temperature 0.8 --top-p 0.95 --out benchmarks/results/amx/spec-bench-t0.8 ;;
        # The same HumanEval run after the AMX small-batch path got its prefetch (crossover 10).
        humaneval-t0-prefetch) "$NSD" bench "${common[@]}" --dataset humaneval --limit 40 \
            --methods ar,sd,nsd,llama-generate --out benchmarks/results/amx/humaneval-t0-prefetch ;;
        *) echo "unknown run $1" >&2; exit 2 ;;
    esac
}
for r in "${@:-humaneval-t0 spec-bench-t0 humaneval-t0.8 spec-bench-t0.8}"; do
    for one in $r; do run "$one"; done
done
