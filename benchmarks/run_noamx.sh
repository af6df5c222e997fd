#!/usr/bin/env bash
# Issue 22's end-to-end target on the path of an x86 CPU without AMX: NSD θ 0.9 against AR on
# HumanEval (first 40) at T = 0, -k auto, with the small-batch VNNI kernels
# (scripts/patches/ggml-vnni-small-batch.patch; run "humaneval-t0") and with ggml's own
# kernels (GGML_VNNI_SMALL_M=0; run "humaneval-t0-ggml"); and Spec-Bench at T = 0 and 0.8
# with the default kernels ("spec-bench-t0", "spec-bench-t0.8"); the draft model against the
# hybrid proposer on both ("humaneval-t0-hybrid", "spec-bench-t0-hybrid"; with the stored
# starting estimates of each proposer, "...-hybrid-priors"; on all 164 HumanEval problems and at
# T = 0.8, "humaneval164-t0-hybrid", "humaneval164-t0.8-hybrid", "spec-bench-t0.8-hybrid-x3"; HumanEval's
# first 40 at T = 0.8, "humaneval-t0.8-hybrid"). On an AMX CPU, GGML_NO_AMX=1
# leaves ggml's AMX kernels out, so the weights take the repacked layouts a CPU without AMX
# uses; on a CPU without AMX the variable changes nothing. Resumable (each journal is
# continued).
# Runs without --proposers use the default proposer: the draft model alone before 2026-12-06,
# the hybrid proposer since (the "zen4-hybrid-default" runs of docs/lab-notes.md).
# Usage: [OUT_ROOT=dir] bash benchmarks/run_noamx.sh [run...] (default: the two HumanEval runs)
# OUT_ROOT (default benchmarks/results/noamx) keeps one CPU's runs apart from another's.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_ROOT="${OUT_ROOT:-benchmarks/results/noamx}"
# run OUT "ENV=VALUE ..." BENCH-ARGS...
run() {
    local out="$1" envs="$2"; shift 2
    # shellcheck disable=SC2086  # envs: zero or more VAR=value words
    env GGML_NO_AMX=1 $envs .venv/bin/nsd bench --target qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --methods ar,sd,nsd --theta 0.9 --max-new-tokens 128 \
        --no-progress --rerun-loaded "$@" --out "$OUT_ROOT/$out"
}
for r in "${@:-humaneval-t0 humaneval-t0-ggml}"; do
    for one in $r; do
        case "$one" in
            humaneval-t0) run humaneval-t0 "" --dataset humaneval --limit 40 ;;
            humaneval-t0-ggml) run humaneval-t0-ggml GGML_VNNI_SMALL_M=0 --dataset humaneval --limit 40 ;;
            spec-bench-t0) run spec-bench-t0 "" --dataset spec-bench --limit 3 --per-category ;;
            spec-bench-t0.8) run spec-bench-t0.8 "" --dataset spec-bench --limit 1 --per-category \
                --temperature 0.8 --top-p 0.95 ;;
            # The draft model alone against the hybrid proposer (prompt lookup beside it).
            humaneval-t0-hybrid) run humaneval-t0-hybrid "" --dataset humaneval --limit 40 \
                --proposers draft,hybrid ;;
            spec-bench-t0-hybrid) run spec-bench-t0-hybrid "" --dataset spec-bench --limit 3 \
                --per-category --proposers draft,hybrid ;;
            # The same two after the per-proposer starting estimates (src/nsd/draftlen/priors.py), and
            # the sampled setting's.
            humaneval-t0-hybrid-priors) run humaneval-t0-hybrid-priors "" --dataset humaneval \
                --limit 40 --proposers draft,hybrid ;;
            spec-bench-t0-hybrid-priors) run spec-bench-t0-hybrid-priors "" --dataset spec-bench \
                --limit 3 --per-category --proposers draft,hybrid ;;
            spec-bench-t0.8-hybrid-priors) run spec-bench-t0.8-hybrid-priors "" --dataset spec-bench \
                --limit 1 --per-category --proposers draft,hybrid --temperature 0.8 --top-p 0.95 ;;
            # Whether the hybrid proposer can be the default: every HumanEval problem at both
            # temperatures, and Spec-Bench 13 x 3 at T = 0.8.
            humaneval164-t0-hybrid) run humaneval164-t0-hybrid "" --dataset humaneval \
                --proposers draft,hybrid ;;
            humaneval164-t0.8-hybrid) run humaneval164-t0.8-hybrid "" --dataset humaneval \
                --proposers draft,hybrid --temperature 0.8 --top-p 0.95 ;;
            humaneval-t0.8-hybrid) run humaneval-t0.8-hybrid "" --dataset humaneval --limit 40 \
                --proposers draft,hybrid --temperature 0.8 --top-p 0.95 ;;
            spec-bench-t0.8-hybrid-x3) run spec-bench-t0.8-hybrid-x3 "" --dataset spec-bench \
                --limit 3 --per-category --proposers draft,hybrid --temperature 0.8 --top-p 0.95 ;;
            *) echo "unknown run $one" >&2; exit 2 ;;
        esac
    done
done
