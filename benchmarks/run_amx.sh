#!/usr/bin/env bash
# The AMX runs of the "Verification kernel" section (docs/lab-notes.md; BENCHMARKS.md cites them) (issue targets: NSD θ 0.9
# against AR and llama.cpp's own decoding at T = 0 and 0.8 on HumanEval and Spec-Bench),
# drafting with the draft model alone (--proposers draft), as they were measured.
# The "targets" group runs the same targets with nsd's current defaults (the hybrid proposer
# for the built-in pair, --weights auto) on the issue's prompt sets: HumanEval's first 40 and
# Spec-Bench 13 x 3, at T = 0 (with llama.cpp's plain and speculative decoding as peers) and
# at T = 0.8; then read them with
#   python benchmarks/speed_targets.py "$OUT_ROOT"/*-default/
# About 50 minutes of generation on a 2-core Sapphire Rapids (the older runs' totals), plus
# loading and scoring. The "serving" group runs the two serving measurements of docs/lab-notes.md
# (the joint plan in-process, then `nsd serve` under 1, 4 and 16 clients).
# Resumable: rerunning continues each journal (not the serving JSON files, which are
# rewritten). Usage: [OUT_ROOT=dir] bash benchmarks/run_amx.sh [run...] (default: targets)
# OUT_ROOT (default benchmarks/results/amx) keeps one CPU's runs apart from another's.
set -euo pipefail
cd "$(dirname "$0")/.."
NSD=".venv/bin/nsd"
OUT_ROOT="${OUT_ROOT:-benchmarks/results/amx}"
defaults=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct
          --theta 0.9 --max-new-tokens 128 --no-progress --rerun-loaded)
common=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --proposers draft
        --theta 0.9 --max-new-tokens 128 --no-progress --rerun-loaded)
run() {
    case "$1" in
        humaneval-t0) "$NSD" bench "${common[@]}" --dataset humaneval --limit 40 \
            --methods ar,sd,nsd,llama-generate,llama-speculative --out "$OUT_ROOT"/humaneval-t0 ;;
        spec-bench-t0) "$NSD" bench "${common[@]}" --dataset spec-bench --limit 3 --per-category \
            --methods ar,sd,nsd,llama-generate,llama-speculative --out "$OUT_ROOT"/spec-bench-t0 ;;
        humaneval-t0.8) "$NSD" bench "${common[@]}" --dataset humaneval --limit 20 \
            --methods ar,sd,nsd --temperature 0.8 --top-p 0.95 --out "$OUT_ROOT"/humaneval-t0.8 ;;
        spec-bench-t0.8) "$NSD" bench "${common[@]}" --dataset spec-bench --limit 1 --per-category \
            --methods ar,sd,nsd --temperature 0.8 --top-p 0.95 --out "$OUT_ROOT"/spec-bench-t0.8 ;;
        # The same HumanEval run after the AMX small-batch path got its prefetch (crossover 10).
        humaneval-t0-prefetch) "$NSD" bench "${common[@]}" --dataset humaneval --limit 40 \
            --methods ar,sd,nsd,llama-generate --out "$OUT_ROOT"/humaneval-t0-prefetch ;;
        # The issue's targets with the current defaults (no --proposers: the default proposer).
        humaneval-t0-default) "$NSD" bench "${defaults[@]}" --dataset humaneval --limit 40 \
            --methods ar,sd,nsd,llama-generate,llama-speculative --out "$OUT_ROOT"/humaneval-t0-default ;;
        spec-bench-t0-default) "$NSD" bench "${defaults[@]}" --dataset spec-bench --limit 3 --per-category \
            --methods ar,sd,nsd,llama-generate,llama-speculative --out "$OUT_ROOT"/spec-bench-t0-default ;;
        humaneval-t0.8-default) "$NSD" bench "${defaults[@]}" --dataset humaneval --limit 40 \
            --methods ar,sd,nsd --temperature 0.8 --top-p 0.95 --out "$OUT_ROOT"/humaneval-t0.8-default ;;
        spec-bench-t0.8-default) "$NSD" bench "${defaults[@]}" --dataset spec-bench --limit 3 --per-category \
            --methods ar,sd,nsd --temperature 0.8 --top-p 0.95 --out "$OUT_ROOT"/spec-bench-t0.8-default ;;
        targets) for one in humaneval-t0-default spec-bench-t0-default humaneval-t0.8-default \
                spec-bench-t0.8-default; do run "$one"; done
            .venv/bin/python benchmarks/speed_targets.py "$OUT_ROOT"/*-default/ ;;
        # Serving (issue 23): the joint plan against requests choosing alone, in-process;
        # then the server under 1, 4 and 16 clients, three requests each.
        batch-plan) .venv/bin/python benchmarks/batch_plan.py --levels 4,16 --rounds 4 --max-tokens 96 \
            --proposer draft --json "$OUT_ROOT"/batch-plan.json ;;
        serve-load) .venv/bin/python benchmarks/serve_load.py --methods ar,nsd --concurrency 1,4,16 \
            --rounds 2 --requests 3 --max-tokens 64 --json "$OUT_ROOT"/serve-batching-long.json \
            -- --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
            --parallel 16 --n-ctx 1024 ;;
        serving) run batch-plan; run serve-load ;;
        *) echo "unknown run $1" >&2; exit 2 ;;
    esac
}
for r in "${@:-targets}"; do
    for one in $r; do run "$one"; done
done
