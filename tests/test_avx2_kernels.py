"""nsd's small-batch AVX2 kernels (scripts/patches/ggml-avx2-small-batch.patch).

They are compiled where the AVX-512 VNNI kernels are not (an AVX2-only CPU, or any x86 CPU
with ``NSD_CPU_LEVEL=avx2``). Two properties:

* agreement: their logits equal ggml's own (``GGML_AVX2_SMALL_M=0``) up to the order of the
  float sums, with the bounds the VNNI kernels' test uses;
* batch invariance: a row's logits are bitwise the same whether it is computed alone (the
  one-token step) or in a batch of 2..16 rows, for SmolLM2 here and the real Qwen2.5-Coder
  pair (target and draft) in ``test_real_models_are_batch_invariant``. ggml's own kernels
  do not have it, which the tests check too, so they could fail.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.llama

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from nsd.backends.llama_cpp import LlamaCppBackend  # noqa: E402
from test_llama_backend import (  # noqa: E402
    PROMPT,
    _cpu_flags,
    _library_has,
    _model_path,
    amx_disagreement,
)

FLAGS = _cpu_flags()
HAS_AVX2 = {"avx2", "fma", "f16c"} <= FLAGS
HAS_AVX512_VNNI = {"avx512f", "avx512bw", "avx512dq", "avx512_vnni"} <= FLAGS
SWITCHES = ("GGML_AVX2_SMALL_M", "GGML_AVX2_SMALL_MIN")


def _require_avx2_kernels() -> None:
    """Skip where the kernels cannot run or are not built; fail where they should be."""
    if not HAS_AVX2:
        pytest.skip("this CPU reports no AVX2/FMA/F16C: the AVX2 kernels are not compiled for it")
    built = _library_has(b"GGML_AVX2_SMALL_M")
    if HAS_AVX512_VNNI and not built:
        pytest.skip("this CPU has AVX-512 VNNI and the llama.cpp in use was built for it: the "
                    "VNNI kernels run instead of the AVX2 ones (NSD_CPU_LEVEL=avx2 builds these)")
    assert built, "the llama.cpp in use lacks the AVX2 small-batch patch"


@pytest.fixture
def ggml_switches(monkeypatch: pytest.MonkeyPatch):
    """Set GGML_AVX2_SMALL_M per call (None: the patch's defaults); restored afterwards."""
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)

    def use(small_m: str | None) -> None:
        if small_m is None:
            os.environ.pop("GGML_AVX2_SMALL_M", None)
        else:
            os.environ["GGML_AVX2_SMALL_M"] = small_m
    yield use
    os.environ.pop("GGML_AVX2_SMALL_M", None)


def test_avx2_kernels_match_ggmls_repack_and_q8_0_kernels(ggml_switches) -> None:
    """Repacked Q4_0 (any number of rows, in groups of 16) and Q8_0 over 1..16 rows (the
    output head of nsd's Q4_0 files) take the AVX2 kernels, which compute the same int32 dot
    product per 32-weight block as ggml's, and sum a row in the order of ggml's own one-row
    kernels (gemv for repacked Q4_0, vec_dot for Q8_0: 8 float lanes, one FMA per block,
    the lanes summed last). So:

    * one row: bitwise ggml's logits, with repacked layouts (every layer and the head run
      the new kernels) and without (the Q8_0 head alone does). Any slip in an unpack, a
      scale or the -8 * sum term breaks this;
    * 2..24 rows, repacked: ggml's attention takes llamafile's tinyBLAS from 2 rows, nsd's
      ggml's vec_dot up to 16 (see test_rows_are_batch_invariant_on_smollm2), and 30 layers
      amplify that reordering: the VNNI kernels' test bounds (softmax TV <= 0.15, argmax only
      at near-ties), and the two paths must differ somewhere, or the switch did nothing."""
    from nsd.models.weights import gguf_for

    _require_avx2_kernels()
    draft = [(i * 104729) % 40000 + 100 for i in range(24)]
    path = gguf_for(_model_path(), "q4_0")
    for layouts in ("repack", "plain"):
        with LlamaCppBackend(path, n_threads=2, n_ctx=512, use_extra_bufts=layouts == "repack") as b:
            if layouts == "repack":
                assert "CPU_REPACK" in b.weight_buffers, b.weight_buffers
            b.forward(PROMPT[:40])
            differ = False
            for n in ((1, 2, 3, 5, 9, 16, 24) if layouts == "repack" else (1,)):
                got = {}
                for value in ("0", None):
                    ggml_switches(value)
                    got[value] = b.forward(draft[:n])
                    b.rewind(40)
                ggml, ours = got["0"], got[None]
                assert ours.shape == (n, ggml.shape[1])
                if n == 1:
                    assert torch.equal(ours, ggml), (layouts, float((ours - ggml).abs().max()))
                    continue
                assert amx_disagreement(ours, ggml) is None, (n, amx_disagreement(ours, ggml))
                assert float((ours[0] - ours[-1]).abs().max()) > 1.0  # not one row everywhere
                differ = differ or not torch.equal(ours, ggml)
            assert differ or layouts == "plain"


