"""Cost of one verification step, per backend: a forward of k new tokens after a prompt.

For each model (target, then draft) this measures, in one run:

* ``cost(k)``: wall time of one ``forward`` of ``k`` new tokens with logits for all of
  them, after a ~260-token code prompt, for k = 1, 2, 4, 8, 16 — the median over
  repetitions, with ``rewind`` back to the prompt before each call. Backends are
  interleaved within every repetition so that they share the machine's drift.
* plain autoregressive tokens/s through each backend (one token per forward, greedy);
* llama.cpp's own greedy decoding speed through ``llama_cpp.Llama`` (the "native"
  baseline our Python loop has to compete with).

Backends: the llama.cpp backend always; the transformers backend in float32 and bfloat16
when ``nsd.backends.hf`` is importable (unless ``--no-hf``).

Usage::

    python benchmarks/step_costs.py --target qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --threads 2 --out results/step_costs.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from nsd.backends.base import ModelBackend
from nsd.backends.llama_cpp import LlamaCppBackend
from nsd.draftlen.machine import cpu_description

KS = (1, 2, 4, 8, 16)

# A realistic code prompt: 263 tokens for the Qwen2.5 tokenizer.
PROMPT_TEXT = '''import json
import os
from dataclasses import dataclass
from typing import Iterable


@dataclass
class Record:
    """One row of the inventory file."""

    sku: str
    name: str
    quantity: int
    unit_price: float

    @property
    def total(self) -> float:
        return self.quantity * self.unit_price


def load_records(path: str) -> list[Record]:
    """Read a JSON list of records, skipping rows without a SKU."""
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)
    records = []
    for row in rows:
        if not row.get("sku"):
            continue
        records.append(Record(row["sku"], row["name"], int(row["quantity"]), float(row["unit_price"])))
    return records


def low_stock(records: Iterable[Record], threshold: int = 5) -> list[Record]:
    """Records whose quantity is below ``threshold``, most urgent first."""
    return sorted((r for r in records if r.quantity < threshold), key=lambda r: r.quantity)


def summarize(records: Iterable[Record]) -> dict[str, float]:
    """Total stock value and the number of distinct SKUs, for the report header."""
'''


@dataclass
class Candidate:
    """One backend under test and its timings."""

    name: str
    backend: ModelBackend
    times: dict[int, list[float]] = field(default_factory=lambda: {k: [] for k in KS})


def _resolve_gguf(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    from nsd.models.registry import resolve_model

    resolved = resolve_model(spec)
    if resolved.gguf_path is None:
        sys.exit(f"{spec}: the benchmark needs a GGUF model (registry name or .gguf file)")
    return resolved.gguf_path


def _tokenize(gguf: Path, text: str) -> list[int]:
    import llama_cpp

    vocab = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    return vocab.tokenize(text.encode(), add_bos=False, special=False)


def _greedy_continuation(backend: ModelBackend, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens after ``prompt``: realistic ids for the k-token forwards."""
    backend.reset()
    last = backend.forward(prompt, all_logits=False)[-1]
    out: list[int] = []
    for _ in range(n):
        out.append(int(last.argmax()))
        last = backend.forward([out[-1]])[-1]
    return out


def _ar_tokens_per_s(backend: ModelBackend, prompt: list[int], n: int) -> float:
    """Plain greedy decoding through the backend, one forward per token."""
    backend.reset()
    last = backend.forward(prompt, all_logits=False)[-1]
    start = time.perf_counter()
    for _ in range(n):
        last = backend.forward([int(last.argmax())])[-1]
    return n / (time.perf_counter() - start)


