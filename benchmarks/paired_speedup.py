"""Paired speed figures from `nsd bench` journals: for each method, the median over prompts
of that prompt's own tokens/s ratio to AR (same prompt, same run), and nsd's AR per decode
step against llama.cpp's generate (prefill excluded on both sides).

    python benchmarks/paired_speedup.py benchmarks/results/fastpath/*/journal.jsonl
    python benchmarks/paired_speedup.py --pair nsd@0.9/draft sd/draft RUN/journal.jsonl

With ``--pair METHOD REFERENCE`` (repeatable) it prints, for each pair, the paired median
of METHOD's tokens/s over REFERENCE's with its percentile-bootstrap 95 % interval over
prompts (4,000 resamples, seed 0: the interval BENCHMARKS.md's frontier tables print).

tokens/s is the runner's own (visible tokens over wall time, nsd.bench.speed). Reports
written before 2026-12-06 put a ratio of medians over prompts in their "vs AR"
column; they now put this paired median there too, which cancels each prompt's length and
prefill. This script reads old journals the new way.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nsd.bench.speed import paired_interval_lines, paired_speedup_lines
from nsd.bench.store import read_journal
from nsd.errors import NSDError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("journals", nargs="+", type=Path)
    # Two words, not one split at a comma: top-K/δ's labels have commas in them.
    ap.add_argument("--pair", action="append", nargs=2, default=[], metavar=("METHOD", "REFERENCE"),
                    help="print this pair's paired median with its bootstrap 95 %% interval (repeatable)")
    args = ap.parse_args()
    for journal in args.journals:
        try:
            records = list(read_journal(journal)[0].values())
            lines = (paired_interval_lines(journal, records, args.pair) if args.pair
                     else paired_speedup_lines(journal, records))
        except NSDError as exc:
            raise SystemExit(f"paired_speedup: {exc}") from None
        print("\n".join(lines))


if __name__ == "__main__":
    main()
