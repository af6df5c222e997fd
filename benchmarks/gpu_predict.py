"""Predicted AR / SD / NSD tokens/s on a device, from measured step costs and measured
acceptance — a model, not an end-to-end run.

Inputs:

* step costs ``c(n)`` per model and nsd's per-pass overhead, from ``gpu_costs.py``;
* acceptance per draft position, pooled over the records of ``nsd bench`` results
  (``benchmarks/results/*/summary.json``, measured on the CPU with the real 0.5B → 1.5B
  pair at k = 4), or a JSON ``{"method": [α_1, α_2, ...], ...}`` via ``--acceptance``.

For a method with conditional acceptance ``α_j`` at draft position ``j``, k drafts give
``τ(k) = 1 + Σ_{i=1..k} Π_{j≤i} α_j`` tokens per target pass, and

    speedup(k) = τ(k) · c_t(1) / (k · c_d(1) + c_t(k + 1) + overhead(k))

over autoregressive decoding (1 token per ``c_t(1)``), maximised over k. Positions
beyond those measured reuse the last measured ``α`` (an assumption, printed). The 0.5B → 7B
pair reuses the 0.5B → 1.5B acceptance unless ``--acceptance`` gives better numbers.

    python benchmarks/gpu_predict.py benchmarks/results/gpu_costs_cuda.json

The model is nsd.bench.gpu_predict; this command gathers the inputs and writes the report.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from nsd.bench.gpu_predict import PAIRS, acceptance_from_results, prediction_report

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("costs", type=Path, help="gpu_costs_<device>.json")
    parser.add_argument("--results", type=Path, nargs="*", default=None,
                        help="nsd bench results.json or summary.json files (default: benchmarks/results/*/summary.json)")
    parser.add_argument("--acceptance", type=Path, default=None,
                        help='JSON {"method": [alpha_1, ...]} instead of bench results')
    parser.add_argument("--pairs", default=",".join(PAIRS), help="draft:target,... from gpu_costs models")
    parser.add_argument("--out", type=Path, default=None, help="default: next to the costs file")
    args = parser.parse_args(argv)

    costs = json.loads(args.costs.read_text(encoding="utf-8"))
    if args.acceptance:
        sources = {args.acceptance.stem: json.loads(args.acceptance.read_text(encoding="utf-8"))}
    else:
        files = args.results if args.results is not None else sorted(RESULTS.glob("*/summary.json"))
        sources = {f.parent.name: acceptance_from_results(f) for f in files}
    pairs = [p for p in args.pairs.split(",") if p]
    report = prediction_report(costs, args.costs.name, sources, pairs)
    out = args.out or args.costs.with_name(args.costs.stem.replace("gpu_costs", "gpu_predict") + ".json")
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    main()