def _native_tokens_per_s(gguf: Path, prompt: list[int], n: int, threads: int) -> float:
    """llama.cpp's own greedy loop (high-level ``Llama.generate``), decode steps only."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    stamps: list[float] = []
    for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) == n + 1:
            break
    del llm
    # The first token's time includes the prompt; count the n steps after it.
    return n / (stamps[-1] - stamps[0])


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (from /proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_model(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    gguf = _resolve_gguf(spec)

    candidates = [
        Candidate("llama.cpp", LlamaCppBackend(gguf, n_threads=args.threads, n_ctx=1024)),
        # Without weight repacking (what a build with AMX kernels would need).
        Candidate("llama.cpp no-repack", LlamaCppBackend(gguf, n_threads=args.threads,
                                                         n_ctx=1024, use_extra_bufts=False)),
    ]
    prompt = _tokenize(gguf, PROMPT_TEXT)  # after a backend exists: its log sink is quieter
    print(f"\n## {spec}  ({gguf.name}, prompt {len(prompt)} tokens, {args.threads} threads)",
          flush=True)
    if not args.no_hf:
        try:
            from nsd.backends.hf import HFBackend
            from nsd.models.hf_convert import ensure_hf_folder
        except ImportError:
            print("(transformers backend not available; skipped)")
        else:
            hf_dir = ensure_hf_folder(str(gguf) if Path(spec).is_file() else spec)
            for dtype in (torch.float32, torch.bfloat16):
                label = "torch " + str(dtype).removeprefix("torch.")
                candidates.append(Candidate(label, HFBackend(hf_dir, dtype=dtype,
                                                             n_threads=args.threads)))

    new_tokens = _greedy_continuation(candidates[0].backend, prompt, max(KS))
    for cand in candidates:  # prefill once; every timed call rewinds back to here
        cand.backend.reset()
        cand.backend.forward(prompt, all_logits=False)
        for k in KS:  # warm-up: first calls of a shape allocate buffers
            cand.backend.forward(new_tokens[:k])
            cand.backend.rewind(len(prompt))

    # Other processes on the machine distort CPU timings badly (llama.cpp's threads spin
    # at barriers), so every repetition records how much CPU others used meanwhile.
    foreign_cpu_s: list[float] = []
    for rep in range(args.reps):
        busy0, own0 = _busy_cpu_s(), _own_cpu_s()
        for cand in candidates:
            for k in KS:
                cand.times[k].append(_timed(lambda: cand.backend.forward(new_tokens[:k])))
                cand.backend.rewind(len(prompt))
        foreign = max(0.0, (_busy_cpu_s() - busy0) - (_own_cpu_s() - own0))
        foreign_cpu_s.append(foreign)
        print(f"  rep {rep + 1}/{args.reps} done (other processes used {foreign:.1f} CPU s)",
              file=sys.stderr, flush=True)

    result: dict[str, Any] = {"model": spec, "gguf": gguf.name, "prompt_tokens": len(prompt),
                              "foreign_cpu_s_per_rep": foreign_cpu_s, "backends": {}}
    for cand in candidates:
        ms = {k: 1000 * statistics.median(cand.times[k]) for k in KS}
        ar = _ar_tokens_per_s(cand.backend, prompt, args.ar_tokens)
        result["backends"][cand.name] = {
            "ms": ms, "ratio": {k: ms[k] / ms[1] for k in KS}, "ar_tokens_per_s": ar,
            "raw_s": cand.times,
        }
    result["native_llama_tokens_per_s"] = _native_tokens_per_s(
        gguf, prompt, args.native_tokens, args.threads)

    del candidates
    gc.collect()
    return result


def markdown(results: list[dict[str, Any]]) -> str:
    head = "| model | backend | AR tok/s | " + " | ".join(f"k={k} ms" for k in KS)
    head += " | " + " | ".join(f"c({k})/c(1)" for k in KS[1:]) + " |"
    lines = [head, "|" + "---|" * (3 + 2 * len(KS) - 1)]
    for res in results:
        for name, b in res["backends"].items():
            cells = [res["model"], name, f"{b['ar_tokens_per_s']:.1f}"]
            cells += [f"{b['ms'][k]:.1f}" for k in KS]
            cells += [f"{b['ratio'][k]:.2f}" for k in KS[1:]]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append(f"| {res['model']} | llama.cpp native `Llama.generate` | "
                     f"{res['native_llama_tokens_per_s']:.1f} |" + " |" * (2 * len(KS) - 1))
    return "\n".join(lines)


def _cpu_name() -> str:
    return cpu_description()["model"]


def write_json_atomically(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct",
                        help="registry name or .gguf path")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct",
                        help="registry name or .gguf path ('' to skip)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--ar-tokens", type=int, default=64,
                        help="tokens for the per-backend AR speed")
    parser.add_argument("--native-tokens", type=int, default=128,
                        help="tokens for llama.cpp's own generation speed")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers backend")
    parser.add_argument("--out", type=Path, default=Path("results/step_costs.json"))
    args = parser.parse_args()

    results = [measure_model(spec, args) for spec in (args.target, args.draft) if spec]
    table = markdown(results)
    print("\n" + table)
    write_json_atomically(args.out, {
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(),
                    "threads": args.threads, "torch": torch.__version__},
        "ks": list(KS), "reps": args.reps, "results": results, "table": table,
    })
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
