"""A reduced draft output head (``--draft-vocab N``) against the full draft, side by side.

Three measurements, all in one process, interleaved:

* ``steps``: the draft's bytes read per token (every tensor but the input table, plus one
  input row) and its one-token step in ms (median, the drafts visited round-robin with a
  rotating order), for the full draft and each reduced one;
* ``agree``: on the target's own continuations of the prompts below, how often the reduced
  draft's top token equals the full draft's, and the mean total variation between their
  distributions at temperature 1 (the full draft's mass outside the kept set is part of it);
* ``accept``: AR, SD and NSD end to end with nsd's Engine (one target, drafts swapped),
  prompt by prompt and configuration by configuration, at T = 0 and 0.8: tokens/s, τ and
  the acceptance rate (accepted / drafted), under ``-k auto`` and at a fixed k.

The prompts are written here for this purpose; none comes from a benchmark.

    python benchmarks/draft_head.py --variants full,16384,32768,65536,32768:q4_0 \
        --out benchmarks/results/draft_head.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import dataclasses

from nsd.api import BackendOptions, Engine, GenerationConfig, LoadedModel, load_engine
from nsd.models.draft_vocab import ensure_reduced_draft, open_reduced_draft

PROMPTS = [
    "Write a Python function that merges two sorted lists into one sorted list without using sort().",
    "Explain the difference between a process and a thread to a new programmer, in a short paragraph.",
    "Write a bash script that renames every .jpeg file in a folder to .jpg and prints how many it renamed.",
    "Write a SQL query that returns the three customers with the highest total order value in 2023.",
    "Write a Rust function that parses a CSS hex colour such as #1a2b3c into an (u8, u8, u8) tuple.",
    "How does a hash map deal with two keys that land in the same bucket? Give two strategies.",
    "Write a JavaScript debounce function and show how to use it on a window resize handler.",
    "Give me five tips for writing clear commit messages, one sentence each.",
]


def parse_variant(text: str) -> tuple[str, int | None, str]:
    """``full`` or ``N`` or ``N:head``."""
    if text == "full":
        return "full", None, "source"
    keep, _, head = text.partition(":")
    return text, int(keep), head or "source"


def per_token_bytes(path: Path) -> int:
    """Bytes a one-token step reads: every tensor but the input table, plus one of its rows."""
    from gguf import GGUFReader

    total = 0
    for t in GGUFReader(path).tensors:
        rows = int(t.shape[-1]) if t.name == "token_embd.weight" else 1
        total += int(t.n_bytes) // rows
    return total


def load_drafts(engine: Engine, args, options) -> dict[str, dict]:
    """The full draft is the engine's own; each reduced one is built (once, cached) from it."""
    source = Path(engine.draft_model.file)
    drafts = {}
    for text in args.variants.split(","):
        name, keep, head = parse_variant(text)
        if keep is None:
            loaded = engine.draft_model
        else:
            reduced = ensure_reduced_draft(source, keep, head)
            loaded = LoadedModel(open_reduced_draft(reduced, n_threads=options.threads, n_ctx=options.n_ctx),
                                 str(reduced.model), engine.draft_model.tokenizer_dir,
                                 engine.draft_model.weights, reduced.vocab_map)
        loaded.step_costs(1)  # -k auto needs c(1): measured (or read from the cache) now
        drafts[name] = {"loaded": loaded, "backend": loaded.backend, "vocab_map": loaded.vocab_map,
                        "bytes_per_token": per_token_bytes(Path(loaded.file)), "vocab": loaded.backend.vocab_size}
    return drafts


def step_ms(drafts: dict[str, dict], repeats: int, context: int = 256) -> dict[str, float]:
    rng = np.random.default_rng(0)
    ids = rng.integers(100, 30000, size=context + 1).tolist()  # ordinary tokens, kept by every N
    for d in drafts.values():
        d["backend"].reset()
        d["backend"].forward(ids[:context], all_logits=False)
    names = list(drafts)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            b = drafts[name]["backend"]
            start = time.perf_counter()
            b.forward(ids[context:], all_logits=False)
            samples[name].append(time.perf_counter() - start)
            b.rewind(context)
    for d in drafts.values():
        d["backend"].reset()
    return {n: 1e3 * statistics.median(s) for n, s in samples.items()}


