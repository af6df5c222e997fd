"""The rows and report of ``benchmarks/vllm_bench.py`` (vLLM plain, vLLM speculative
decoding, vLLM + NSD), without vLLM: which methods each engine runs, journal keys,
per-(method, temperature) summaries with paired speeds, and the Markdown report.

A row is one timed ``generate`` call: ``prompt``, ``dataset``, ``temperature``,
``method``, ``tokens`` (visible generated tokens, :mod:`nsd.bench.speed`),
``generated`` (all of them, overshoot past a stop string included), ``wall``, ``ledger``
(the plugin's per-request report; None for plain vLLM), ``passed`` (HumanEval) and
``load``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Iterator, Sequence

from nsd.bench import speed
from nsd.aggregate import median
from nsd.bench.metrics import acceptance_by_position, wilson_interval

RESULTS, REPORT = "results.json", "report.md"
ENGINES = ("plain", "ngram", "draft")
Key = tuple[str, float, str]  # (prompt uid, temperature, method label)

PLAIN, SD_DRAFT = "vLLM plain", "vLLM SD draft"  # the references speeds are paired against


def engine_methods(theta: float, budget: float) -> dict[str, list[tuple[str, dict | None]]]:
    """Per engine, its methods as (label, RuleConfig keyword arguments; None = no plugin)."""
    return {
        "plain": [(PLAIN, None)],
        "ngram": [("vLLM SD ngram", {"kind": "exact"})],
        "draft": [(SD_DRAFT, {"kind": "exact"}),
                  (f"vLLM+NSD θ{theta}", {"kind": "nucleus", "theta": theta}),
                  (f"vLLM+NSD θ{theta} B={budget}", {"kind": "nucleus", "theta": theta, "budget": budget})],
    }


def row_key(row: dict) -> Key:
    """A row's journal key: (prompt uid, temperature, method label)."""
    return row["prompt"], float(row["temperature"]), row["method"]


def row_keys(uids: Iterable[str], temps: Sequence[float], labels: Sequence[str]) -> Iterator[Key]:
    """The keys of every (prompt, temperature, method) row of a run, for
    :func:`nsd.bench.schedule.missing`."""
    return ((u, float(t), m) for u in uids for t in temps for m in labels)


def pass_at_1(rows: Sequence[dict]) -> dict | None:
    """pass@1 over the rows that were scored (HumanEval), with its 95% Wilson interval."""
    scored = [bool(r["passed"]) for r in rows if r.get("passed") is not None]
    if not scored:
        return None
    lo, hi = wilson_interval(sum(scored), len(scored))
    return {"passed": sum(scored), "n": len(scored), "rate": sum(scored) / len(scored), "ci": [lo, hi]}


def summarise(rows: Sequence[dict]) -> dict:
    """One table row from the rows of one (method, temperature). Rates are pooled (all
    tokens over all time); rows without a plugin report (plain vLLM) make one token per
    target pass and spend no deviation."""
    tokens = sum(r["tokens"] for r in rows)
    wall = sum(r["wall"] for r in rows)
    out = {"prompts": len(rows), "tokens": tokens, "tok_s": tokens / wall if wall > 0 else math.nan,
           "tok_s_median": median(r["tokens"] / r["wall"] for r in rows if r["wall"] > 0),
           "tau": 1.0, "per_position": None, "d_per_token": 0.0, "d_max": 0.0,
           "pass_at_1": pass_at_1(rows),
           "loaded": sum(bool((r.get("load") or {}).get("flagged")) for r in rows)}
    ledgers = [r["ledger"] for r in rows if r.get("ledger")]
    if ledgers:
        steps = sum(x["steps"] for x in ledgers)
        out["tau"] = sum(x["tokens"] for x in ledgers) / steps if steps else math.nan
        # D accrues over every emitted token, overshoot past a stop string included.
        generated = sum(r.get("generated", r["tokens"]) for r in rows if r.get("ledger"))
        out["d_per_token"] = sum(x["deviation"] for x in ledgers) / generated if generated else math.nan
        out["d_max"] = max(x["deviation"] for x in ledgers)
        out["per_position"] = acceptance_by_position([x["position_reached"] for x in ledgers],
                                                     [x["position_accepted"] for x in ledgers])
    return out


def row_rate(row: dict) -> float | None:
    """A row's tokens/s: visible tokens over wall time (None for a call that took none)."""
    return row["tokens"] / row["wall"] if row["wall"] > 0 else None


def paired_ratio(rows: Iterable[dict], method: str, reference: str, temperature: float) -> float:
    """Median over prompts of tok/s(method) / tok/s(reference) at one temperature."""
    return speed.paired_ratio([r for r in rows if float(r["temperature"]) == float(temperature)],
                              method, reference, rate=row_rate)


def summary_table(rows: Iterable[dict], labels: Sequence[str], temps: Sequence[float]) -> list[dict]:
    """Summaries per (temperature, method), temperature-major so each temperature's
    methods sit together; combinations without rows are left out. Each carries its paired
    speed against vLLM plain and against stock draft-model SD."""
    rows = list(rows)
    groups: dict[tuple[float, str], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(float(r["temperature"]), r["method"])].append(r)
    return [{"method": m, "temperature": float(t), **summarise(groups[(float(t), m)]),
             "vs_plain": paired_ratio(rows, m, PLAIN, t), "vs_sd": paired_ratio(rows, m, SD_DRAFT, t)}
            for t in temps for m in labels if groups.get((float(t), m))]


COLUMNS = ("method", "temp", "prompts", "tok/s", "vs plain", "vs SD draft", "acceptance length",
           "accept by position", "D/token", "max D", "pass@1 [95% CI]", "loaded")


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}x"


def format_row(s: dict) -> str:
    """One Markdown table line of a summary ("-" where a figure is undefined)."""
    pos = "-" if not s["per_position"] else \
        "[" + ", ".join(_num(p, 2) for p in s["per_position"]) + "]"
    p = s["pass_at_1"]
    passed = "-" if p is None else \
        f"{p['rate']:.2f} [{p['ci'][0]:.2f}, {p['ci'][1]:.2f}] ({p['passed']}/{p['n']})"
    cells = (s["method"], f"{s['temperature']:g}", str(s["prompts"]), _num(s["tok_s"], 2),
             _ratio(s.get("vs_plain")), _ratio(s.get("vs_sd")), _num(s["tau"], 2), pos,
             _num(s["d_per_token"], 3), _num(s["d_max"], 2), passed, str(s["loaded"]))
    return "| " + " | ".join(cells) + " |"


def render_table(summaries: Sequence[dict]) -> list[str]:
    return ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS),
            *(format_row(s) for s in summaries)]


def render_report(header: Sequence[str], sections: Sequence[tuple[str, list[dict]]]) -> str:
    """The Markdown report: header lines, then one titled table per section."""
    lines = list(header)
    for title, summaries in sections:
        lines += ["", f"## {title}", "", *render_table(summaries)]
    lines += ["", "tok/s: visible generated tokens over wall time, pooled over the prompts. "
              "vs plain / vs SD draft: median over prompts of each prompt's own tok/s ratio. "
              "Acceptance length: tokens per verification step that had drafts. Accept by "
              "position: share of steps reaching draft position i that accepted it (- = none "
              "reached it). D: the plugin's deviation bound. pass@1: HumanEval rows only, 95% "
              "Wilson interval. loaded: calls during which other processes used over 25% of "
              "the CPU (their tok/s is suspect)."]
    return "\n".join(lines) + "\n"
