"""``nsd compare``: AR, SD and NSD on the same models and prompts, in one run.

Methods are interleaved prompt by prompt so drift in machine load hits all of them alike;
speedups are ratios of per-method totals measured in this same run.
"""

from __future__ import annotations

import sys
from typing import Sequence

DEFAULT_PROMPTS = (
    "def quicksort(arr):",
    "Write a Python function that returns the n-th Fibonacci number using memoization.",
    "Explain in two sentences what a hash map is.",
)


def run_compare(engine, prompts: Sequence[str], configs: Sequence, chat: bool = False) -> str:
    """Run every config on every prompt; return a Markdown table."""
    totals = {c.method: {"tokens": 0, "time": 0.0, "passes": 0, "drafted": 0, "accepted": 0,
                         "deviation": 0.0} for c in configs}
    for i, prompt in enumerate(prompts):
        ids = engine.encode(prompt, chat=chat)
        for cfg in configs:
            stats = engine.generate(ids, cfg).stats
            t = totals[cfg.method]
            t["tokens"] += stats.new_tokens
            t["time"] += stats.wall_s
            t["passes"] += stats.target_passes
            t["drafted"] += stats.drafted_tokens
            t["accepted"] += stats.accepted_tokens
            t["deviation"] += stats.deviation
            print(f"[{i + 1}/{len(prompts)}] {cfg.method:8s} {stats.tokens_per_s:6.1f} tok/s "
                  f"tau {stats.tau:.2f}", file=sys.stderr, flush=True)
    def rate(m: str) -> float:
        t = totals[m]
        return t["tokens"] / t["time"] if t["time"] else 0.0
    lines = ["| method | tokens | tok/s | tau | acceptance | D/token | speedup vs AR | speedup vs SD |",
             "|---|---|---|---|---|---|---|---|"]
    for m, t in totals.items():
        vs_ar = f"{rate(m) / rate('ar'):.2f}x" if "ar" in totals and rate("ar") else "-"
        vs_sd = f"{rate(m) / rate('sd'):.2f}x" if "sd" in totals and rate("sd") else "-"
        acc = f"{t['accepted'] / t['drafted']:.2f}" if t["drafted"] else "-"
        lines.append(f"| {m} | {t['tokens']} | {rate(m):.1f} | {t['tokens'] / max(t['passes'], 1):.2f} | "
                     f"{acc} | {t['deviation'] / max(t['tokens'], 1):.3f} | {vs_ar} | {vs_sd} |")
    return "\n".join(lines)