def agreement(drafts: dict[str, dict], texts: list[list[int]]) -> dict[str, dict]:
    full = drafts["full"]["backend"]
    out: dict[str, dict] = {}
    for name, d in drafts.items():
        if name == "full":
            continue
        top, tv, outside, n = 0, 0.0, 0.0, 0
        d2t = d["vocab_map"].draft_to_target
        for ids in texts:
            full.reset()
            d["backend"].reset()
            a = torch.softmax(full.forward(ids), -1)
            b = torch.softmax(d["backend"].forward(ids), -1)
            b_full = torch.zeros_like(a)
            b_full[:, d2t] = b
            top += int((a.argmax(-1) == d2t[b.argmax(-1)]).sum())
            tv += float(0.5 * (a - b_full).abs().sum(-1).sum())
            outside += float((1 - a[:, d2t].sum(-1)).sum())
            n += len(ids)
        out[name] = {"top1_agree": top / n, "tv_t1": tv / n, "full_mass_outside": outside / n}
        d["backend"].reset()
    full.reset()
    return out


def use_draft(engine: Engine, d: dict) -> None:
    engine.draft_model = d["loaded"]  # its vocab_map says how to read the draft's logits
    engine.draft = d["backend"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--weights", default="q4_0", help="target weight format")
    ap.add_argument("--draft-weights", default="q4_0", help="draft body format (reduced from this file)")
    ap.add_argument("--variants", default="full,16384,32768,65536,32768:q4_0",
                    help="full, N (head rows as in the source file) or N:q4_0 / N:q8_0")
    ap.add_argument("--accept-variants", default=None,
                    help="the drafts run end to end (default: every variant)")
    ap.add_argument("--step-repeats", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--methods", default="sd,nsd")
    ap.add_argument("--ks", default="auto,4")
    ap.add_argument("--theta", type=float, default=0.9)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: steps,agree,accept")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    options = BackendOptions(threads=args.threads, weights=args.weights, draft_weights=args.draft_weights)
    # The engine's own draft is the full one (draft_vocab 0: since --draft-vocab auto became
    # the default it would otherwise be a reduced one already); the reduced ones are built here.
    engine = load_engine(args.target, draft=args.draft, proposer="draft",
                         options=dataclasses.replace(options, draft_vocab=0))
    drafts = load_drafts(engine, args, options)
    engine.target_model.step_costs(GenerationConfig().k_max + 1)
    prompts = PROMPTS[:args.prompts]
    report: dict = {"args": vars(args), "cpu": _cpu_name(), "variants": {}}
    for name, d in drafts.items():
        report["variants"][name] = {"vocab": d["vocab"], "bytes_per_token": d["bytes_per_token"],
                                    "weight_buffers": list(getattr(d["backend"], "weight_buffers", ()))}

    if "steps" not in skip:
        for name, ms in step_ms(drafts, args.step_repeats).items():
            report["variants"][name]["step_ms"] = ms
    if "agree" not in skip:
        # The target's own greedy continuations: the text a draft has to predict.
        texts = []
        for p in prompts:
            ids = engine.encode(p, chat=True)
            res = engine.generate(ids, GenerationConfig(method="ar", temperature=0.0,
                                                        max_new_tokens=args.max_new_tokens))
            texts.append(ids + res.token_ids)
        for name, a in agreement(drafts, texts).items():
            report["variants"][name].update(a)
    runs: dict[str, dict[str, list]] = {}
    if "accept" not in skip:
        temps = [float(t) for t in args.temperatures.split(",")]
        ks = [k if k == "auto" else int(k) for k in args.ks.split(",")]
        accept_variants = args.accept_variants.split(",") if args.accept_variants else list(drafts)
        for i, p in enumerate(prompts):
            ids = engine.encode(p, chat=True)
            for t in temps:
                configs = [("ar", None, 1)] + [(m, v, k) for m in args.methods.split(",")
                                              for k in ks for v in accept_variants]
                for method, variant, k in configs:
                    if variant is not None:
                        use_draft(engine, drafts[variant])
                    cfg = GenerationConfig(method=method, theta=args.theta, k=k, temperature=t,
                                           max_new_tokens=args.max_new_tokens, seed=i)
                    s = engine.generate(ids, cfg).stats
                    key = f"T={t} {method}" + ("" if variant is None else f" k={k} {variant}")
                    r = runs.setdefault(key, {"tok_s": [], "tau": [], "drafted": [], "accepted": [],
                                              "propose_s": [], "passes": [], "decode_tok_s": [],
                                              "predicted_tok_s": []})
                    r["tok_s"].append(s.tokens_per_s)
                    r["decode_tok_s"].append(s.decode_tokens_per_s)
                    if s.predicted_tokens_per_s is not None:  # -k auto only
                        r["predicted_tok_s"].append(s.predicted_tokens_per_s)
                    r["tau"].append(s.tau)
                    r["drafted"].append(s.drafted_tokens)
                    r["accepted"].append(s.accepted_tokens)
                    r["propose_s"].append(s.propose_s)
                    r["passes"].append(s.target_passes)
            print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
        report["runs"] = {k: _summary(v) for k, v in runs.items()}
    _print(report)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=1)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)


