"""The llama.cpp backend against the ModelBackend contract, on SmolLM2-135M.

Needs llama-cpp-python (``scripts/install.sh``) and the registry model
``smollm2-135m-instruct`` (fetched into the cache on first use). Set
``NSD_LLAMA_TEST_GGUF`` to a .gguf file to run on another model instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from nsd.backends.base import ModelBackend
from nsd.errors import NSDError

pytestmark = pytest.mark.llama

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from nsd.backends.llama_cpp import LlamaCppBackend  # noqa: E402

N_CTX = 512
# Token ids well inside SmolLM2's 49,152-token vocabulary (ordinary text tokens).
PROMPT = [(i * 7919) % 40000 + 100 for i in range(60)]
DRAFT = [(i * 104729) % 40000 + 100 for i in range(8)]
OTHER = [(i * 1299709) % 40000 + 100 for i in range(5)]
ATOL = 1e-4


def _model_path() -> Path:
    override = os.environ.get("NSD_LLAMA_TEST_GGUF")
    if override:
        return Path(override)
    try:
        from nsd.models.registry import fetch_gguf
    except ImportError:
        pytest.skip("nsd.models is not available")
    try:
        return fetch_gguf("smollm2-135m-instruct", progress=False)
    except NSDError as exc:
        pytest.skip(f"test model unavailable: {exc}")


@pytest.fixture(scope="module")
def gguf() -> Path:
    path = _model_path()
    if not path.is_file():
        pytest.skip(f"test model unavailable: {path}")
    return path


@pytest.fixture(params=[True, False], ids=["repack", "no-repack"])
def make(request: pytest.FixtureRequest, gguf: Path) -> Callable[[], LlamaCppBackend]:
    """Backend factory; every test runs with and without llama.cpp's weight repacking."""
    return lambda: LlamaCppBackend(gguf, n_threads=2, n_ctx=N_CTX, use_extra_bufts=request.param)


@pytest.fixture()
def backend(make: Callable[[], LlamaCppBackend]) -> Iterator[LlamaCppBackend]:
    with make() as b:
        yield b


def test_implements_protocol(backend: LlamaCppBackend) -> None:
    assert isinstance(backend, ModelBackend)
    assert backend.vocab_size > max(PROMPT + DRAFT + OTHER)
    assert backend.n_ctx >= N_CTX
    assert len(backend.eos_token_ids) == 1  # SmolLM2: <|im_end|> (2), as the GGUF declares
    assert set(backend.eos_token_ids) <= set(backend.eog_token_ids)


