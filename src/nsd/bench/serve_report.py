"""Tables of the serving benchmarks, from their JSON files: how throughput scales with
concurrent clients (``benchmarks/serve_load.py``) and how soon a conversation's next turn
starts when its prompt is reused (``benchmarks/serve_prefix_cache.py``). Pure functions of
the rows, shared by the scripts that print them and by BENCHMARKS.md's generated blocks."""

from __future__ import annotations

import statistics
from typing import Sequence


def scaling_table(rows: Sequence[dict]) -> list[str]:
    """Per method and level: aggregate tokens/s against one client's in the same round
    (median over rounds), the worst round's latency p95, and the answers' agreement."""
    out = ["| method | clients | tok/s (median of rounds) | × one client (paired) | "
           "latency p95, worst round (ms) | agree with one client |", "|---|---|---|---|---|---|"]
    by_key: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        by_key.setdefault((r["method"], r["clients"]), []).append(r)
    for (method, clients), runs in by_key.items():
        ones = {r["round"]: r for r in by_key.get((method, 1), [])}
        ratios = [r["tokens_per_s"] / ones[r["round"]]["tokens_per_s"] for r in runs
                  if r["round"] in ones and ones[r["round"]]["tokens_per_s"] > 0]
        agree = [r["agree"] for r in runs if r.get("agree") is not None]
        latencies = [r["latency_s_p95"] for r in runs if r["latency_s_p95"] is not None]
        out.append(f"| {method} | {clients} | {statistics.median(r['tokens_per_s'] for r in runs):.1f} | "
                   f"{format(statistics.median(ratios), '.2f') + '×' if ratios else '-'} | "
                   f"{format(1e3 * max(latencies), '.0f') if latencies else '-'} | "
                   f"{format(statistics.fmean(agree), '.0%') if agree else '-'} |")
    return out


def reuse_table(rows: Sequence[dict]) -> list[str]:
    """One line per turn: its prompt, the tokens found cached, time to first token and to
    the turn's end (rows as benchmarks/serve_prefix_cache.py writes them)."""
    out = ["| turn | prompt tokens | cached | TTFT s | whole turn s |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['label']} | {r['prompt_tokens']} | {r['cached_tokens']} | "
                   f"{r['ttft_s']:.2f} | {r['total_s']:.2f} |")
    return out


def reuse_speedup(rows: Sequence[dict]) -> float:
    """The second turn's time to first token, cold over from the live cache: what reuse buys."""
    ttft = {r["label"]: r["ttft_s"] for r in rows}
    return ttft["A turn 2 (cold)"] / ttft["A turn 2 (live cache)"]