def _summary(r: dict[str, list]) -> dict:
    drafted = sum(r["drafted"])
    predicted = r.get("predicted_tok_s") or []
    return {"tok_s": statistics.median(r["tok_s"]), "tau": statistics.mean(r["tau"]),
            # After the prefill, measured and as -k auto's cost model expected it (medians).
            "decode_tok_s": statistics.median(r["decode_tok_s"]) if r.get("decode_tok_s") else None,
            "predicted_tok_s": statistics.median(predicted) if predicted else None,
            "acceptance": sum(r["accepted"]) / drafted if drafted else None,
            "draft_ms_per_token": 1e3 * sum(r["propose_s"]) / drafted if drafted else None,
            "k_mean": drafted / max(sum(r["passes"]), 1)}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f", {os.cpu_count()} CPUs"
    except OSError:
        pass
    return "unknown"


def _print(report: dict) -> None:
    print(f"CPU: {report['cpu']}")
    print("| draft | vocab | MB/token | step ms | top-1 = full | TV(T=1) vs full | full mass outside |")
    print("|---|---|---|---|---|---|---|")
    def cell(v: dict, key: str) -> str:  # "-": not measured (--skip), or the full draft's own
        return f"{v[key]:.3f}" if key in v else "-"

    for name, v in report["variants"].items():
        print(f"| {name} | {v['vocab']} | {v['bytes_per_token'] / 1e6:.1f} | {v.get('step_ms', float('nan')):.2f} "
              f"| {cell(v, 'top1_agree')} | {cell(v, 'tv_t1')} | {cell(v, 'full_mass_outside')} |")
    if "runs" not in report:
        return
    ar = {k.split()[0]: v["tok_s"] for k, v in report["runs"].items() if k.endswith(" ar")}
    print("\n| config | tok/s | vs AR | τ | acceptance | k̄ | draft ms/token |\n|---|---|---|---|---|---|---|")
    for key, v in report["runs"].items():
        t = key.split()[0]
        acc = "" if v["acceptance"] is None else f"{v['acceptance']:.3f}"
        dms = "" if v["draft_ms_per_token"] is None else f"{v['draft_ms_per_token']:.1f}"
        print(f"| {key} | {v['tok_s']:.1f} | {v['tok_s'] / ar[t]:.2f}× | {v['tau']:.2f} | {acc} "
              f"| {v['k_mean']:.1f} | {dms} |")
    # The cheaper draft's speedup over the full draft: measured, and as the cost model
    # predicted it from each draft's own step costs (medians of the decode rates).
    rows = []
    for key, v in report["runs"].items():
        *head, variant = key.split()
        full = report["runs"].get(" ".join(head + ["full"]))
        if variant in ("full", "ar") or full is None or not v.get("decode_tok_s") or not full.get("decode_tok_s"):
            continue
        pred = (f"{v['predicted_tok_s'] / full['predicted_tok_s']:.2f}×"
                if v.get("predicted_tok_s") and full.get("predicted_tok_s") else "")
        rows.append(f"| {key} | {v['decode_tok_s'] / full['decode_tok_s']:.2f}× | {pred} |")
    if rows:
        print("\n| config | decode vs full draft, measured | predicted |\n|---|---|---|")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
