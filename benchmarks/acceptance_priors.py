"""Turn `nsd bench` journals on held-out prompts into the stored acceptance priors.

Each generation's ``acceptance_counts`` (tests and accepts per source of blocks: the draft
model, prompt lookup after an m-token match) are summed per model pair and setting
(rule family, greedy or sampled) and turned into starting estimates by
:func:`nsd.draftlen.priors.priors_from_counts`; the result is merged into
``src/nsd/acceptance_priors.json`` with the command and CPU it came from. The journals
must come from prompts that are not a benchmark (``benchmarks/data/calibration_prompts.jsonl``).

    python benchmarks/acceptance_priors.py --runs benchmarks/results/zen4-host/priors-t0 \
        benchmarks/results/zen4-host/priors-t0.8 --command "bash benchmarks/run_priors.sh"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from datetime import date
from pathlib import Path

from nsd.draftlen.machine import cpu_description
from nsd.options import NEEDS_DRAFT
from nsd.draftlen.priors import pair_key, priors_from_counts, setting_key

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "nsd" / "acceptance_priors.json"


def collect(run: Path) -> dict[tuple[str, str], dict]:
    """``{(pair, setting): {"counts": {source: [tests, accepts]}, "prompts": set, ...}}``."""
    settings = json.loads((run / "settings.json").read_text())
    greedy = float(settings["generation"]["temperature"]) == 0.0
    out: dict[tuple[str, str], dict] = defaultdict(
        lambda: {"counts": defaultdict(lambda: [0, 0]), "prompts": set(), "thetas": set()})
    for line in (run / "journal.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["family"] not in ("sd", "nsd") or not row["stats"].get("acceptance_counts"):
            continue
        draft = settings["draft"] if row["proposer"] in NEEDS_DRAFT else None
        entry = out[(pair_key(settings["target"], draft), setting_key(row["family"], greedy))]
        for source, (tests, accepts) in row["stats"]["acceptance_counts"].items():
            entry["counts"][source][0] += tests
            entry["counts"][source][1] += accepts
        entry["prompts"].add(row["prompt"])
        if row.get("theta") is not None:
            entry["thetas"].add(row["theta"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, nargs="+", required=True, help="nsd bench --out folders")
    parser.add_argument("--command", required=True, help="the command that produced the runs")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    table = json.loads(args.out.read_text()) if args.out.is_file() else {}
    merged: dict[tuple[str, str], dict] = {}
    for run in args.runs:
        if not (run / "journal.jsonl").is_file():
            print(f"error: no journal.jsonl in {run}", file=sys.stderr)
            return 2
        for key, entry in collect(run).items():
            if key in merged:
                print(f"error: {key} appears in two runs; calibrate each setting once", file=sys.stderr)
                return 2
            merged[key] = entry
    pairs = table.setdefault("pairs", {})
    for (pair, setting), entry in sorted(merged.items()):
        counts = {k: list(v) for k, v in sorted(entry["counts"].items())}
        priors = priors_from_counts(counts, f"{pair} {setting}")
        if priors is None:
            print(f"skipped {pair} {setting}: too few tests of the draft model ({counts})")
            continue
        pairs.setdefault(pair, {})[setting] = {
            "draft": priors.draft, "lookup": list(priors.lookup), "counts": counts,
            "prompts": len(entry["prompts"]), "thetas": sorted(entry["thetas"]),
        }
        print(f"{pair} {setting}: draft {priors.draft}, lookup by match length {priors.lookup}")
    table["about"] = ("Starting acceptance estimates of -k auto per model pair and setting, from "
                      "held-out prompts (benchmarks/data/calibration_prompts.jsonl); see nsd.draftlen.priors.")
    table["command"] = args.command
    table["measured"] = f"{date.today().isoformat()}, {cpu_description()['model']}"
    fd, tmp = tempfile.mkstemp(dir=args.out.parent, prefix=".priors-")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(table, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, args.out)  # atomic
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
