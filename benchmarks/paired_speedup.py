"""Paired speed figures from `nsd bench` journals: for each method, the median over prompts
of that prompt's own tokens/s ratio to AR (same prompt, same run), and nsd's AR per decode
step against llama.cpp's generate (prefill excluded on both sides).

    python benchmarks/paired_speedup.py benchmarks/results/fastpath/*/journal.jsonl

tokens/s is the runner's own (visible tokens over wall time, nsd.bench.speed). Reports
written before 2026-12-06 put a ratio of medians over prompts in their "vs AR"
column; they now put this paired median there too, which cancels each prompt's length and
prefill. This script reads old journals the new way.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nsd.bench.speed import paired_speedup_lines
from nsd.bench.store import read_journal
from nsd.errors import NSDError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("journals", nargs="+", type=Path)
    args = ap.parse_args()
    for journal in args.journals:
        try:
            records = list(read_journal(journal)[0].values())
        except NSDError as exc:
            raise SystemExit(f"paired_speedup: {exc}") from None
        print("\n".join(paired_speedup_lines(journal, records)))


if __name__ == "__main__":
    main()
