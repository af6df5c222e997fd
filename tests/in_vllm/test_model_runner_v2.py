"""NSD and vLLM's model runners: applied where claimed, refused at start-up elsewhere.

- Model Runner V2's verifier against nsd's replacement, and the plugin installing it:
  ``v2_interpreted.py``, run here in a fresh interpreter under ``TRITON_INTERPRET=1``
  (V2's Triton kernels on CPU tensors).
- On this vLLM (the CPU build, no Triton backend): V2 cannot be selected, and an engine
  whose verification NSD would not replace stops when its configuration is built, with
  one NSDError line naming the setting.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from nsd.errors import NSDError  # noqa: E402

HERE = Path(__file__).resolve().parent
MODELS = Path(os.environ.get("NSD_CACHE", Path.home() / ".cache" / "nsd")) / "models"
TARGET = MODELS / "qwen2.5-coder-1.5b-instruct" / "hf"
DRAFT = MODELS / "qwen2.5-coder-0.5b-instruct" / "hf"
NSD = {"nsd": {"method": "nsd", "theta": 0.9}}


def test_v2_verifier_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          str(HERE / "v2_interpreted.py")], capture_output=True, text=True,
                         env=env, timeout=900, cwd=HERE.parents[1])
    sys.stdout.write(run.stdout[-3000:])
    assert run.returncode == 0, f"{run.stdout[-6000:]}\n{run.stderr[-3000:]}"
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1]


def engine_config(monkeypatch, speculative: dict, additional: dict = NSD, v2: str | None = None):
    if not ((TARGET / "config.json").is_file() and (DRAFT / "config.json").is_file()):
        pytest.skip("HF folders missing: run `nsd models fetch qwen2.5-coder-0.5b-instruct "
                    "qwen2.5-coder-1.5b-instruct --hf`")
    from vllm.engine.arg_utils import EngineArgs

    if v2 is not None:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2)
    args = EngineArgs(model=str(TARGET), dtype="bfloat16", max_model_len=512,
                      kv_cache_memory_bytes=1 << 28, compilation_config={"mode": 0},
                      speculative_config={"method": "draft_model", "model": str(DRAFT),
                                          "num_speculative_tokens": 4, **speculative},
                      additional_config=additional)
    return args.create_engine_config()


def test_standard_verification_on_the_v1_runner_starts(monkeypatch) -> None:
    config = engine_config(monkeypatch, {})
    assert not config.use_v2_model_runner


@pytest.mark.parametrize("method", ["synthetic", "block"])
def test_other_verification_methods_are_refused_at_startup(monkeypatch, method: str) -> None:
    extra = {"rejection_sample_method": method}
    if method == "synthetic":
        extra["synthetic_acceptance_rates"] = [0.8, 0.6, 0.4, 0.2]
    with pytest.raises(NSDError, match="rejection_sample_method"):
        engine_config(monkeypatch, extra)
    engine_config(monkeypatch, extra, additional={})  # without NSD, vLLM's own business


def test_model_runner_v2_cannot_start_here_with_or_without_nsd(monkeypatch) -> None:
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        pytest.skip("this vLLM has Triton: V2 is covered by the interpreter test")
    with pytest.raises(Exception, match="Triton|VLLM_USE_V2_MODEL_RUNNER"):
        engine_config(monkeypatch, {}, v2="1")
