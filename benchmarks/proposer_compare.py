"""The hybrid proposer against the draft model alone, paired per prompt, from `nsd bench`
journals of runs with ``--proposers draft,hybrid``:

    python benchmarks/proposer_compare.py benchmarks/results/zen4-host/humaneval164-t0-hybrid/journal.jsonl

For each speculative method (sd, nsd@θ) it prints the median over prompts of each
prompt's tokens/s ratio hybrid / draft, with a percentile bootstrap 95 % interval over
prompts (fixed seed), the share of prompts where hybrid was faster, each proposer's paired
median against AR, and the aggregate ratio (all visible tokens over all wall time). With
``--by-category`` the paired median hybrid / draft per category too. With ``--decode`` the
rates are decode rates (generated tokens over the time after the target's prefill, the
draft's own prefill included): at T > 0 the proposers' sample paths differ, and a prompt's
tokens/s with its prefill then mostly measures how long each answer happened to be.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections import defaultdict
from pathlib import Path

from nsd.bench.metrics import bootstrap_median
from nsd.bench.speed import by_prompt, decode_rate, paired_ratio
from nsd.bench.store import read_journal
from nsd.errors import NSDError


def _rate(record: dict, decode: bool) -> float | None:
    return decode_rate(record["stats"], False) if decode else record["tokens_per_s"]


def _ratios(prompts: dict[str, dict[str, dict]], method: str, reference: str,
            decode: bool) -> dict[str, float]:
    """Per prompt: the rate of ``method`` over that of ``reference`` (prompts with both)."""
    out = {}
    for uid, rs in prompts.items():
        if method in rs and reference in rs:
            a, b = _rate(rs[method], decode), _rate(rs[reference], decode)
            if a is not None and b:
                out[uid] = a / b
    return out


def _aggregate(records: list[dict], method: str, decode: bool, prompts: set[str]) -> float:
    """Visible tokens over wall time (decode: generated tokens over the time after the
    prefill), over ``prompts`` (those both proposers ran) together."""
    rows = [r for r in records if r["method"] == method and r["prompt"] in prompts]
    if decode:
        tokens = sum(r["stats"]["new_tokens"] for r in rows)
        wall = sum(r["stats"]["wall_s"] - r["stats"]["prefill_s"] for r in rows)
    else:
        tokens = sum(r["tokens_per_s"] * r["stats"]["wall_s"] for r in rows)
        wall = sum(r["stats"]["wall_s"] for r in rows)
    return tokens / wall if wall > 0 else float("nan")


def compare(journal: Path, by_category: bool, decode: bool) -> list[str]:
    records = list(read_journal(journal)[0].values())
    prompts = by_prompt(records)
    methods = list(dict.fromkeys(r["method"] for r in records))
    lines = [f"\n{journal} ({len(prompts)} prompts; {'decode rates' if decode else 'tokens/s'})"]
    for draft in [m for m in methods if m.endswith("/draft")]:
        base = draft[: -len("/draft")]
        hybrid = base + "/hybrid"
        if hybrid not in methods:
            continue
        ratios = _ratios(prompts, hybrid, draft, decode)
        if not ratios:
            continue
        values = list(ratios.values())
        low, high = bootstrap_median(values)
        faster = sum(v > 1 for v in values) / len(values)
        rate = functools.partial(_rate, decode=decode)
        lines.append(
            f"  {base:10s} hybrid/draft paired median {statistics.median(values):.3f} "
            f"[{low:.3f}, {high:.3f}], hybrid faster on {faster:.0%} of {len(values)} prompts; "
            f"vs AR: draft {paired_ratio(records, draft, 'ar', rate):.3f}, "
            f"hybrid {paired_ratio(records, hybrid, 'ar', rate):.3f}; aggregate hybrid/draft "
            f"{_aggregate(records, hybrid, decode, set(ratios)) / _aggregate(records, draft, decode, set(ratios)):.3f}")
        if by_category:
            cats: dict[str, list[float]] = defaultdict(list)
            for uid, value in ratios.items():
                cats[prompts[uid][draft]["category"]].append(value)
            lines += [f"      {cat:18s} {statistics.median(v):.3f} ({len(v)})"
                      for cat, v in sorted(cats.items())]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("journals", nargs="+", type=Path)
    ap.add_argument("--by-category", action="store_true", help="also the paired median per category")
    ap.add_argument("--decode", action="store_true", help="compare decode rates (prefill left out)")
    args = ap.parse_args()
    for journal in args.journals:
        try:
            print("\n".join(compare(journal, args.by_category, args.decode)))
        except NSDError as exc:
            raise SystemExit(f"proposer_compare: {exc}") from None


if __name__ == "__main__":
    main()
