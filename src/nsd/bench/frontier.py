"""The quality-speed frontier of ``benchmarks/run_frontier.sh``'s runs: per run the
fidelity table (pass@1 with its 95% interval, paired changes in pass@1 and in target
log-likelihood against AR, τ, D/token, speed against AR and SD) and, per relaxed method,
one sentence a user choosing θ and B can act on (``benchmarks/frontier_reading.py``).

A run still in progress is read from its journal, restricted to the prompts every method
has finished (so each comparison stays paired). Speed against SD is the median over
prompts of each prompt's own tokens/s ratio (:mod:`nsd.bench.speed`); on HumanEval each
method's pass@1 is also compared with SD's problem by problem, which at temperature > 0 is
the tighter pairing (NSD draws the same random numbers as SD).
"""

from __future__ import annotations

import json
from pathlib import Path

from nsd.bench import metrics, speed
from nsd.bench.methods import MethodSpec, expand_methods
from nsd.bench.report import fidelity_table, summarize, summarize_by_category
from nsd.bench.speed import paired_ratio
from nsd.bench.store import read_journal
from nsd.errors import NSDError

# The grid of run_frontier.sh (keep the two in step).
METHODS = expand_methods(["ar", "sd", "nsd", "nsd-budget", "typical"], [0.5, 0.7, 0.9, 0.95],
                         [1.0, 4.0], ["draft"])


def complete_records(journal: Path, methods: tuple[MethodSpec, ...]) -> tuple[list[dict], int]:
    """Records of the prompts that every method has finished, and how many prompts that is."""
    by_prompt = speed.by_prompt(read_journal(journal)[0].values())
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
    by_category = summarize_by_category(records, METHODS)
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


def read_run(run: Path, first: int | None = None) -> tuple[list[dict], str]:
    """A run folder's records (its results.json, else the finished prompts of its
    journal), optionally only its first ``first`` prompts, and a phrase saying which."""
    results = run / "results.json"
    if results.exists():
        records = json.loads(results.read_text())["records"]
        state = f"{len({r['prompt'] for r in records})} prompts, complete"
    elif (run / "journal.jsonl").exists():
        records, n = complete_records(run / "journal.jsonl", METHODS)
        state = f"in progress: the {n} prompts every method has finished"
    else:
        raise NSDError(f"{run}: no results.json or journal.jsonl")
    if first is not None:
        records = first_prompts(records, first)
        state += f"; the first {len({r['prompt'] for r in records})} read"
    return records, state


def run_reading(name: str, records: list[dict], state: str) -> list[str]:
    """The Markdown blocks of one run: heading, fidelity table, per-method sentences and,
    when the run spans several categories, the per-category table."""
    if not records:
        return [f"## {name} ({state})\n\nnothing to show yet\n"]
    summary = summarize(records, METHODS)
    execute = any(r.get("passed") is not None for r in records)
    blocks = [f"## {name} ({state})\n", "\n".join(fidelity_table(summary)) + "\n",
              "\n".join(reading(records, summary, execute)) + "\n"]
    if len({r.get("category") for r in records}) > 1:
        blocks.append("\n".join(category_table(records)) + "\n")
    return blocks