def test_forward_shapes_and_bookkeeping(backend: LlamaCppBackend) -> None:
    logits = backend.forward(PROMPT)  # [len(PROMPT), V]
    assert logits.shape == (len(PROMPT), backend.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert backend.num_cached == len(PROMPT)
    backend.forward(DRAFT)
    assert backend.num_cached == len(PROMPT) + len(DRAFT)
    backend.rewind(len(PROMPT) + 3)
    assert backend.num_cached == len(PROMPT) + 3
    backend.rewind(len(PROMPT) + 3)  # no-op
    assert backend.num_cached == len(PROMPT) + 3
    with pytest.raises(ValueError):
        backend.rewind(len(PROMPT) + 4)
    assert backend.forward([]).shape == (0, backend.vocab_size)
    backend.reset()
    assert backend.num_cached == 0


def test_rewind_then_refeed_equals_fresh_cache(
    make: Callable[[], LlamaCppBackend], backend: LlamaCppBackend
) -> None:
    """Rejected drafts leave no trace: same logits as a cache that never saw them."""
    backend.forward(PROMPT)
    backend.forward(DRAFT)
    backend.rewind(len(PROMPT))
    after_rewind = backend.forward(OTHER)  # [5, V]

    with make() as fresh:
        fresh.forward(PROMPT)
        expected = fresh.forward(OTHER)
    torch.testing.assert_close(after_rewind, expected, atol=ATOL, rtol=0)


def test_rewind_mid_batch_leaves_no_trace(
    make: Callable[[], LlamaCppBackend], backend: LlamaCppBackend
) -> None:
    """Keep 3 of 8 verified drafts, then continue: as if the rejected ones never were.

    The reference makes the same calls minus the detours, so every kept position was
    computed in a batch of the same shape (llama.cpp's logits depend on batch shape).
    """
    backend.forward(PROMPT)
    backend.forward(OTHER)  # a detour, rejected entirely
    backend.rewind(len(PROMPT))
    first = backend.forward(DRAFT)
    backend.rewind(len(PROMPT))
    torch.testing.assert_close(backend.forward(DRAFT), first, atol=ATOL, rtol=0)
    backend.rewind(len(PROMPT) + 3)
    after = backend.forward(OTHER)  # [5, V]

    with make() as fresh:
        fresh.forward(PROMPT)
        torch.testing.assert_close(fresh.forward(DRAFT), first, atol=ATOL, rtol=0)
        fresh.rewind(len(PROMPT) + 3)
        expected = fresh.forward(OTHER)
    torch.testing.assert_close(after, expected, atol=ATOL, rtol=0)


def test_last_row_only_matches_all_rows(
    make: Callable[[], LlamaCppBackend], backend: LlamaCppBackend
) -> None:
    every_row = backend.forward(PROMPT)  # [len(PROMPT), V]
    with make() as other:
        last_only = other.forward(PROMPT, all_logits=False)  # [1, V]
        assert other.num_cached == len(PROMPT)
    assert last_only.shape == (1, backend.vocab_size)
    torch.testing.assert_close(last_only[0], every_row[-1], atol=ATOL, rtol=0)


def test_context_overflow_raises_and_keeps_cache(backend: LlamaCppBackend) -> None:
    backend.forward(PROMPT)
    before = backend.forward(DRAFT)
    too_many = [PROMPT[0]] * (backend.n_ctx - backend.num_cached + 1)
    with pytest.raises(NSDError, match="context"):
        backend.forward(too_many)
    assert backend.num_cached == len(PROMPT) + len(DRAFT)
    backend.rewind(len(PROMPT))
    torch.testing.assert_close(backend.forward(DRAFT), before, atol=ATOL, rtol=0)


def test_context_is_the_size_asked_for_and_a_longer_forward_raises(gguf: Path) -> None:
    # llama.cpp rounds 300 up to 512, but one forward may carry at most n_batch = 300
    # tokens: with the rounded size a 301-token prompt passed the room check and then
    # aborted the process inside llama_decode.
    with LlamaCppBackend(gguf, n_threads=2, n_ctx=300) as b:
        assert b.n_ctx == 300
        with pytest.raises(NSDError, match="context of 300 tokens"):
            b.forward([PROMPT[0]] * 301)
        assert b.num_cached == 0
        assert b.forward([PROMPT[0]] * 300, all_logits=False).shape == (1, b.vocab_size)


def test_rejects_bad_input(gguf: Path, backend: LlamaCppBackend) -> None:
    with pytest.raises(ValueError):
        backend.forward([backend.vocab_size])
    assert backend.num_cached == 0
    with pytest.raises(NSDError, match="not found"):
        LlamaCppBackend(gguf.with_name("missing.gguf"))


# --------------------------------------------------------------------------- AMX

def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


HAS_AMX = {"amx_tile", "amx_int8"} <= _cpu_flags()


def test_weight_buffers_are_reported() -> None:
    backend = LlamaCppBackend(_model_path(), n_ctx=N_CTX)
    assert backend.weight_buffers, "the load log names at least one weight buffer"
    backend.close()


# Bounds of the AMX-vs-plain comparison (see the test's docstring for the measurements).
AMX_MAX_TV = 0.15
AMX_MAX_TIE_GAP = 0.25


def amx_disagreement(amx: torch.Tensor, plain: torch.Tensor) -> str | None:
    """Why two paths' logits ``[n, V]`` differ by more than kernel rounding, or None.

    Per position: the total variation between the two softmaxes is at most
    ``AMX_MAX_TV``, and where the argmaxes differ the plain path ranks the AMX path's
    argmax within ``AMX_MAX_TIE_GAP`` logits of its own (a near-tie, not a wrong answer).
    """
    p_amx, p_plain = torch.softmax(amx.double(), -1), torch.softmax(plain.double(), -1)
    tv = 0.5 * (p_amx - p_plain).abs().sum(-1)
    if not bool(torch.isfinite(amx).all()):
        return "non-finite logits"
    if float(tv.max()) > AMX_MAX_TV:
        return f"softmax total variation up to {float(tv.max()):.3f} (bound {AMX_MAX_TV})"
    rows = torch.arange(plain.shape[0])
    gap = plain.double().max(-1).values - plain.double()[rows, amx.argmax(-1)]
    if float(gap.max()) > AMX_MAX_TIE_GAP:
        return f"argmax differs where the plain path's gap is {float(gap.max()):.3f} logits"
    return None


@pytest.mark.skipif(not HAS_AMX, reason="this CPU reports no AMX (amx_tile and amx_int8): "
                    "scripts/install.sh builds llama.cpp without its AMX kernels here, so there "
                    "is no AMX path to test")
def test_amx_build_loads_amx_buffers_and_matches_the_plain_path() -> None:
    """On an AMX CPU the install builds ggml's AMX kernels with the tile-config patch.
    Their weights must land in AMX buffers, and the logits must agree with the same file
    loaded without them (``use_extra_bufts=False``: ggml's plain CPU kernels) up to the
    rounding of two kernels that quantise activations differently.

    The criterion separates rounding from breakage by the distributions, not by a raw
    logit bound (the raw difference reached 1.10 on SmolLM2 while the softmaxes stayed
    close). Measured on an Intel Sapphire Rapids (2 cores), 16 positions of these prompt
    ids, total variation between the softmaxes per position:

    - AMX vs plain, same file: at most 0.061 (SmolLM2 Q4_1), 0.057 (its Q4_0 copy), 0.065
      (its Q8_0 copy), 0.032 (Qwen2.5-Coder-1.5B Q4_0); mean 0.036–0.040 on SmolLM2.
    - quantisation, both on the plain path: the Q8_0 copy vs the Q4_1 file up to 0.097
      (mean 0.055); the Q4_0 copy vs the Q4_1 file up to 0.61 (mean 0.35).
    - breakage: zeroed logits vs plain, mean 0.86; random logits of the same spread, 0.98.

    So the bound is 0.15: over twice the largest rounding seen, a quarter of what a
    4-bit requantisation does, far below breakage. The argmaxes differed at 2 of 16
    SmolLM2 positions, both near-ties (the plain path's two candidates 0.049 and 0.056
    logits apart; the median top-1/top-2 gap is 0.3); a differing argmax is accepted
    only where the plain path ranks the other token within 0.25 logits of its own.
    """
    path = _model_path()
    amx = LlamaCppBackend(path, n_ctx=N_CTX, use_extra_bufts=True)
    plain = LlamaCppBackend(path, n_ctx=N_CTX, use_extra_bufts=False)
    assert "AMX" in amx.weight_buffers, amx.weight_buffers
    assert "AMX" not in plain.weight_buffers
    ids = PROMPT[:16]
    a, b = amx.forward(ids), plain.forward(ids)
    amx.close()
    plain.close()
    assert amx_disagreement(a, b) is None, amx_disagreement(a, b)
    # The criterion does catch a broken tile configuration: zeroed or garbage outputs.
    assert amx_disagreement(torch.zeros_like(b), b) is not None
    garbage = torch.randn(b.shape, generator=torch.Generator().manual_seed(0)) * b.std()
    assert amx_disagreement(garbage, b) is not None
    assert amx_disagreement(torch.full_like(b, float("nan")), b) is not None


def _library_has(marker: bytes) -> bool:
    from nsd.draftlen.calibrate import llama_library_files

    return any(marker in p.read_bytes() for p in llama_library_files() if p.name.startswith("libggml-cpu"))


@pytest.mark.skipif(not HAS_AMX, reason="this CPU reports no AMX: the small-batch path is part "
                    "of ggml's AMX backend, which scripts/install.sh does not build here")
def test_small_batch_vnni_path_matches_the_amx_tile_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/patches/ggml-amx-vnni-small-batch.patch sends Q4_0 matmuls over 2..10 tokens
    (``GGML_AMX_SMALL_M``, read on every call) to a VNNI kernel instead of the AMX tiles.
    Both compute the same int32 dot product per 32-weight block and scale it the same way,
    so the logits should agree to float rounding: on Qwen2.5-Coder-1.5B Q4_0 they were
    bit-identical for 2..12 tokens (benchmarks/verify_kernel.py). The bound 1e-3 leaves room
    for a compiler reordering the float scaling; a wrong unpack, offset or compensation moves
    logits by whole units. SmolLM2's Q4_0 copy has 576-wide rows, so the kernel's 32-column
    tail block is exercised as well as full 64-column blocks."""
    from nsd.models.weights import gguf_for

    assert _library_has(b"GGML_AMX_SMALL_M"), "the installed llama.cpp lacks the small-batch patch"
    with LlamaCppBackend(gguf_for(_model_path(), "q4_0"), n_threads=2, n_ctx=N_CTX) as b:
        assert "AMX" in b.weight_buffers, b.weight_buffers
        b.forward(PROMPT[:40])
        for n in (2, 3, 4, 5, 7, 10):
            out = {}
            for value in ("0", "10"):  # 0: the tile path for every batch
                monkeypatch.setenv("GGML_AMX_SMALL_M", value)
                out[value] = b.forward(DRAFT[:n])
                b.rewind(40)
            tiles, vnni = out["0"], out["10"]
            assert torch.isfinite(vnni).all()
            assert torch.equal(tiles.argmax(-1), vnni.argmax(-1)), n
            assert float((tiles - vnni).abs().max()) <= 1e-3, (n, float((tiles - vnni).abs().max()))
            # Non-vacuous: the rows differ from one another, so a kernel that wrote one row
            # everywhere (or nothing) would not pass.
            assert float((vnni[0] - vnni[-1]).abs().max()) > 1.0


HAS_AVX512_VNNI = {"avx512f", "avx512bw", "avx512dq", "avx512_vnni"} <= _cpu_flags()

# Runs in a child process: GGML_NO_AMX is read once, when llama.cpp first lists its weight
# layouts, which this test process has long done. Prints one JSON line.
_VNNI_CHILD = r"""
import json, os, sys
import torch
os.environ["GGML_NO_AMX"] = "1"
from nsd.backends.llama_cpp import LlamaCppBackend
path, prompt, draft = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
out = {}
for layouts in ("repack", "plain"):  # plain: no repacked layouts, only the Q8_0 head differs
    with LlamaCppBackend(path, n_threads=2, n_ctx=512, use_extra_bufts=layouts == "repack") as b:
        out[layouts] = list(b.weight_buffers)
        b.forward(prompt)
        for n in (1, 2, 3, 5, 9, 16, 24):
            got = {}
            for value in ("0", "default"):  # 0: ggml's own kernels; default: the patch's bounds
                if value == "default":
                    os.environ.pop("GGML_VNNI_SMALL_M", None)
                else:
                    os.environ["GGML_VNNI_SMALL_M"] = value
                got[value] = b.forward(draft[:n])
                b.rewind(len(prompt))
            torch.save(got, f"{sys.argv[4]}/{layouts}-{n}.pt")
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAS_AVX512_VNNI, reason="this CPU reports no AVX-512 VNNI: ggml keeps its "
                    "own kernels here (the small-batch patch compiles nothing)")
