"""The CPU speed targets read from finished `nsd bench` runs: for each run and each target
that concerns its temperature, the paired median ratio and whether it is met (targets
stated for AMX are marked as such on other CPUs), then, for each unmet ratio to AR, what
the method's time would have to be, part by part.

    python benchmarks/speed_targets.py benchmarks/results/amx-hybrid/*/

The targets and how they are read: nsd.bench.targets.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nsd.bench import targets as tg
from nsd.errors import NSDError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="nsd bench --out directories")
    args = ap.parse_args()
    try:
        runs = {run.name: run for run in map(tg.load_run, args.runs)}
    except NSDError as exc:
        raise SystemExit(f"speed_targets: {exc}") from None
    checks = [c for run in runs.values() for c in tg.check(run)]
    print(tg.format_checks(checks, runs))
    gaps = [(c.run, tg.shortfall(runs[c.run], c.method, c.target.at_least))
            for c in checks if c.reference == "ar" and not c.ratio >= c.target.at_least]
    gaps = [(run, gap) for run, gap in gaps if gap is not None]
    if gaps:
        print("\nWhere the time would have to come from (aggregate seconds per token; each part "
              "alone, the others as measured):")
        print("\n".join(tg.format_shortfall(run, gap) for run, gap in gaps))


if __name__ == "__main__":
    main()
