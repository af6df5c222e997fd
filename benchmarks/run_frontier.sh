#!/usr/bin/env bash
# The quality-speed frontier (fidelity, and issue 45's rules): AR, exact SD, NSD at
# θ = 0.5, 0.7, 0.9, 0.95, NSD with a fidelity budget B = 1 and 4 (at θ = 0.95, the loosest
# nucleus), typical acceptance with Medusa's defaults, and the rules engines ship, each with
# its main knob over four values (the same sweep budget as θ): top-K/δ (TensorRT-LLM /
# Modular MAX; K = 10, δ = 0.2, 0.4, 0.6, 0.8), SGLang's thresholds (threshold_single =
# 0.3, 0.5, 0.7, 0.9; at T > 0 only: its greedy verification is argmax matching) and vLLM's
# FLy (entropy threshold 0.1, 0.3, 0.6, 1.0; window 3, vLLM's min(6, k − 1) at k = 4). All
# with the 0.5B draft at a fixed k = 4 (top-K/δ and thresholds draft its argmaxes: they are
# defined for deterministic drafts), on all 164 HumanEval problems (pass@1) and Spec-Bench
# (3 questions x 13 categories; log-likelihood under the target against AR), at temperature
# 0 and at 0.8 with top-p 0.95 (seed 0 for every problem and method); 256 new tokens at
# most for HumanEval (complete functions), 128 for Spec-Bench. One interleaved run per
# dataset and temperature; resumable (a run cut short continues from its journal). The
# grid is nsd.bench.frontier's METHODS (keep the two in step).
#
# k is fixed at 4 rather than auto because on a CPU where speculation does not pay, -k auto
# takes plain steps and every method would coincide with AR: the frontier would be empty.
#
# After the runs, benchmarks/frontier_reading.py prints each run's fidelity table and the
# fastest rule at each quality level, and writes frontier_rules.png (speedup against
# quality, one curve per rule, AR and SD as points) into each run folder.
#
#   bash benchmarks/run_frontier.sh [specbench-t0 specbench-t0.8 humaneval-t0 humaneval-t0.8]
#
# FRONTIER_ARGS adds arguments to every run (for example FRONTIER_ARGS="--limit 40" for the first 40
# HumanEval problems where the whole grid would not fit the time at hand).
#
# FRONTIER_SMOKE=1 checks the tooling end to end in minutes, measuring nothing: two values
# per knob, the first 2 prompts, 32 new tokens, results under benchmarks/results/frontier-smoke.
#
# Results: benchmarks/results/frontier/<name>/{report.md,results.json,journal.jsonl,*.png}, or
# FRONTIER_OUT/<name> where that is set (a run of the same grid on another machine).
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/bench_grid.sh
OUT=${FRONTIER_OUT:-benchmarks/results/frontier}
THETA=0.5,0.7,0.9,0.95 DELTA=0.2,0.4,0.6,0.8 SINGLE=0.3,0.5,0.7,0.9 ENTROPY=0.1,0.3,0.6,1.0
SMOKE=()
read -r -a EXTRA <<< "${FRONTIER_ARGS:-}"
if [[ "${FRONTIER_SMOKE:-0}" == 1 ]]; then
    OUT=benchmarks/results/frontier-smoke
    THETA=0.5,0.9 DELTA=0.3,0.6 SINGLE=0.3,0.7 ENTROPY=0.1,0.6
    # The weights as given and the full draft vocabulary: no once-per-machine measurements.
    SMOKE=(--limit 2 --max-new-tokens 32 --weights original --draft-vocab 0)
fi
COMMON=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --proposers draft
        --theta "$THETA" --budget 1,4 --relaxed-delta "$DELTA" --fly-entropy-threshold "$ENTROPY"
        --fly-window-size 3 -k 4 --seed 0)
T0=(--methods ar,sd,nsd,nsd-budget,typical,topk_delta,fly --temperature 0)
T08=(--methods ar,sd,nsd,nsd-budget,typical,topk_delta,threshold,fly --threshold-single "$SINGLE"
     --temperature 0.8 --top-p 0.95)
names=(${@:-specbench-t0 specbench-t0.8 humaneval-t0 humaneval-t0.8})
for name in "${names[@]}"; do
    case "$name" in
        humaneval-t0)   run "$name" --dataset humaneval --max-new-tokens 256 "${T0[@]}" "${SMOKE[@]}" "${EXTRA[@]}" ;;
        specbench-t0)   run "$name" --dataset spec-bench --limit 3 --per-category --max-new-tokens 128 "${T0[@]}" "${SMOKE[@]}" "${EXTRA[@]}" ;;
        humaneval-t0.8) run "$name" --dataset humaneval --max-new-tokens 256 "${T08[@]}" "${SMOKE[@]}" "${EXTRA[@]}" ;;
        specbench-t0.8) run "$name" --dataset spec-bench --limit 3 --per-category --max-new-tokens 128 "${T08[@]}" "${SMOKE[@]}" "${EXTRA[@]}" ;;
        *) echo "unknown run $name" >&2; exit 2 ;;
    esac
done
"${PYTHON:-.venv/bin/python}" benchmarks/frontier_reading.py "${names[@]/#/$OUT/}"
