"""Paired speed figures from `nsd bench` journals: for each method, the median over prompts
of that prompt's own tokens/s ratio to AR (same prompt, same run), and nsd's AR per decode
step against llama.cpp's generate (prefill excluded on both sides).

    python benchmarks/paired_speedup.py benchmarks/results/fastpath/*/journal.jsonl

The report's "vs AR" column is a ratio of medians over prompts; for methods whose work is
nearly identical to AR's (-k auto taking plain steps) the paired median is the steadier
estimate, since it cancels each prompt's length and prefill.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from nsd.bench import metrics
from nsd.bench.store import read_journal
from nsd.errors import NSDError


def load(journal: Path) -> dict[str, dict[str, dict]]:
    """Records by prompt, then by method label."""
    by_prompt: dict[str, dict[str, dict]] = defaultdict(dict)
    for (prompt, method), record in read_journal(journal)[0].items():
        by_prompt[prompt][method] = record
    return by_prompt


def paired_ratio(by_prompt: dict[str, dict[str, dict]], method: str) -> float:
    """Median over prompts of tok/s(method) / tok/s(AR), from wall times and token counts."""
    rates = {prompt: {m: r["stats"]["new_tokens"] / r["stats"]["wall_s"]
                      for m, r in records.items() if r["stats"]["wall_s"] > 0}
             for prompt, records in by_prompt.items()}
    return metrics.paired_ratio(rates, method, "ar")


def decode_rate(stats: dict, first_token_in_prefill: bool) -> float | None:
    """Tokens per second of decode steps. llama.cpp's generate times its first token with
    the prompt, so its decode covers one step fewer than nsd's (whose prefill ends before
    the first token's step)."""
    steps = stats["new_tokens"] - (1 if first_token_in_prefill else 0)
    seconds = stats["wall_s"] - stats["prefill_s"]
    return steps / seconds if steps > 0 and seconds > 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("journals", nargs="+", type=Path)
    args = ap.parse_args()
    for journal in args.journals:
        try:
            by_prompt = load(journal)
        except NSDError as exc:
            raise SystemExit(f"paired_speedup: {exc}") from None
        methods = list(dict.fromkeys(m for records in by_prompt.values() for m in records))
        print(f"\n{journal} ({len(by_prompt)} prompts): paired median tok/s ratio to AR")
        for method in methods:
            if method != "ar":
                print(f"  {method:28s} {paired_ratio(by_prompt, method):.3f}")
        peer = [r["llama-generate"] for r in by_prompt.values() if "llama-generate" in r]
        if peer:
            ar = [decode_rate(r["ar"]["stats"], False) for r in by_prompt.values() if "ar" in r]
            lg = [decode_rate(r["stats"], True) for r in peer]
            ar_med = statistics.median(v for v in ar if v)
            lg_med = statistics.median(v for v in lg if v)
            print(f"  AR per decode step vs llama-generate: {ar_med:.2f} / {lg_med:.2f} tok/s = "
                  f"{ar_med / lg_med:.3f}")


if __name__ == "__main__":
    main()
