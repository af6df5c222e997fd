"""Step costs c(n) of Qwen2.5 architectures on whatever device is present, plus nsd's own
per-pass overhead: the numbers a GPU speedup prediction needs (:mod:`nsd.bench.gpu_predict`).
``benchmarks/gpu_costs.py`` is the command.

Models are built from the public Qwen2.5 configs with random weights (no downloads): the
cost of a forward depends on the shapes, not on the weight values. For each model:

* ``c(n)``: median wall time of one ``forward`` of ``n`` new tokens (logits for all of
  them) through nsd's transformers backend, with the static KV cache already holding
  ``context`` tokens and a rewind back to them before every call. Modes: ``eager``; on
  CUDA also ``cudagraph`` (captured CUDA graphs) and ``torch`` (torch.compile,
  reduce-overhead). CUDA is synchronised before and after every timed call.
* nsd's overhead per pass: ``logits_to_probs`` + ``verify`` on ``[k + 1, V]`` logits on
  the same device (greedy and sampled, exact and nucleus rules).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from nsd.draftlen.machine import cpu_description
from nsd.backends.hf import HFBackend
from nsd.rules.sampling import SamplingConfig, logits_to_probs, plausibility_probs
from nsd.rules.entry import verify
from nsd.rules.verify import RuleConfig

VOCAB = 151936
# Public Qwen2.5 configs (config.json of the base models); 0.5B and 1.5B tie embeddings.
ARCHS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=VOCAB,
                         tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=VOCAB,
                         tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=VOCAB,
                       tie_word_embeddings=False),
    # Not a real model: exercises this script in seconds (tests, smoke runs).
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=1024,
                 tie_word_embeddings=True),
}
DEFAULT_MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b")
OVERHEAD_KS = (1, 4, 8, 16)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build parameters directly in ``dtype`` (a 7B in float32 first would need 30 GB)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(arch: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**ARCHS[arch], max_position_embeddings=32768, rope_theta=1e6,
                         rms_norm_eps=1e-6, use_sliding_window=False)
    torch.manual_seed(0)
    with _default_dtype(dtype), torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_costs(model: torch.nn.Module, mode: str, ns: list[int], context: int, reps: int,
               warmup: int) -> dict[int, float]:
    """Median seconds of one forward of n tokens after ``context`` cached tokens."""
    backend = HFBackend.from_model(model, max_len=context + max(ns) + 1,
                                   compile="none" if mode == "eager" else mode)
    vocab = backend.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
    new = torch.randint(0, vocab, (max(ns),), generator=gen).tolist()
    backend.forward(prompt, all_logits=False)
    costs: dict[int, float] = {}
    for n in ns:
        def call() -> None:
            backend.forward(new[:n])
            backend.rewind(context)
        # Graphed modes capture or compile on their first calls: warm up more.
        costs[n] = _median_s(call, backend.device, reps, warmup if mode == "eager" else warmup + 3)
    return costs


def overhead_costs(vocab: int, device: torch.device, reps: int) -> dict[str, dict[int, float]]:
    """Seconds of nsd's own work per target pass: sampling transform + verification."""
    gen = torch.Generator().manual_seed(2)
    out: dict[str, dict[int, float]] = {}
    cases = {
        "greedy_exact": (SamplingConfig(), RuleConfig(kind="exact")),
        "greedy_nucleus": (SamplingConfig(), RuleConfig(kind="nucleus", theta=0.9)),
        "sampled_nucleus": (SamplingConfig(temperature=1.0, top_p=0.95), RuleConfig(kind="nucleus", theta=0.9)),
    }
    for name, (sampling, rule) in cases.items():
        out[name] = {}
        for k in OVERHEAD_KS:
            logits = (3 * torch.randn(k + 1, vocab, generator=gen)).to(device)  # [k+1, V]
            draft_logits = (3 * torch.randn(k, vocab, generator=gen)).to(device)  # [k, V]
            draft_tokens = draft_logits.argmax(-1)  # [k]
            draft_probs = None if sampling.greedy else logits_to_probs(draft_logits, sampling)

            def one_pass() -> None:
                target_probs = logits_to_probs(logits, sampling)  # [k+1, V]
                plaus = plausibility_probs(logits[:k], sampling, target_probs[:k])
                result = verify(rule, target_probs.unsqueeze(0), plaus.unsqueeze(0),
                                draft_tokens.unsqueeze(0),
                                None if draft_probs is None else draft_probs.unsqueeze(0),
                                torch.rand(1, k, dtype=torch.float64, generator=gen).to(device),
                                torch.rand(1, dtype=torch.float64, generator=gen).to(device),
                                torch.zeros(1, dtype=torch.float64, device=device))
                int(result.num_accepted[0])  # the loop reads it on the host: a sync, as in decode
            try:
                out[name][k] = _median_s(one_pass, device, reps, warmup=2)
            except RuntimeError as exc:  # e.g. a verifier not yet device-aware
                out[name][k] = float("nan")
                print(f"  overhead {name} k={k}: failed on {device}: {exc}", file=sys.stderr)
    return out


def cpu_name() -> str:
    """This machine's CPU model, as calibration records it."""
    return cpu_description()["model"]


def machine(device: torch.device) -> dict[str, Any]:
    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
            "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def measure(models: list[str], device: torch.device, dtype: torch.dtype, ns: list[int], context: int,
            reps: int, warmup: int, modes: list[str], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Step costs of each model in each mode, and nsd's per-pass overhead: the report
    ``gpu_costs.py`` writes (progress lines go to ``log``)."""
    results: dict[str, Any] = {}
    for arch in models:
        start = time.perf_counter()
        model = build_model(arch, dtype, device)
        params = sum(p.numel() for p in model.parameters())
        entry: dict[str, Any] = {"params": params, "ms": {}, "errors": {}}
        for mode in modes:
            try:
                costs = step_costs(model, mode, ns, context, reps, warmup)
            except Exception as exc:  # a graph mode that fails here is reported, not fatal
                if mode == "eager":
                    raise
                entry["errors"][mode] = f"{type(exc).__name__}: {exc}"[:500]
                log(f"  {arch} {mode}: FAILED {entry['errors'][mode]}")
                continue
            entry["ms"][mode] = {n: 1e3 * s for n, s in costs.items()}
            row = " ".join(f"{n}:{1e3 * s:.2f}" for n, s in costs.items())
            log(f"  {arch} ({params / 1e9:.2f}B) {mode:9s} ms  {row}")
        results[arch] = entry
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log(f"  {arch}: {time.perf_counter() - start:.0f}s")

    overhead = overhead_costs(ARCHS[models[0]]["vocab_size"], device, reps=max(reps, 5))
    log("  nsd overhead ms per pass (k=" + ",".join(map(str, OVERHEAD_KS)) + "): " +
        "; ".join(f"{name} " + " ".join(f"{1e3 * s:.2f}" for s in row.values())
                  for name, row in overhead.items()))
    return {
        "what": "measured step costs c(n) (ms per forward of n new tokens) of random-weight "
                "models with Qwen2.5 shapes, and nsd's per-pass overhead; not end-to-end runs",
        "machine": machine(device), "dtype": str(dtype).removeprefix("torch."),
        "context": context, "ns": ns, "reps": reps, "modes": modes, "models": results,
        "overhead_ms": {name: {k: 1e3 * s for k, s in row.items()} for name, row in overhead.items()},
        "overhead_vocab": ARCHS[models[0]]["vocab_size"],
    }
