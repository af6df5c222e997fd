"""Predicted AR / SD / NSD tokens/s on a device, from measured step costs and measured
acceptance: a model, not an end-to-end run (``benchmarks/gpu_predict.py`` is the command).

For a method with conditional acceptance ``α_j`` at draft position ``j``, k drafts give
``τ(k) = 1 + Σ_{i=1..k} Π_{j≤i} α_j`` tokens per target pass, and

    speedup(k) = τ(k) · c_t(1) / (k · c_d(1) + c_t(k + 1) + overhead(k))

over autoregressive decoding (1 token per ``c_t(1)``), maximised over k. Positions
beyond those measured reuse the last measured ``α`` (an assumption, printed).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

PAIRS = ("qwen2.5-0.5b:qwen2.5-1.5b", "qwen2.5-0.5b:qwen2.5-7b")
DISCLAIMER = ("PREDICTIONS from measured step costs and CPU-measured acceptance rates, "
              "not end-to-end runs on this device.")


def acceptance_from_results(path: Path) -> dict[str, list[float]]:
    """Pooled conditional acceptance per draft position, per method (draft proposer only),
    from an ``nsd bench`` ``results.json`` (its records) or ``summary.json`` (its rows'
    ``acceptance_by_position``, pooled the same way when the run was summarised)."""
    saved = json.loads(path.read_text(encoding="utf-8"))
    if "records" not in saved:
        return {row["method"].removesuffix("/draft"): [a for a in row["acceptance_by_position"]
                                                       if a is not None and not math.isnan(a)]
                for row in saved["summary"] if row.get("proposer") == "draft"}
    records = saved["records"]
    attempts: dict[str, list[int]] = defaultdict(list)
    accepts: dict[str, list[int]] = defaultdict(list)
    for rec in records:
        if rec.get("proposer") != "draft":
            continue
        method = rec["method"].removesuffix("/draft")
        for i, (n, a) in enumerate(zip(rec["stats"]["position_attempts"], rec["stats"]["position_accepts"])):
            while len(attempts[method]) <= i:
                attempts[method].append(0)
                accepts[method].append(0)
            attempts[method][i] += n
            accepts[method][i] += a
    return {m: [a / n for a, n in zip(accepts[m], attempts[m]) if n] for m in attempts}


def expected_tokens(alphas: list[float], k: int) -> float:
    """τ(k) = 1 + Σ_{i≤k} Π_{j≤i} α_j, reusing the last α past the measured positions."""
    tau, run = 1.0, 1.0
    for i in range(k):
        run *= alphas[min(i, len(alphas) - 1)]
        tau += run
    return tau


def _overhead_ms(costs: dict[str, Any], method: str, k: int) -> float:
    """nsd's per-pass overhead at k, interpolated between the measured ks (0 if absent)."""
    table = costs.get("overhead_ms", {}).get("greedy_exact" if method == "sd" else "greedy_nucleus", {})
    points = sorted((int(kk), v) for kk, v in table.items() if v == v)  # drop NaN
    if not points:
        return 0.0
    for (k0, v0), (k1, v1) in zip(points, points[1:]):
        if k0 <= k <= k1:
            return v0 + (v1 - v0) * (k - k0) / (k1 - k0)
    return points[0][1] if k < points[0][0] else points[-1][1]


def predict(costs: dict[str, Any], acceptance: dict[str, list[float]], pairs: list[str]
            ) -> list[dict[str, Any]]:
    rows = []
    models = costs["models"]
    for pair in pairs:
        draft, target = pair.split(":")
        if draft not in models or target not in models:
            continue
        for mode in models[target]["ms"]:
            if mode not in models[draft]["ms"]:
                continue
            c_t = {int(n): v for n, v in models[target]["ms"][mode].items()}
            c_d = {int(n): v for n, v in models[draft]["ms"][mode].items()}
            ar_tps = 1e3 / c_t[1]
            rows.append({"pair": pair, "mode": mode, "method": "ar", "k": 0, "tau": 1.0,
                         "tokens_per_s": ar_tps, "speedup_vs_ar": 1.0})
            for method, alphas in sorted(acceptance.items()):
                if method == "ar" or not alphas:
                    continue
                best = None
                for k in sorted(n - 1 for n in c_t if n >= 2):
                    tau = expected_tokens(alphas, k)
                    pass_ms = k * c_d[1] + c_t[k + 1] + _overhead_ms(costs, method.split("@")[0], k)
                    speedup = tau * c_t[1] / pass_ms
                    if best is None or speedup > best["speedup_vs_ar"]:
                        best = {"pair": pair, "mode": mode, "method": method, "k": k, "tau": tau,
                                "tokens_per_s": tau * 1e3 / pass_ms, "speedup_vs_ar": speedup}
                if best:
                    rows.append(best)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| pair (draft:target) | mode | method | best k | τ(k) | predicted tok/s | vs AR |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['pair']} | {r['mode']} | {r['method']} | {r['k'] or '-'} | {r['tau']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x |")
    return "\n".join(lines)


def prediction_report(costs: dict[str, Any], costs_name: str, sources: dict[str, dict[str, list[float]]],
                      pairs: list[str], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Predictions for each acceptance source (name -> acceptance per method), with the
    disclaimer and assumptions logged first: the report ``gpu_predict.py`` writes."""
    machine = costs.get("machine", {})
    where = machine.get("gpu") or machine.get("cpu", "?")
    log(DISCLAIMER)
    log(f"step costs: {costs_name} ({where}, {costs.get('dtype')}, context {costs.get('context')})")
    log("acceptance beyond the measured draft positions reuses the last measured value; "
        "0.5B:7B reuses the acceptance measured for 0.5B:1.5B")
    missing = [p for p in pairs if any(m not in costs["models"] for m in p.split(":"))]
    if missing:
        log(f"skipped (models not in the costs file): {', '.join(missing)}")
    report: dict[str, Any] = {"note": DISCLAIMER, "costs": str(costs_name), "machine": machine,
                              "predictions": {}}
    for name, acceptance in sources.items():
        shown = {m: [round(a, 3) for a in al] for m, al in acceptance.items()}
        log(f"\n## acceptance from {name}: {shown}\n")
        rows = predict(costs, acceptance, pairs)
        log(markdown(rows) if rows else "(nothing to predict)")
        report["predictions"][name] = {"acceptance": acceptance, "rows": rows}
    return report
