"""Sweep draft length k for SD and NSD (draft model and n-gram proposers) against AR.

All configurations run interleaved prompt by prompt in one process on the same loaded
models, so machine drift hits them alike. Prints a Markdown table; writes JSON to --out.

    python benchmarks/k_sweep.py --prompts 4 --max-new-tokens 128 --out k_sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from nsd.aggregate import speedup
import dataclasses

from nsd.api import BackendOptions, GenerationConfig, load_engine
from nsd.bench.datasets import DatasetConfig, load_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--ks", default="1,2,3,4,6")
    ap.add_argument("--theta", type=float, default=0.9)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="also run the draft-model configs with a reduced draft vocabulary")
    ap.add_argument("--proposers", default="draft,ngram")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    options = BackendOptions(threads=args.threads)
    # The baseline drafts with the full vocabulary (draft_vocab 0): --draft-vocab auto, the
    # default, would already reduce the built-in pair's draft.
    engines = {"": load_engine(args.target, draft=args.draft, proposer="draft",
                               options=dataclasses.replace(options, draft_vocab=0))}
    if args.draft_vocab:
        engines[f"-v{args.draft_vocab}"] = load_engine(
            args.target, draft=args.draft, proposer="draft",
            options=dataclasses.replace(options, draft_vocab=args.draft_vocab))
    prompts = load_prompts(DatasetConfig(names=(args.dataset,), limit=args.prompts))
    ks = [int(k) for k in args.ks.split(",")]
    proposers = args.proposers.split(",")
    runs = [("ar", "draft", 1, "")] + [(m, p, k, tag) for p in proposers for tag in engines
                                       if p == "draft" or not tag for m in ("sd", "nsd") for k in ks]
    rates: dict[str, list[float]] = {}
    taus: dict[str, list[float]] = {}
    for prompt in prompts:
        ids = engines[""].encode(prompt.text, chat=prompt.chat)
        for method, proposer, k, tag in runs:
            engine = engines[tag]
            engine.use_proposer(proposer)
            cfg = GenerationConfig(method=method, theta=args.theta, k=k, temperature=args.temperature,
                                   max_new_tokens=args.max_new_tokens)
            stats = engine.generate(ids, cfg).stats
            name = "ar" if method == "ar" else f"{method}/{proposer}{tag}/k={k}"
            rates.setdefault(name, []).append(stats.tokens_per_s)
            taus.setdefault(name, []).append(stats.tau)
    print("| config | tok/s (median) | speedup vs AR (paired) | tau |\n|---|---|---|---|")
    rows = []
    for name, r in rates.items():
        med = statistics.median(r)
        ratio = speedup(r, rates["ar"])  # every config ran every prompt, in prompt order
        rows.append({"config": name, "tokens_per_s": med, "speedup_vs_ar": ratio,
                     "tau": statistics.mean(taus[name])})
        print(f"| {name} | {med:.1f} | {ratio:.2f}x | {statistics.mean(taus[name]):.2f} |")
    if args.out:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(args.out)) or ".")
        with os.fdopen(fd, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
