"""The transformers backend on a tiny random Qwen2: static KV cache (rewind-and-refeed
equals a fresh forward, rewind copies nothing), device and dtype selection, the
model-object API, greedy SD == AR, and a device-clean decoding loop."""

from __future__ import annotations

import math
import string

import pytest
import torch

from mock import CharTokenizer, MockLM
from nsd.api import BackendOptions, Engine, GenerationConfig
from nsd.backends.hf import HFBackend, resolve_device, resolve_dtype
from nsd.decode import DecodeConfig, decode, run_to_end
from nsd.errors import NSDError
from nsd.proposers.draft_model import DraftModelProposer
from nsd.rules.sampling import SamplingConfig, logits_to_probs, sample_from
from nsd.rules.verify import RuleConfig

transformers = pytest.importorskip("transformers")

VOCAB = 97


def tiny_qwen2(seed: int, layers: int = 2, hidden: int = 64) -> torch.nn.Module:
    config = transformers.Qwen2Config(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def target_model() -> torch.nn.Module:
    return tiny_qwen2(seed=0)


def _tokens(n: int, seed: int = 1) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _fresh_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([tokens])).logits[0].float()  # [n, V], no cache at all


@pytest.mark.parametrize("graph_shapes", [False, True])
def test_rewind_and_refeed_equals_fresh_forward(target_model, graph_shapes: bool) -> None:
    backend = HFBackend.from_model(target_model, max_len=64)
    if graph_shapes:  # the fixed-shape path torch.compile would graph, run uncompiled
        backend._graphed = backend._static_step
    seq = _tokens(24)
    ref = _fresh_logits(target_model, seq)
    backend.forward(seq[:10], all_logits=False)
    rejected = backend.forward([3, 4, 5, 6, 7])  # a block that gets rejected
    assert backend.num_cached == 15 and rejected.shape == (5, VOCAB)
    backend.rewind(10)
    torch.testing.assert_close(backend.forward(seq[10:15]), ref[10:15], rtol=1e-4, atol=1e-5)
    backend.rewind(12)  # partial accept: keep two, refeed from there
    torch.testing.assert_close(backend.forward(seq[12:20]), ref[12:20], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(backend.forward([seq[20]]), ref[20:21], rtol=1e-4, atol=1e-5)
    backend.reset()
    torch.testing.assert_close(backend.forward(seq), ref, rtol=1e-4, atol=1e-5)


def test_rewind_is_o1_and_copies_nothing(target_model) -> None:
    backend = HFBackend.from_model(target_model, max_len=48)
    cache = backend.cache
    assert cache.storage.shape == (2, 2, 1, 2, 48, 16)  # [layers, 2, 1, kv_heads, max_len, head_dim]
    address = cache.storage.data_ptr()
    backend.forward(_tokens(20))
    before = cache.storage.clone()
    backend.rewind(7)
    assert cache.storage.data_ptr() == address and torch.equal(cache.storage, before)
    assert backend.num_cached == 7
    backend.forward(_tokens(3, seed=2))
    backend.reset()
    assert cache.storage.data_ptr() == address and backend.num_cached == 0
    with pytest.raises(ValueError):
        backend.rewind(1)


def test_context_overflow_is_a_clear_error(target_model) -> None:
    backend = HFBackend.from_model(target_model, max_len=8)
    backend.forward(_tokens(6))
    with pytest.raises(NSDError, match="exceeds the context"):
        backend.forward(_tokens(3))


def test_compiled_path_traces_and_matches(target_model) -> None:
    """torch.compile's tracing of the fixed-shape step (no code generation: CPU CI)."""
    backend = HFBackend.from_model(target_model, max_len=40)
    backend._graphed = torch.compile(backend._static_step, backend="eager", dynamic=False)
    seq = _tokens(16)
    ref = _fresh_logits(target_model, seq)
    backend.forward(seq[:10], all_logits=False)
    backend.forward([1, 2, 3])
    backend.rewind(10)
    torch.testing.assert_close(backend.forward(seq[10:13]), ref[10:13], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(backend.forward([seq[13]]), ref[13:14], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's behaviour")
def test_device_selection_without_cuda() -> None:
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(NSDError, match="no CUDA"):
        resolve_device("cuda")
    with pytest.raises(NSDError, match="no CUDA"):
        BackendOptions(backend="hf", device="cuda")
    with pytest.raises(NSDError, match="unknown device"):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's behaviour")
def test_cli_device_cuda_without_gpu_exits_2(capsys) -> None:
    from nsd.cli import main

    assert main(["generate", "--target", "x", "--backend", "hf", "--device", "cuda", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA" in err and "Traceback" not in err


def test_from_model_refuses_training_mode() -> None:
    model = tiny_qwen2(seed=0).train()
    with pytest.raises(NSDError, match="eval"):
        HFBackend.from_model(model)


def test_engine_from_models_greedy_sd_equals_ar(target_model) -> None:
    draft_model = tiny_qwen2(seed=0, layers=1)  # shares the target's embeddings' seed: some agreement
    engine = Engine.from_models(target_model, CharTokenizer(string.printable[:VOCAB]), draft_model=draft_model, max_len=128)
    assert isinstance(engine.target, HFBackend) and engine.target.cache is not None
    prompt = "def f(x):"
    ar = engine.generate(prompt, GenerationConfig(method="ar", max_new_tokens=40))
    sd = engine.generate(prompt, GenerationConfig(method="sd", k=4, max_new_tokens=40))
    assert sd.token_ids == ar.token_ids and len(ar.token_ids) == 40
    assert sd.stats.deviation == 0.0 and sd.stats.drafted_tokens > 0
    assert sd.stats.target_passes < ar.stats.target_passes or sd.stats.accepted_tokens == 0
    nsd = engine.generate(prompt, GenerationConfig(method="nsd", theta=0.9, k=4, max_new_tokens=40))
    # Greedy: every relaxed accept swaps the argmax for another nucleus token, E = 1 each.
    assert nsd.stats.deviation == pytest.approx(nsd.stats.relaxed_accepts)
    assert nsd.stats.accepted_tokens >= sd.stats.accepted_tokens or nsd.stats.relaxed_accepts > 0
    self_draft = Engine.from_models(target_model, CharTokenizer(string.printable[:VOCAB]), draft_model=target_model)
    same = self_draft.generate(prompt, GenerationConfig(method="sd", k=4, max_new_tokens=20))
    assert same.token_ids == ar.token_ids[:20]
    assert same.stats.accepted_tokens == same.stats.drafted_tokens


def test_engine_from_models_accepts_backends() -> None:
    engine = Engine.from_models(MockLM(seed=1), CharTokenizer(), proposer="ngram")
    result = engine.generate("abcabcabc", GenerationConfig(method="sd", max_new_tokens=12))
    assert len(result.token_ids) == 12
    with pytest.raises(NSDError, match="draft"):
        Engine.from_models(MockLM(), CharTokenizer(), proposer="draft")


def test_decoding_loop_creates_no_default_device_tensors() -> None:
    """With the default device set to "meta", any tensor the loop creates without naming a
    device becomes a meta tensor and the run fails; logits here live on the CPU, so a
    clean loop runs unchanged (on CUDA it is the same code with another logits device)."""
    sample = SamplingConfig(temperature=0.8, top_p=0.9)
    target, draft = MockLM(seed=2), MockLM(seed=3)
    expected, _ = run_to_end(decode(target, [1, 2, 3], DecodeConfig(speculative=False, sampling=sample,
                                                                      max_new_tokens=10, seed=4)))
    proposer = DraftModelProposer(draft, sample, target.vocab_size)
    with torch.device("meta"):
        tokens, stats = run_to_end(decode(target, [1, 2, 3], DecodeConfig(
            speculative=False, sampling=sample, max_new_tokens=10, seed=4)))
        probs = logits_to_probs(target.logits_after([1, 2]), sample).unsqueeze(0)
        drawn = sample_from(probs, torch.rand(1, dtype=torch.float64, device="cpu"))
        proposal = proposer.propose([1, 2, 3], 3, torch.Generator().manual_seed(0))
    assert tokens == expected and stats.new_tokens == 10
    assert drawn.device.type == "cpu" and proposal.tokens.device.type == "cpu"
    assert proposal.probs is not None and proposal.probs.device.type == "cpu"


@pytest.mark.parametrize("method", ["sd", "nsd", "nsd-budget"])
def test_speculative_loop_creates_no_default_device_tensors(method: str) -> None:
    """The same check through verification (device-aware verify.py): SD, NSD and a
    budgeted NSD run under a "meta" default device exactly as they do without it."""
    sample = SamplingConfig(temperature=0.8, top_p=0.9)
    kind = "exact" if method == "sd" else "nucleus"
    rule = RuleConfig(kind=kind, theta=0.9, budget=0.5 if method == "nsd-budget" else math.inf)
    config = DecodeConfig(rule=rule, sampling=sample, k=3, max_new_tokens=12, seed=5)

    def models():  # built outside the meta context: the models' weights live on the CPU
        return MockLM(seed=2), DraftModelProposer(MockLM(seed=3), sample, 16)

    target, proposer = models()
    expected, expected_stats = run_to_end(decode(target, [1, 2, 3], config, proposer))
    target, proposer = models()
    with torch.device("meta"):
        tokens, stats = run_to_end(decode(target, [1, 2, 3], config, proposer))
    assert tokens == expected and stats.deviation == expected_stats.deviation