def test_small_batch_vnni_kernels_match_ggmls_repack_and_q8_0_kernels(tmp_path: Path) -> None:
    """scripts/patches/ggml-vnni-small-batch.patch sends products with repacked Q4_0
    weights (every x86 CPU without AMX; any number of rows, in groups of 16) and products
    over 1..16 rows with Q8_0 weights (the output head of nsd's Q4_0 files) to VNNI kernels
    that read each weight block once for all rows of a group. At 24 rows the Q4_0 layers
    take the new kernel and the head stays on llamafile's (both by the patch's defaults).
    They compute the same int32 dot product per 32-weight block as ggml's kernels; only the
    order of the float accumulation differs, and 30 layers amplify that: on SmolLM2 ggml's
    own repack and plain kernels differ by 0.44 logits at one token, ours and ggml's by a
    softmax total variation of 0.03-0.065 (Qwen2.5-Coder-1.5B: 0.019). So:

    * whole model, repacked layouts: the AMX comparison's bounds (TV 0.15, argmax only at
      near-ties). They catch a wrong unpack (checked: two activation quarters swapped gave
      TV 0.997); a compensation off by one per block stays inside them (TV 0.079), which
      is what the second check is for;
    * the Q8_0 head alone (no repacked layouts, so nothing upstream differs): logits within
      1e-3. Measured 2.7e-5; its compensation off by one gave 0.065 (checked).

    SmolLM2's Q4_0 copy keeps a Q8_0 head, so both kernels run; with AMX left out
    (GGML_NO_AMX=1) this runs on AMX machines as on CPUs without AMX."""
    import json
    import subprocess
    import sys

    from nsd.models.weights import gguf_for

    assert _library_has(b"GGML_VNNI_SMALL_M"), "the installed llama.cpp lacks the small-batch patch"
    draft = [(i * 104729) % 40000 + 100 for i in range(24)]
    proc = subprocess.run(
        [sys.executable, "-c", _VNNI_CHILD, str(gguf_for(_model_path(), "q4_0")),
         json.dumps(PROMPT[:40]), json.dumps(draft), str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "CPU_REPACK" in info["repack"] and "AMX" not in info["repack"], info
    assert info["plain"] == ["CPU_Mapped"], info
    for n in (1, 2, 3, 5, 9, 16, 24):
        got = torch.load(tmp_path / f"repack-{n}.pt")
        ggml, vnni = got["0"], got["default"]
        assert vnni.shape == (n, ggml.shape[1])
        assert amx_disagreement(vnni, ggml) is None, (n, amx_disagreement(vnni, ggml))
        # Non-vacuous: the two paths did run different kernels (their float sums differ),
        # and the rows differ from one another, so one row written everywhere would fail.
        assert not torch.equal(vnni, ggml), n
        if n > 1:
            assert float((vnni[0] - vnni[-1]).abs().max()) > 1.0
        head = torch.load(tmp_path / f"plain-{n}.pt")
        gap = float((head["0"] - head["default"]).abs().max())
        if n <= 16:
            assert 0 < gap <= 1e-3, (n, gap)
        else:  # above 16 rows the Q8_0 head keeps llamafile's kernel by default
            assert gap == 0, (n, gap)


def test_llama_generate_peer_prefills_every_prompt_in_full(gguf: Path) -> None:
    """The benchmark's llama.cpp peer must not reuse the previous call's KV cache: nsd's
    engine prefills each prompt in full, and a shared prefix would be free work."""
    from nsd.api import GenerationConfig
    from nsd.bench.llama_peer import LlamaGeneratePeer

    class Tok:
        def decode(self, tokens, skip_special_tokens=False):
            return " ".join(map(str, tokens))

    peer = LlamaGeneratePeer(str(gguf), Tok(), eos_token_ids=(), threads=2, n_ctx=N_CTX)
    evaluated: list[int] = []
    real_eval = peer.llm.eval
    peer.llm.eval = lambda tokens: (evaluated.append(len(tokens)), real_eval(tokens))[1]
    config = GenerationConfig(method="ar", temperature=0.0, max_new_tokens=3)
    first, _, _ = peer.generate(PROMPT, config)
    evaluated.clear()
    again, _, stats = peer.generate(PROMPT, config)  # same prompt: all of it cached
    assert evaluated[0] == len(PROMPT) and again == first
    assert stats.new_tokens == 3


def test_cached_tokens_follow_forward_rewind_and_reset(backend: LlamaCppBackend) -> None:
    backend.forward(PROMPT)
    backend.forward(DRAFT)
    assert backend.cached_tokens == PROMPT + DRAFT
    backend.rewind(len(PROMPT) + 2)
    assert backend.cached_tokens == PROMPT + DRAFT[:2]
    backend.reset()
    assert backend.cached_tokens == []


def test_saved_state_restores_the_same_logits(
    make: Callable[[], LlamaCppBackend], backend: LlamaCppBackend
) -> None:
    """A snapshot loaded back (here or into another context of the same model) gives the
    logits the saved cache would have given, bit for bit: the KV cells are the same."""
    backend.forward(PROMPT)
    tokens, state = backend.save_state()
    assert tokens == PROMPT and len(state) > 0
    expected = backend.forward(OTHER)
    backend.reset()
    backend.forward(DRAFT)  # something else in between
    backend.load_state(tokens, state)
    assert backend.num_cached == len(PROMPT) and backend.cached_tokens == PROMPT
    torch.testing.assert_close(backend.forward(OTHER), expected, atol=0, rtol=0)
    with make() as other:
        other.forward(OTHER)
        other.load_state(tokens, state)
        torch.testing.assert_close(other.forward(OTHER), expected, atol=0, rtol=0)
        other.load_state([], b"")
        assert other.num_cached == 0


def test_generation_after_a_reused_prefix_agrees_with_a_cold_one(gguf: Path) -> None:
    """Greedy decoding of a second turn on the warm cache versus from an empty cache. The
    prompt KV was computed in other batches (a 60-token prefill, then verification
    blocks), so logits differ by rounding; greedy tokens should agree, or at worst part
    late where two candidates are within rounding of each other."""
    from nsd.decode import DecodeConfig, decode, run_to_end
    from nsd.proposers.ngram import NgramProposer
    from nsd.rules.sampling import SamplingConfig

    config = DecodeConfig(sampling=SamplingConfig(), k=4, max_new_tokens=24)
    with LlamaCppBackend(gguf, n_threads=2, n_ctx=N_CTX) as warm, \
            LlamaCppBackend(gguf, n_threads=2, n_ctx=N_CTX) as cold:
        first, _ = run_to_end(decode(warm, PROMPT, config, NgramProposer()))
        second_prompt = PROMPT + first + OTHER
        warm_out, warm_stats = run_to_end(decode(warm, second_prompt, config, NgramProposer(),
                                                 reuse_cache=True))
        cold_out, cold_stats = run_to_end(decode(cold, second_prompt, config, NgramProposer()))
    assert warm_stats.cached_prompt_tokens >= len(PROMPT) + len(first) - 1
    assert cold_stats.cached_prompt_tokens == 0
    agree = next((i for i, (a, b) in enumerate(zip(warm_out, cold_out)) if a != b), len(cold_out))
    assert agree >= 16, (agree, warm_out, cold_out)


def test_calibration_key_names_the_weight_layouts_and_kernel_switches(
        gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step costs measured with one set of kernels must not be reused for another: the
    layouts llama.cpp chose and the patches' switches (GGML_NO_AMX, GGML_*_SMALL_M) are in
    the calibration key, as the library build is."""
    from nsd.draftlen.calibrate import calibration_key

    from nsd.draftlen.calibrate import _KERNEL_SWITCHES

    for name in _KERNEL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    with LlamaCppBackend(gguf, n_threads=2, n_ctx=N_CTX) as repack, \
            LlamaCppBackend(gguf, n_threads=2, n_ctx=N_CTX, use_extra_bufts=False) as plain:
        keys = {"repack": calibration_key(repack, gguf, 4), "plain": calibration_key(plain, gguf, 4)}
        monkeypatch.setenv("GGML_VNNI_SMALL_M", "0")
        keys["switched"] = calibration_key(repack, gguf, 4)
        # the AVX2 kernels' switches too: the row cap and the one-row (batch-invariant) step
        monkeypatch.setenv("GGML_AVX2_SMALL_MIN", "2")
        keys["avx2"] = calibration_key(repack, gguf, 4)
    assert "buffers=" in keys["repack"]["backend"]
    if repack.weight_buffers != plain.weight_buffers:
        assert keys["repack"] != keys["plain"]
    assert keys["switched"] != keys["repack"]
    assert keys["switched"]["backend"].endswith("GGML_VNNI_SMALL_M=0")
    assert keys["avx2"] != keys["switched"]
    assert keys["avx2"]["backend"].endswith("GGML_VNNI_SMALL_M=0,GGML_AVX2_SMALL_MIN=2")


def test_calibration_key_of_the_reduced_drafts_wrapper_names_the_wrapped_kernels(
        gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reduced draft runs llama.cpp behind an embedding-input wrapper; its cached step
    costs were once keyed by torch's version alone, so a rebuilt library or a kernel switch
    (GGML_VNNI_SMALL_M=0 in a benchmark) reused costs measured with other kernels."""
    from nsd.backends.embedding_input import EmbeddingInputBackend
    from nsd.draftlen.calibrate import calibration_key

    monkeypatch.delenv("GGML_VNNI_SMALL_M", raising=False)
    with LlamaCppBackend(gguf, n_threads=2, n_ctx=N_CTX) as inner:
        wrapped = EmbeddingInputBackend.__new__(EmbeddingInputBackend)
        wrapped.model = inner  # the key reads the wrapped model only
        plain = calibration_key(wrapped, gguf, 2)
        monkeypatch.setenv("GGML_VNNI_SMALL_M", "0")
        switched = calibration_key(wrapped, gguf, 2)
        inner_key = calibration_key(inner, gguf, 2)
    assert plain["backend"].startswith("EmbeddingInputBackend[LlamaCppBackend/")
    assert "build=" in plain["backend"] and plain["threads"] == 2
    assert switched != plain and switched["backend"] == f"EmbeddingInputBackend[{inner_key['backend']}]"


def test_sequences_batched_in_one_decode_match_each_alone(make: Callable[[], LlamaCppBackend]) -> None:
    """forward_many: three sequences' tokens in one llama_decode give each the logits it
    gets alone up to the rounding of a different batching (llama.cpp's kernels accumulate a
    batch of 60 rows in another order than one of 20: same argmax, softmax within 0.05 in
    total variation; 0.021 at most measured on SmolLM2 Q4_1, Zen 4), and rewinding, snapshotting or resetting one sequence leaves the
    others as they were."""
    prompts = [PROMPT[:20], PROMPT[20:29], PROMPT[29:60]]
    steps = [DRAFT[:4], OTHER[:1], DRAFT[4:8]]
    with make() as multi, make() as single:
        multi.set_sequences(3)
        assert multi.n_sequences == 3 and multi.n_ctx >= N_CTX
        first = multi.forward_many([(s, p, s != 1) for s, p in enumerate(prompts)])
        second = multi.forward_many([(2, steps[2], True), (0, steps[0], True), (1, steps[1], True)])
        assert [multi.seq_num_cached(s) for s in range(3)] == \
            [len(p) + len(d) for p, d in zip(prompts, steps)]
        for s in range(3):
            single.reset()
            alone_prompt = single.forward(prompts[s], all_logits=s != 1)
            alone_step = single.forward(steps[s])
            for got, want in ((first[s], alone_prompt), (second[(2, 0, 1).index(s)], alone_step)):
                assert torch.equal(got.argmax(-1), want.argmax(-1))
                tv = 0.5 * (got.softmax(-1) - want.softmax(-1)).abs().sum(-1)
                assert float(tv.max()) < 0.05
            assert multi.seq_cached_tokens(s) == prompts[s] + steps[s]
        # One sequence's rewind, snapshot into another, and reset touch nothing else.
        multi.rewind(len(prompts[0]), seq=0)
        tokens, state = multi.save_state(seq=2)
        multi.load_state(tokens, state, seq=1)
        assert multi.seq_cached_tokens(1) == prompts[2] + steps[2]
        multi.reset(seq=0)
        assert [multi.seq_num_cached(s) for s in range(3)] == [0] + [len(prompts[2]) + len(steps[2])] * 2
        after = multi.forward_many([(1, OTHER, True), (2, OTHER, True)])
        assert torch.equal(after[0].argmax(-1), after[1].argmax(-1))
        assert float((0.5 * (after[0].softmax(-1) - after[1].softmax(-1)).abs().sum(-1)).max()) < 0.05
        with pytest.raises(ValueError, match="each must appear once"):
            multi.forward_many([(0, OTHER, True), (0, OTHER, True)])
