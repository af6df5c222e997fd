"""The results tables of README.md and BENCHMARKS.md, regenerated from the runs they cite
(nsd.bench.headline.RUNS): every table between the `<!-- generated: ... -->` markers.

    python benchmarks/headline.py            # rewrite the marked tables in place
    python benchmarks/headline.py --check    # exit 1 if a document differs from its runs
    python benchmarks/headline.py --summarize benchmarks/results/RUN/   # write RUN/summary.json

`nsd bench` writes `summary.json` beside `results.json` itself; `--summarize` makes it for
a run from before that (it needs the run's `results.json`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nsd.bench import headline
from nsd.bench.methods import spec_from_record
from nsd.bench.report import small_summary, summarize_by_category, summarize as summarize_rows
from nsd.bench.store import SUMMARY, write_json_atomic
from nsd.errors import NSDError

ROOT = Path(__file__).resolve().parents[1]


def summarize(run: Path) -> Path:
    path = run / "results.json"
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise NSDError(f"{path}: cannot read ({exc})") from None
    if "records" not in results:
        raise NSDError(f"{path} has no records (not an `nsd bench` run)")
    # Recompute the summaries from the records with today's definitions (an older nsd
    # bench defined "vs AR" as a ratio of medians, today it is the median of per-prompt
    # ratios), so that every run in the documents reads the same way.
    records = results["records"]
    specs = [spec_from_record(r) for r in {r["method"]: r for r in records}.values()]
    order = list(dict.fromkeys(r["method"] for r in records))
    specs.sort(key=lambda spec: order.index(spec.label))
    try:
        results = {**results, "summary": summarize_rows(records, specs),
                   "by_category": summarize_by_category(records, specs)}
    except KeyError as exc:  # records of an nsd bench that did not record that field yet
        print(f"{run}: summaries kept as recorded (records lack {exc})", file=sys.stderr)
        results = {**results, "summary_as_recorded": True}
    write_json_atomic(run / SUMMARY, small_summary(results), indent=None)
    return run / SUMMARY


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a document is stale")
    ap.add_argument("--summarize", nargs="+", type=Path, metavar="RUN", help="write RUN/summary.json")
    args = ap.parse_args()
    try:
        if args.summarize:
            for run in args.summarize:
                print(f"wrote {summarize(run)}")
            return 0
        if args.check:
            stale = headline.stale(ROOT)
            for name in stale:
                print(f"{name}: its generated tables differ from the runs; run python benchmarks/headline.py")
            return 1 if stale else 0
        for name in headline.write(ROOT):
            print(f"rewrote {name}")
        return 0
    except NSDError as exc:
        print(f"headline: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