def batch_mismatches(backend: LlamaCppBackend, prompt: list[int], tokens: list[int],
                     ns: range) -> list[tuple[int, int]]:
    """(n, row) for every row of a batch of n tokens after ``prompt`` whose logits are not
    bitwise those of the same token decoded one at a time (the one-token steps of AR)."""
    backend.reset()
    backend.forward(prompt, all_logits=False)
    ref = []
    for t in tokens:
        ref.append(backend.forward([t])[-1])
    backend.rewind(len(prompt))
    bad = []
    for n in ns:
        out = backend.forward(tokens[:n])
        backend.rewind(len(prompt))
        bad += [(n, i) for i in range(n) if not torch.equal(out[i], ref[i])]
    return bad


def _random_case(vocab: int, seed: int) -> tuple[list[int], list[int]]:
    # a prompt of random length (so the rows sit at random positions) and random tokens
    rng = random.Random(seed)
    prompt = [rng.randrange(100, vocab) for _ in range(rng.randrange(8, 300))]
    return prompt, [rng.randrange(100, vocab) for _ in range(16)]


def check_batch_invariance(path: Path, seeds: tuple[int, ...], ggml_switches) -> None:
    with LlamaCppBackend(path, n_threads=2, n_ctx=1024) as b:
        vocab = min(b.vocab_size, 40000)
        for seed in seeds:
            prompt, tokens = _random_case(vocab, seed)
            ggml_switches(None)
            bad = batch_mismatches(b, prompt, tokens, range(2, 17))
            assert not bad, (path.name, seed, len(prompt), bad[:10])
        # Non-vacuous: with ggml's own kernels the rows do depend on the batch.
        ggml_switches("0")
        prompt, tokens = _random_case(vocab, seeds[0])
        assert batch_mismatches(b, prompt, tokens, range(2, 17)), path.name
        # ... and the one-token steps are ggml's own, bit for bit: greedy AR decodes the
        # same text with the patch as without it.
        steps = {}
        for value in ("0", None):
            ggml_switches(value)
            b.reset()
            b.forward(prompt, all_logits=False)
            steps[value] = torch.stack([b.forward([t])[-1] for t in tokens])
        assert torch.equal(steps["0"], steps[None]), path.name


def test_rows_are_batch_invariant_on_smollm2(ggml_switches) -> None:
    """A row computed in a batch of n = 2..16 has bitwise the logits of the one-token step
    at its position (repacked Q4_0 layers, Q8_0 head, F16 KV cache, no flash attention)."""
    from nsd.models.weights import gguf_for

    _require_avx2_kernels()
    check_batch_invariance(gguf_for(_model_path(), "q4_0"), (1, 2), ggml_switches)


@pytest.mark.real_models
@pytest.mark.skipif(os.environ.get("NSD_SKIP_REAL_MODELS") == "1", reason="NSD_SKIP_REAL_MODELS=1")
@pytest.mark.parametrize("model", ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_real_models_are_batch_invariant(model: str, ggml_switches) -> None:
    """The same on nsd's Q4_0 copies (Q8_0 head) of the real target and draft."""
    from nsd.models.registry import fetch_gguf
    from nsd.models.weights import gguf_for

    _require_avx2_kernels()
    check_batch_invariance(gguf_for(fetch_gguf(model, progress=False), "q4_0"), (7,), ggml_switches)


@pytest.mark.real_models
@pytest.mark.skipif(os.environ.get("NSD_SKIP_REAL_MODELS") == "1", reason="NSD_SKIP_REAL_MODELS=1")
def test_greedy_sd_reproduces_greedy_ar_on_the_real_pair(ggml_switches) -> None:
    """Issue 48's user check, "same prompt, greedy, same text?": with batch-invariant rows a
    verification forward gives each row the logits of AR's one-token step, so greedy SD
    (which emits the target's argmax at every position) is AR token for token. On the
    README's prompts and the first HumanEval ones, at k = 4 and -k auto, on the Q4_0 target
    the kernels cover. ggml's own kernels do not give this (test_real_models_are_batch_invariant
    checks that they change rows), so the test could fail."""
    from nsd.api import GenerationConfig, load_engine
    from nsd.bench.compare import DEFAULT_PROMPTS
    from nsd.bench.datasets import _humaneval
    from nsd.models.loader import BackendOptions

    _require_avx2_kernels()
    ggml_switches(None)
    engine = load_engine("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct",
                         proposer="draft",
                         options=BackendOptions(weights="q4_0", draft_weights="q4_0", draft_vocab=0,
                                                n_ctx=1024, threads=2))
    prompts = list(DEFAULT_PROMPTS) + [p.text for p in _humaneval(False)[:5]]
    drafted = 0
    for prompt in prompts:
        ids = engine.encode(prompt)
        ar = engine.generate(ids, GenerationConfig(method="ar", temperature=0.0, max_new_tokens=48))
        for k in (4, "auto"):
            sd = engine.generate(ids, GenerationConfig(method="sd", k=k, temperature=0.0,
                                                       max_new_tokens=48))
            assert sd.token_ids == ar.token_ids, (prompt[:40], k)
            drafted += sd.stats.drafted_tokens
    assert drafted > 0  # the SD runs verified drafts: the equality is not AR against AR
