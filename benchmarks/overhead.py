"""Per-method time split from an ``nsd bench`` results.json: target step, proposer, and
nsd's own overhead per target pass (sampling transform, verification, bookkeeping).

    python benchmarks/overhead.py results/humaneval/results.json
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def main(path: str) -> None:
    records = json.load(open(path, encoding="utf-8"))["records"]
    by_method: dict[str, list[dict]] = defaultdict(list)
    for rec in records:
        if rec["family"].startswith("hf-"):
            continue
        by_method[rec["method"]].append(rec["stats"])
    decode_rate = {m: statistics.median(s["decode_tokens_per_s"] for s in st) for m, st in by_method.items()}
    ar = decode_rate.get("ar")
    print("| method | decode tok/s (median, no prefill) | decode speedup vs AR | target ms/pass | "
          "proposer ms/pass | nsd overhead ms/pass | overhead / target step | prefill share of wall |")
    print("|---|---|---|---|---|---|---|---|")
    for method, stats in by_method.items():
        passes = sum(s["target_passes"] for s in stats)
        target = sum(s["target_s"] for s in stats) / passes
        propose = sum(s["propose_s"] for s in stats) / passes
        overhead = statistics.median(s["overhead_per_pass_s"] for s in stats)
        prefill = sum(s["prefill_s"] for s in stats) / sum(s["wall_s"] for s in stats)
        vs_ar = f"{decode_rate[method] / ar:.2f}x" if ar else "-"
        print(f"| {method} | {decode_rate[method]:.1f} | {vs_ar} | {1e3 * target:.1f} | {1e3 * propose:.1f} | {1e3 * overhead:.2f} | "
              f"{100 * overhead / target:.1f}% | {100 * prefill:.0f}% |")


if __name__ == "__main__":
    main(sys.argv[1])
