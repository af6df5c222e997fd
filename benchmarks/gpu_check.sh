#!/usr/bin/env bash
# GPU check, run as-is on a machine with a CUDA GPU and no network:
#   1. smoke test of nsd's transformers backend on CUDA (tiny random models, float32):
#      rewind-and-refeed == fresh forward, greedy SD == greedy AR token for token,
#      NSD deviation accounting sane; eager, and graphed where it runs;
#   2. step costs c(n), n = 1..17, of Qwen2.5-0.5B/1.5B/7B shapes (random bf16 weights);
#   3. predicted AR/SD/NSD tokens/s from those costs and the CPU-measured acceptance.
# Results land in benchmarks/results/. Exits non-zero when the smoke test fails.
# Usage: bash benchmarks/gpu_check.sh        (PYTHON=/path/to/python to pick the interpreter)
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# Everything is built locally: never wait on a hub that cannot be reached.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
LOG_DIR=benchmarks/results
mkdir -p "$LOG_DIR"
start=$(date +%s)

fail() { echo; echo "GPU CHECK: FAILED — $*"; exit 1; }

command -v "$PY" >/dev/null 2>&1 || fail "no python: '$PY' is not on PATH (set PYTHON=...)"
"$PY" -c "import torch" 2>/dev/null || fail "'$PY' cannot import torch (set PYTHON to a python with torch+CUDA)"
"$PY" -c "import transformers" 2>/dev/null || fail "transformers is not installed for '$PY' (nsd's torch backend needs transformers >= 4.45; install it, or set PYTHON)"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || fail "torch $("$PY" -c 'import torch; print(torch.__version__)') sees no CUDA GPU"
"$PY" -c "import torch, transformers; print(f'torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, GPU {torch.cuda.get_device_name(0)}')"

echo; echo "== 1/3 smoke test =="
timeout 200 "$PY" benchmarks/gpu_smoke.py --device cuda 2>&1 | tee "$LOG_DIR/gpu_smoke_cuda.log"
smoke=${PIPESTATUS[0]}
[ "$smoke" -eq 0 ] || fail "smoke test (status $smoke; 124 = timed out); see $LOG_DIR/gpu_smoke_cuda.log"

echo; echo "== 2/3 step costs =="
timeout 270 "$PY" benchmarks/gpu_costs.py --device cuda 2>&1 | tee "$LOG_DIR/gpu_costs_cuda.log"
costs=${PIPESTATUS[0]}

echo; echo "== 3/3 prediction =="
predict=1
if [ -f "$LOG_DIR/gpu_costs_cuda.json" ] && [ "$costs" -eq 0 ]; then
    "$PY" benchmarks/gpu_predict.py "$LOG_DIR/gpu_costs_cuda.json" 2>&1 | tee "$LOG_DIR/gpu_predict_cuda.log"
    predict=${PIPESTATUS[0]}
fi

echo
echo "== summary ($(( $(date +%s) - start ))s) =="
echo "smoke test:  ok (per-mode lines above; 'unavailable' graph modes are not failures)"
[ "$costs" -eq 0 ] && echo "step costs:  ok -> $LOG_DIR/gpu_costs_cuda.json" \
    || echo "step costs:  FAILED (status $costs; 124 = timed out)"
[ "$predict" -eq 0 ] && echo "prediction:  ok -> $LOG_DIR/gpu_predict_cuda.json (predictions, not end-to-end runs)" \
    || echo "prediction:  not made"
[ "$costs" -eq 0 ] && [ "$predict" -eq 0 ] || exit 1
echo "GPU CHECK: PASSED"
