"""Step costs c(n) of Qwen2.5 architectures on whatever device is present, plus nsd's own
per-pass overhead — the numbers a GPU speedup prediction needs (see gpu_predict.py).

Models are built from the public Qwen2.5 configs with random weights (no downloads): the
cost of a forward depends on the shapes, not on the weight values. For each model:

* ``c(n)``: median wall time of one ``forward`` of ``n`` new tokens (logits for all of
  them) through nsd's transformers backend, with the static KV cache already holding
  ``--context`` tokens and a rewind back to them before every call; n = 1..17. Modes:
  ``eager`` always; on CUDA also ``cudagraph`` (captured CUDA graphs) and, with
  ``--torch-compile``, ``torch`` (torch.compile, reduce-overhead). CUDA is synchronised
  before and after every timed call.
* nsd's overhead per pass: ``logits_to_probs`` + ``verify`` on ``[k + 1, V]`` logits on
  the same device (greedy and sampled, exact and nucleus rules).

    python benchmarks/gpu_costs.py                 # all three models, n = 1..17
    python benchmarks/gpu_costs.py --quick         # 0.5B only, n in {1, 2, 5}: a smoke test

Writes ``benchmarks/results/gpu_costs_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from nsd.backends.hf import HFBackend, resolve_device, resolve_dtype
from nsd.machine import cpu_description
from nsd.sampling import SamplingConfig, logits_to_probs, plausibility_probs
from nsd.verify import RuleConfig, verify

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


def _cpu_name() -> str:
    return cpu_description()["model"]


def machine(device: torch.device) -> dict[str, Any]:
    info = {"cpu": _cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--models", default=None, help=f"comma-separated, from {', '.join(ARCHS)}")
    parser.add_argument("--max-n", type=int, default=17, help="measure n = 1..max_n")
    parser.add_argument("--context", type=int, default=512, help="tokens already in the KV cache")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per n (10; 3 with --quick)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="0.5B only, n in {1, 2, 5}, 3 reps: a smoke run")
    parser.add_argument("--no-graphs", action="store_true", help="eager only, even on CUDA")
    parser.add_argument("--torch-compile", action="store_true",
                        help="also time torch.compile graphs on CUDA (minutes of compile time)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/results/gpu_costs_<device>.json")
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    models = args.models.split(",") if args.models else (["qwen2.5-0.5b"] if args.quick else list(DEFAULT_MODELS))
    unknown = [m for m in models if m not in ARCHS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(ARCHS)}")
    ns = [1, 2, 5] if args.quick else list(range(1, args.max_n + 1))
    reps = args.reps or (3 if args.quick else 10)
    modes = ["eager"]
    if device.type == "cuda" and not args.no_graphs:
        modes.append("cudagraph")
        if args.torch_compile:
            modes.append("torch")
    print(f"device {device} ({machine(device).get('gpu', _cpu_name())}), dtype "
          f"{str(dtype).removeprefix('torch.')}, context {args.context}, n = {ns}, modes {modes}",
          flush=True)

    results: dict[str, Any] = {}
    for arch in models:
        start = time.perf_counter()
        model = build_model(arch, dtype, device)
        params = sum(p.numel() for p in model.parameters())
        entry: dict[str, Any] = {"params": params, "ms": {}, "errors": {}}
        for mode in modes:
            try:
                costs = step_costs(model, mode, ns, args.context, reps, args.warmup)
            except Exception as exc:  # a graph mode that fails here is reported, not fatal
                if mode == "eager":
                    raise
                entry["errors"][mode] = f"{type(exc).__name__}: {exc}"[:500]
                print(f"  {arch} {mode}: FAILED {entry['errors'][mode]}", flush=True)
                continue
            entry["ms"][mode] = {n: 1e3 * s for n, s in costs.items()}
            row = " ".join(f"{n}:{1e3 * s:.2f}" for n, s in costs.items())
            print(f"  {arch} ({params / 1e9:.2f}B) {mode:9s} ms  {row}", flush=True)
        results[arch] = entry
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"  {arch}: {time.perf_counter() - start:.0f}s", flush=True)

    overhead = overhead_costs(ARCHS[models[0]]["vocab_size"], device, reps=max(reps, 5))
    print("  nsd overhead ms per pass (k=" + ",".join(map(str, OVERHEAD_KS)) + "): " +
          "; ".join(f"{name} " + " ".join(f"{1e3 * s:.2f}" for s in row.values())
                    for name, row in overhead.items()), flush=True)
    report = {
        "what": "measured step costs c(n) (ms per forward of n new tokens) of random-weight "
                "models with Qwen2.5 shapes, and nsd's per-pass overhead; not end-to-end runs",
        "machine": machine(device), "dtype": str(dtype).removeprefix("torch."),
        "context": args.context, "ns": ns, "reps": reps, "modes": modes, "models": results,
        "overhead_ms": {name: {k: 1e3 * s for k, s in row.items()} for name, row in overhead.items()},
        "overhead_vocab": ARCHS[models[0]]["vocab_size"],
    }
    out = args.out or Path(__file__).resolve().parent / "results" / f"gpu_costs_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
