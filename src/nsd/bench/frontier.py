"""The quality-speed frontier of ``benchmarks/run_frontier.sh``'s runs: per run the
fidelity table (pass@1 with its 95% interval, paired changes in pass@1 and in target
log-likelihood against AR, τ, D/token, speed against AR and SD), per relaxed method one
sentence a user choosing θ and B can act on (``benchmarks/frontier_reading.py``), and the
rules' frontier (issue 45): NSD beside the rules engines ship (top-K/δ, SGLang's
thresholds, FLy) and typical acceptance, each rule's main knob swept over the same number
of values, as a plot of speedup against quality with one curve per rule and a table of the
fastest rule at each quality level.

A run still in progress is read from its journal, restricted to the prompts every method
has finished (so each comparison stays paired). Speed against SD is the median over
prompts of each prompt's own tokens/s ratio (:mod:`nsd.bench.speed`); on HumanEval each
method's pass@1 is also compared with SD's problem by problem, which at temperature > 0 is
the tighter pairing (NSD draws the same random numbers as SD).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from nsd.bench import metrics, speed
from nsd.bench.methods import MethodSpec, expand_methods, is_peer_family, spec_from_record
from nsd.bench.report import fidelity_table, summarize, summarize_by_category
from nsd.bench.speed import paired_ratio
from nsd.bench.store import read_journal
from nsd.errors import NSDError

# The grid of run_frontier.sh (keep the two in step): every rule's main knob over four
# values, the same sweep budget per rule (threshold runs at T > 0 only: SGLang's greedy
# verification is argmax matching).
THETAS = (0.5, 0.7, 0.9, 0.95)
SWEEPS = {"relaxed_delta": (0.2, 0.4, 0.6, 0.8), "threshold_single": (0.3, 0.5, 0.7, 0.9),
          "fly_entropy_threshold": (0.1, 0.3, 0.6, 1.0)}
RULES = ("nsd", "typical", "topk_delta", "threshold", "fly")  # the curves, in legend order
METHODS = expand_methods(["ar", "sd", "nsd", "nsd-budget", "typical", "topk_delta", "threshold", "fly"],
                         THETAS, [1.0, 4.0], ["draft"], sweeps=SWEEPS)


def run_methods(records: list[dict]) -> tuple[MethodSpec, ...]:
    """The methods a run's records hold: the grid's, in its order, then any others (a smoke
    run's own knob values), rebuilt from what each record says of its method."""
    labels = dict.fromkeys(r["method"] for r in records)
    known = [m for m in METHODS if m.label in labels]
    first = {r["method"]: r for r in reversed(records)}
    extra = [spec_from_record(first[label]) for label in labels if label not in {m.label for m in known}]
    return tuple(known + extra)


def complete_records(journal: Path, methods: tuple[MethodSpec, ...] | None = None) -> tuple[list[dict], int]:
    """Records of the prompts that every method has finished, and how many prompts that is
    (``methods`` None: those the journal holds, :func:`run_methods`)."""
    by_prompt = speed.by_prompt(read_journal(journal)[0].values())
    if methods is None:
        methods = run_methods([r for rs in by_prompt.values() for r in rs.values()])
    labels = [m.label for m in methods]
    done = [p for p, rs in by_prompt.items() if all(label in rs for label in labels)]
    return [by_prompt[p][label] for p in done for label in labels], len(done)


def first_prompts(records: list[dict], n: int) -> list[dict]:
    """Records of the first ``n`` prompts, in the order the run took them (the dataset's)."""
    keep = set(list(dict.fromkeys(r["prompt"] for r in records))[:n])
    return [r for r in records if r["prompt"] in keep]


def against(records: list[dict], method: str, reference: str) -> dict:
    """Problem by problem against ``reference``: the paired pass@1 change with its interval,
    how many problems ``method`` passes that ``reference`` fails (gains) and the reverse
    (losses), and how many completions are token for token the same."""
    by_prompt = speed.by_prompt(records)
    pairs = [(rs[method], rs[reference]) for rs in by_prompt.values() if method in rs and reference in rs]
    scored = [(a, b) for a, b in pairs if a["passed"] is not None and b["passed"] is not None]
    return {"change": metrics.paired_difference([float(a["passed"]) for a, _ in scored],
                                                [float(b["passed"]) for _, b in scored]),
            "gains": sum(a["passed"] and not b["passed"] for a, b in scored),
            "losses": sum(b["passed"] and not a["passed"] for a, b in scored),
            "identical": sum(a["output_ids"] == b["output_ids"] for a, b in pairs)}


def _interval(values) -> str:
    centre, lo, hi = values
    return f"{centre:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def reading(records: list[dict], summary: list[dict], execute: bool) -> list[str]:
    """One sentence per relaxed method: speed against SD and AR (paired medians) at its
    measured fidelity cost. On HumanEval exact SD gets one too: its own change against AR is
    the yardstick (numerics when greedy, sampling noise otherwise)."""
    out = []
    for r in summary:
        if r["family"] == "sd" and execute:
            ar = against(records, r["method"], "ar")
            out.append(f"- **{r['method']}** (exact): pass@1 {r['pass_at_1']:.3f}, change vs AR "
                       f"{_interval(r['pass_at_1_change'])} (+{ar['gains']} / −{ar['losses']} problems); "
                       f"completions identical to AR's {ar['identical']}.")
        if r["family"] in ("ar", "sd"):
            continue
        quality = f"log-likelihood change vs AR {_interval(r['loglik_change'])} per token"
        if execute:  # the task's own measure first; the text's likelihood as well
            ar, sd = against(records, r["method"], "ar"), against(records, r["method"], "sd/draft")
            quality = (f"pass@1 {r['pass_at_1']:.3f}, change vs AR {_interval(r['pass_at_1_change'])} "
                       f"(+{ar['gains']} / −{ar['losses']} problems), vs SD {_interval(sd['change'])} "
                       f"(+{sd['gains']} / −{sd['losses']}); completions identical to AR's "
                       f"{ar['identical']}, to SD's {sd['identical']}; {quality}")
        out.append(f"- **{r['method']}**: {paired_ratio(records, r['method'], 'sd/draft'):.2f}× SD's "
                   f"speed and {paired_ratio(records, r['method'], 'ar'):.2f}× AR's (paired medians), "
                   f"τ {r['tau']:.2f}, D/token {r['deviation_per_token']:.3f}, {quality}.")
    return out


# Per category: τ of every speculative method, and D/token of the relaxed ones.
CATEGORY_TAU = ("sd/draft", "nsd@0.5/draft", "nsd@0.9/draft", "nsd@0.95/draft", "nsd-budget@B1/draft",
                "typical/draft")
CATEGORY_D = ("nsd@0.5/draft", "nsd@0.9/draft", "nsd@0.95/draft", "nsd-budget@B1/draft", "typical/draft")


def category_table(records: list[dict]) -> list[str]:
    """Markdown lines: one row per category with τ and D/token per method (one prompt set
    per category, so read differences between categories, not third decimals)."""
    by_category = summarize_by_category(records, run_methods(records))
    short = lambda label: label.removesuffix("/draft")  # noqa: E731
    out = ["| category | prompts | " + " | ".join(f"τ {short(m)}" for m in CATEGORY_TAU) + " | "
           + " | ".join(f"D/tok {short(m)}" for m in CATEGORY_D) + " |",
           "|---" * (2 + len(CATEGORY_TAU) + len(CATEGORY_D)) + "|"]
    for name, rows in sorted(by_category.items()):
        row = {r["method"]: r for r in rows}
        cells = [f"{row[m]['tau']:.2f}" if m in row else "-" for m in CATEGORY_TAU]
        cells += [f"{row[m]['deviation_per_token']:.3f}" if m in row else "-" for m in CATEGORY_D]
        prompts = max(r["prompts"] for r in rows)
        out.append(f"| {name.split('/', 1)[-1]} | {prompts} | " + " | ".join(cells) + " |")
    return out


def relaxed_cost_table(summary: list[dict], temperature: float | None = None) -> list[str]:
    """Markdown lines: what each relaxed method's relaxed accepts cost, the "why" under the
    frontier (none where the summary predates ``relaxed_per_token``). Per method: relaxed
    accepts per 100 tokens (pooled over prompts), D per relaxed accept (its mean E_t; 1 at
    T = 0, where each relaxed accept replaces the argmax), the log-likelihood change per
    token against exact SD (the difference of the paired changes against AR, on the same
    prompts: at T = 0 SD's text is AR's, and at T > 0 SD is what the relaxed rules would be
    with nothing relaxed, drawing the same random numbers where their drafts are sampled),
    and the ratio of the two: nats of target log-likelihood lost per relaxed accept. Two
    rules with the same D can lose different log-likelihood: E counts probability mass
    moved, not how unlikely under the target the accepted token is, and a rule whose set
    reaches further into the tail pays more nats for the same D. The ratio
    also carries what follows a relaxed accept (the text goes on from another token), so
    read it across rules, not as a per-token law.

    Greedy runs only (none for ``temperature`` > 0; None: not known, shown): sampled texts
    differ in log-likelihood by chance far more than a relaxed accept moves them at the
    sizes run here (13 Spec-Bench prompts at T = 0.8: exact SD's own change against AR was
    −0.13 nats/token), and the rules that draft argmaxes draw other random numbers than SD,
    so no baseline pairs with every rule."""
    if temperature is not None and temperature > 0:
        return []
    sd = next((r for r in summary if r["family"] == "sd" and r.get("loglik_change") is not None), None)
    rows = [r for r in summary if r["family"] not in ("ar", "sd") and r.get("relaxed_per_token") is not None
            and r.get("loglik_change") is not None]
    if not rows or sd is None:
        return []
    out = ["| method | relaxed / 100 tokens | D per relaxed accept | Δ loglik/token vs SD | "
           "Δ loglik per relaxed accept (nats) |", "|---|---|---|---|---|"]
    for r in rows:
        rate, change = r["relaxed_per_token"], r["loglik_change"][0] - sd["loglik_change"][0]
        per_accept = f"{change / rate:+.2f}" if rate > 0 else "-"
        d_each = f"{r['deviation_per_token'] / rate:.2f}" if rate > 0 else "-"
        out.append(f"| {r['method']} | {100 * rate:.1f} | {d_each} | {change:+.3f} | {per_accept} |")
    return out


def position_table(summary: list[dict]) -> list[str]:
    """Markdown lines: per speculative method and draft position (1..k), the acceptance
    rate, the share of blocks accepting there only thanks to the relaxed set, and the mean
    D charged there, each per block reaching that position (none where the summary
    predates the per-position counts). Where a rule gains (its relaxed accepts at late
    positions lengthen the accepted run) and what it pays for it, position by position."""
    rows = [r for r in summary if r["family"] != "ar" and not is_peer_family(r["family"])
            and r.get("relaxed_by_position") is not None and r.get("deviation_by_position") is not None]
    if not any(r["family"] != "sd" for r in rows):  # nothing relaxed to read
        return []
    cell = lambda values, fmt: " ".join(fmt.format(v) for v in values)  # noqa: E731
    out = ["By draft position (per block reaching it; positions 1..k left to right):", "",
           "| method | τ | accepted | relaxed | D charged |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['method']} | {r['tau']:.2f} | {cell(r['acceptance_by_position'], '{:.2f}')} | "
                   f"{cell(r['relaxed_by_position'], '{:.2f}')} | {cell(r['deviation_by_position'], '{:.3f}')} |")
    return out


def run_temperature(run: Path) -> float | None:
    """The sampling temperature a run folder's settings.json records (None: not recorded)."""
    try:
        return float(json.loads((run / "settings.json").read_text())["generation"]["temperature"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_run(run: Path, first: int | None = None) -> tuple[list[dict], str]:
    """A run folder's records (its results.json, else the finished prompts of its
    journal), optionally only its first ``first`` prompts, and a phrase saying which."""
    results = run / "results.json"
    if results.exists():
        records = json.loads(results.read_text())["records"]
        state = f"{len({r['prompt'] for r in records})} prompts, complete"
    elif (run / "journal.jsonl").exists():
        records, n = complete_records(run / "journal.jsonl")
        state = f"in progress: the {n} prompts every method has finished"
    else:
        raise NSDError(f"{run}: no results.json or journal.jsonl")
    if first is not None:
        records = first_prompts(records, first)
        state += f"; the first {len({r['prompt'] for r in records})} read"
    return records, state


def run_reading(name: str, records: list[dict], state: str, temperature: float | None = None) -> list[str]:
    """The Markdown blocks of one run: heading, fidelity table, per-method sentences and,
    when the run spans several categories, the per-category table."""
    if not records:
        return [f"## {name} ({state})\n\nnothing to show yet\n"]
    summary = summarize(records, run_methods(records))
    execute = any(r.get("passed") is not None for r in records)
    blocks = [f"## {name} ({state})\n", "\n".join(fidelity_table(summary)) + "\n",
              "\n".join(reading(records, summary, execute)) + "\n"]
    points, quality = frontier_points(summary, execute)
    if any(p["family"] in RULES for p in points):
        blocks.append("\n".join(fastest_table(points, quality, summary, execute)) + "\n")
        if against_best := nsd_against_best(points, summary, execute, speed.prompt_rates(records)):
            blocks.append("\n".join(against_best) + "\n")
        if cost := relaxed_cost_table(summary, temperature):
            blocks.append("\n".join(cost) + "\n")
        if positions := position_table(summary):
            blocks.append("\n".join(positions) + "\n")
    if len({r.get("category") for r in records}) > 1:
        blocks.append("\n".join(category_table(records)) + "\n")
    return blocks


# --------------------------------------------------------------------------- the rules' frontier


def frontier_points(summary: list[dict], execute: bool) -> tuple[list[dict], str]:
    """One point per method: its family (the curve), label, speedup over AR (median of
    paired per-prompt ratios) and quality: pass@1 on HumanEval, else the paired change in
    the target's mean log-likelihood per token against AR (0 for AR itself)."""
    quality = "pass@1" if execute else "log-likelihood change vs AR (nats/token)"
    points = []
    for r in summary:
        if r["family"] == "nsd-budget":
            continue  # a budget is a second knob on NSD's curve, not a rule of its own
        speedup = 1.0 if r["family"] == "ar" else r["speedup_vs_ar"]
        value = r["pass_at_1"] if execute else (0.0 if r["family"] == "ar" else r["loglik_change"][0])
        if speedup is None or value is None or math.isnan(speedup) or math.isnan(value):
            continue
        points.append({"family": r["family"], "method": r["method"], "speedup": speedup,
                       "quality": value})
    return points, quality


def quality_levels(summary: list[dict], execute: bool) -> list[tuple[str, float]]:
    """The quality levels of the fastest-rule table, as (words, least quality): on
    HumanEval AR's pass@1 and 1, 2, 4 and 8 problems below it; else a log-likelihood
    change of 0, −0.02 (the issue's matched-quality margin), −0.05, −0.1 and −0.2."""
    if execute:
        ar = next((r for r in summary if r["family"] == "ar"), None)
        if ar is None or ar["pass_at_1"] is None:
            return []
        n = ar["prompts"]
        return [(f"AR − {d} problem{'s' if d != 1 else ''}" if d else "AR's",
                 ar["pass_at_1"] - d / n - 1e-9) for d in (0, 1, 2, 4, 8)]
    return [(f"{v:+.2f}", v - 1e-9) for v in (0.0, -0.02, -0.05, -0.1, -0.2)]


def _levels(points: list[dict], summary: list[dict], execute: bool):
    """Per quality level: its words and the points (AR left out) that reach it."""
    for words, least in quality_levels(summary, execute):
        yield words, [p for p in points if p["quality"] >= least and p["family"] != "ar"]


def _fastest(points: list[dict]) -> dict | None:
    """The point with the highest speedup (None: no points)."""
    return max(points, key=lambda p: p["speedup"]) if points else None


def fastest_table(points: list[dict], quality: str, summary: list[dict], execute: bool) -> list[str]:
    """Markdown lines: at each quality level, the fastest point over all rules (SD
    included: exact, it meets every level AR meets up to noise), and each rule's fastest
    point at that level (- where none of its sweep reaches it)."""
    rules = [f for f in RULES if any(p["family"] == f for p in points)]
    out = [f"Fastest rule at each quality level ({quality}; speedup over AR, paired medians):", "",
           "| quality ≥ | fastest | speedup | " + " | ".join(rules) + " |",
           "|---" * (3 + len(rules)) + "|"]
    for words, ok in _levels(points, summary, execute):
        best = _fastest(ok)
        if best is None:
            out.append(f"| {words} | none | - | " + " | ".join("-" for _ in rules) + " |")
            continue
        cells = []
        for rule in rules:
            mine = _fastest([p for p in ok if p["family"] == rule])
            cells.append(f"{mine['speedup']:.2f}" if mine else "-")
        out.append(f"| {words} | {best['method']} | {best['speedup']:.2f} | " + " | ".join(cells) + " |")
    return out


def nsd_against_best(points: list[dict], summary: list[dict], execute: bool,
                     rates: dict[str, dict[str, float]] | None) -> list[str]:
    """Markdown lines: at each quality level, NSD's fastest point there against the fastest
    other point there (any rule, or SD), prompt by prompt: the median of their per-prompt
    tokens/s ratios with its bootstrap 95 % interval over prompts. The fastest-rule table
    ranks points by their medians against AR; this says whether a gap between two of them
    is larger than the spread over prompts. Empty without per-prompt rates (summaries
    written before they were kept)."""
    if not rates:
        return []
    out = ["NSD against the fastest other method at each quality level (paired median of the "
           "per-prompt tokens/s ratios, with a percentile-bootstrap 95 % interval over prompts, "
           f"{metrics.RESAMPLES} resamples, seed {metrics.SEED}; below 1: NSD slower):", "",
           "| quality ≥ | NSD's fastest | fastest other | NSD ÷ other | 95 % interval | prompts |",
           "|---|---|---|---|---|---|"]
    for words, ok in _levels(points, summary, execute):
        mine = _fastest([p for p in ok if p["family"] == "nsd"])
        other = _fastest([p for p in ok if p["family"] != "nsd"])
        cells = ["-", "-", "-"]
        if mine and other:
            centre, low, high, n = metrics.paired_interval(rates, mine["method"], other["method"])
            cells = [f"{centre:.2f}", f"[{low:.2f}, {high:.2f}]", str(n)]
        out.append(f"| {words} | {mine['method'] if mine else 'none'} | "
                   f"{other['method'] if other else 'none'} | " + " | ".join(cells) + " |")
    return out


def plot_rules(points: list[dict], quality: str, path: Path) -> Path | None:
    """``path`` (PNG): speedup over AR against quality, one curve per rule (its sweep
    sorted by quality), AR and SD as single points."""
    if not points:
        return None
    from nsd.bench.plots import _figure

    with _figure(path, (7.5, 5.0)) as ax:
        for family in RULES:
            mine = sorted((p for p in points if p["family"] == family), key=lambda p: p["quality"])
            if mine:
                ax.plot([p["quality"] for p in mine], [p["speedup"] for p in mine], marker="o", label=family)
        for family, marker in (("ar", "s"), ("sd", "D")):
            for p in points:
                if p["family"] == family:
                    ax.scatter([p["quality"]], [p["speedup"]], marker=marker, s=60, zorder=3,
                               color="black" if family == "ar" else "grey", label=family.upper())
        ax.set_xlabel(quality)
        ax.set_ylabel("speedup over AR")
        ax.axhline(1.0, color="black", linewidth=0.5, linestyle=":")
        ax.legend()
    return path


def write_rules_plot(run: Path, records: list[dict]) -> Path | None:
    """``frontier_rules.png`` in the run folder, from its records."""
    if not records:
        return None
    summary = summarize(records, run_methods(records))
    execute = any(r.get("passed") is not None for r in records)
    points, quality = frontier_points(summary, execute)
    return plot_rules(points, quality, run / "frontier_rules.png")
