"""Runs tests/in_vllm/ with the vLLM venv's interpreter, when that venv exists.

vLLM pins its own torch, so it lives in ``.venv-vllm`` (scripts/install_vllm.sh), not in
nsd's venv; its tests run there as a subprocess and report back through pytest's exit
status and output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.mark.skipif(not VLLM_PYTHON.exists(),
                    reason="no .venv-vllm (scripts/install_vllm.sh failed or was not run)")
@pytest.mark.skipif(os.environ.get("NSD_SKIP_REAL_MODELS") == "1", reason="NSD_SKIP_REAL_MODELS=1")
def test_vllm_suite_in_its_own_venv() -> None:
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm, nsd.integrations.vllm.plugin"],
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, f".venv-vllm exists but cannot import vllm + nsd:\n{probe.stderr[-3000:]}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    run = subprocess.run([str(VLLM_PYTHON), "-m", "pytest", "-q", "-rs", "-s", str(ROOT / "tests" / "in_vllm")],
                         capture_output=True, text=True, env=env, timeout=1500, cwd=ROOT)
    sys.stdout.write(run.stdout[-6000:])
    assert run.returncode == 0, f"vLLM tests failed:\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"
