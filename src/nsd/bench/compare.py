"""``nsd compare``: AR, SD and NSD on the same models and prompts, in one run.

Methods are interleaved prompt by prompt, which one goes first rotating as in ``nsd bench``,
so drift in machine load hits all of them alike. Each first makes one short untimed call,
so the one-off costs of a process's first calls are billed to no method.
The figures use the same definitions as ``nsd bench`` (:mod:`nsd.aggregate`):
speedups are medians of the per-prompt tokens/s ratios measured in this same run.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Sequence

from nsd.aggregate import deviation_per_token, median, speedup, tau
from nsd.bench.runner import WARMUP_TOKENS
from nsd.bench.schedule import method_order
from nsd.draftlen.calibrate import kernel_switches
from nsd.errors import NSDError
from nsd.draftlen.machine import cpu_description
from nsd.options import DEVIATION_BOUND_METHODS

DEFAULT_PROMPTS = (
    "def quicksort(arr):",
    "Write a Python function that returns the n-th Fibonacci number using memoization.",
    "Explain in two sentences what a hash map is.",
)


def check_methods(methods: Sequence[str]) -> None:
    """At least one method, each once: a repeated one would have no runs of its own to pair
    with AR's."""
    if not methods:
        raise NSDError("no methods: give --methods as a comma-separated list, e.g. ar,sd,nsd")
    repeated = sorted({m for m in methods if list(methods).count(m) > 1})
    if repeated:
        raise NSDError(f"--methods names {', '.join(repeated)} more than once; name each method once")


def warm_up(engine, ids: Sequence[int], configs: Sequence) -> None:
    """One short untimed call per config. A process's first generation pays one-off costs
    (lazy allocations, the first forwards, nsd's own work per pass measured once per
    verification rule), which would otherwise inflate or deflate whichever method runs
    first. Every config, not one per code path: SD, NSD and typical acceptance share the
    proposer but not the rule."""
    for config in configs:
        engine.generate(list(ids), dataclasses.replace(config, max_new_tokens=WARMUP_TOKENS))


def run_compare(engine, prompts: Sequence[str], configs: Sequence, chat: bool = False,
                warmup: bool = True) -> str:
    """Run every config on every prompt; return a Markdown table. ``warmup``: first one
    short untimed call per config, on the first prompt."""
    check_methods([c.method for c in configs])
    if warmup and prompts:
        warm_up(engine, engine.encode(prompts[0], chat=chat), configs)
    runs: dict[str, list] = {c.method: [] for c in configs}
    for i, prompt in enumerate(prompts):
        ids = engine.encode(prompt, chat=chat)
        for cfg in method_order(configs, i):
            stats = engine.generate(ids, cfg).stats
            runs[cfg.method].append(stats)
            print(f"[{i + 1}/{len(prompts)}] {cfg.method:8s} {stats.tokens_per_s:6.1f} tok/s "
                  f"tau {stats.tau:.2f}", file=sys.stderr, flush=True)

    def rates(method: str) -> list[float]:
        return [s.tokens_per_s for s in runs.get(method, [])]

    def ratio(method: str, baseline: str) -> str:
        return f"{speedup(rates(method), rates(baseline)):.2f}x" if baseline in runs else "-"

    k_of = {c.method: c.k for c in configs}
    threads = engine.target.n_threads if hasattr(engine.target, 'n_threads') else '?'
    switches = kernel_switches()  # e.g. GGML_AVX2_SMALL_MIN=2: rows no longer batch-invariant
    lines = [f"CPU: {cpu_description()['model']}, {threads} threads; proposer: {engine.proposer_kind}"
             + (f"; kernel switches: {switches}" if switches else ""),
             "",
             "| method | k | tokens | tok/s (median) | tau | acceptance | D/token | speedup vs AR | speedup vs SD |",
             "|---|---|---|---|---|---|---|---|---|"]
    for method, stats in runs.items():
        ks = [k for s in stats for k in s.k_per_pass]
        k_text = "-" if method == "ar" else (
            f"auto (mean {sum(ks) / len(ks):.1f})" if k_of[method] == "auto" and ks else str(k_of[method]))
        new = [s.new_tokens for s in stats]
        drafted = sum(s.drafted_tokens for s in stats)
        acc = f"{sum(s.accepted_tokens for s in stats) / drafted:.2f}" if drafted else "-"
        lines.append(
            f"| {method} | {k_text} | {sum(new)} | {median(rates(method)):.1f} | "
            f"{tau(new, [s.target_passes for s in stats]):.2f} | {acc} | "
            f"{'≤ ' if method in DEVIATION_BOUND_METHODS else ''}"
            f"{deviation_per_token([s.deviation for s in stats], new):.3f} | "
            f"{ratio(method, 'ar')} | {ratio(method, 'sd')} |")
    return "\n".join(lines)
