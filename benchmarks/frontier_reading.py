"""The quality-speed frontier in one place, from `benchmarks/run_frontier.sh`'s folders:
per run the fidelity table (pass@1 with its 95% interval, paired changes in pass@1 and in
target log-likelihood against AR, τ, D/token, speed against AR and SD) and, per relaxed
method, one sentence a user choosing θ and B can act on; then the rules' frontier: the
fastest rule at each quality level, and frontier_rules.png in the run folder (speedup
against quality, one curve per rule, AR and SD as points).

    python benchmarks/frontier_reading.py benchmarks/results/frontier/*/

A run still in progress is read from its journal, restricted to the prompts every method
has finished (so each comparison stays paired); the heading says how many that is.
Speed against SD here is the median over prompts of each prompt's own tokens/s ratio; on
HumanEval each method's pass@1 is also compared with SD's problem by problem, which at
temperature > 0 is the tighter pairing (NSD draws the same random numbers as SD).
The reading itself is nsd.bench.frontier (whose METHODS is run_frontier.sh's grid).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nsd.bench.frontier import read_run, run_reading, run_temperature, write_rules_plot
from nsd.errors import NSDError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run_frontier.sh result folders")
    ap.add_argument("--first", type=int, metavar="N",
                    help="read only the first N prompts of each run (to set a run beside a "
                         "shorter one on the same prompts)")
    ap.add_argument("--no-plot", dest="plot", action="store_false",
                    help="do not write frontier_rules.png (speedup against quality, one curve "
                         "per rule) into each run folder")
    args = ap.parse_args()
    if args.first is not None and args.first < 1:
        ap.error(f"--first must be at least 1, got {args.first}")
    for run in args.runs:
        try:
            records, state = read_run(run, args.first)
        except NSDError as exc:
            raise SystemExit(f"frontier_reading: {exc}") from None
        for block in run_reading(run.name, records, state, run_temperature(run)):
            print(block)
        if args.plot and (path := write_rules_plot(run, records)) is not None:
            print(f"![{run.name}: speedup against quality, one curve per rule]({path})\n")


if __name__ == "__main__":
    main()
