"""Aggregate records into per-method and per-category summaries; write JSON and Markdown.

Every summary is recomputed from the raw records (also saved), so numbers in the report
can always be re-derived. Agreement compares each output with the AR output of the same
prompt on the same code path (``ar`` for ours, ``hf-ar`` for transformers' peers).
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Sequence

from nsd import aggregate
from nsd.bench import metrics
from nsd.bench.methods import LLAMA_PEERS, MethodSpec, is_peer_family
from nsd.bench.speed import paired_ratio, prompt_rates
from nsd.bench.store import SUMMARY, write_json_atomic, write_text_atomic
from nsd.draftlen.calibrate import kernel_switches
from nsd.draftlen.machine import cpu_description


def summarize(records: Sequence[dict], methods: Sequence[MethodSpec]) -> list[dict]:
    """One row per method, in ``methods`` order; methods without records are left out."""
    by_method: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_method[r["method"]].append(r)
    rates = {label: {r["prompt"]: r["tokens_per_s"] for r in rs} for label, rs in by_method.items()}
    outputs = {label: {r["prompt"]: r for r in rs} for label, rs in by_method.items()}
    rows = []
    for spec in methods:
        rs = by_method.get(spec.label)
        if not rs:
            continue
        stats = [r["stats"] for r in rs]
        attempts = [s["position_attempts"] for s in stats]  # per record, per draft position
        # the draft reading the prompt, mean per prompt: None where a record predates the
        # measure (a run resumed across it), and then the draft ms below still hold it
        draft_prefill = aggregate.mean(s["draft_prefill_s"] for s in stats) \
            if all("draft_prefill_s" in s for s in stats) else None
        reference = outputs.get(spec.ar_baseline, {})
        paired = [(r, reference[r["prompt"]]) for r in rs if r["prompt"] in reference]
        passed = [r["passed"] for r in rs]
        executed = [bool(p) for p in passed if p is not None]
        # Changes against AR on the same prompts, with paired 95% intervals.
        scored = [(r, a) for r, a in paired if r["passed"] is not None and a["passed"] is not None]
        rows.append({
            "method": spec.label, "family": spec.family, "proposer": spec.proposer,
            "theta": spec.theta, "budget": spec.budget, "knobs": dict(spec.knobs), "prompts": len(rs),
            "new_tokens_mean": aggregate.mean(s["new_tokens"] for s in stats),
            "tokens_per_s_median": aggregate.median(r["tokens_per_s"] for r in rs),
            "speedup_vs_ar": _speedup(rates, spec.label, spec.ar_baseline),
            "speedup_vs_sd": _speedup(rates, spec.label, spec.sd_baseline),
            "tau": aggregate.tau([s["new_tokens"] for s in stats], [s["target_passes"] for s in stats]),
            "acceptance_rate": _ratio(sum(s["accepted_tokens"] for s in stats),
                                      sum(s["drafted_tokens"] for s in stats)),
            "acceptance_by_position": metrics.acceptance_by_position(
                attempts, [s["position_accepts"] for s in stats]),
            # Per draft position (reached): relaxed accepts, and the D charged there; None
            # where a record predates these counts.
            "relaxed_by_position": metrics.per_position(attempts, [s["position_relaxed"] for s in stats])
            if all("position_relaxed" in s for s in stats) else None,
            "deviation_by_position": metrics.per_position(attempts, [s["position_deviation"] for s in stats])
            if all("position_deviation" in s for s in stats) else None,
            "relaxed_share": _ratio(sum(s["relaxed_accepts"] for s in stats),
                                    sum(s["accepted_tokens"] for s in stats)),
            # Relaxed accepts per generated token, pooled: with D/token, what each one cost.
            "relaxed_per_token": _ratio(sum(s["relaxed_accepts"] for s in stats),
                                        sum(s["new_tokens"] for s in stats)),
            "deviation_per_token": aggregate.deviation_per_token(
                [s["deviation"] for s in stats], [s["new_tokens"] for s in stats]),
            "pass_at_1": metrics.pass_at_1(passed),
            "pass_at_1_ci": list(metrics.wilson_interval(sum(executed), len(executed))),
            "pass_at_1_change": list(metrics.paired_difference(
                [float(r["passed"]) for r, _ in scored], [float(a["passed"]) for _, a in scored])),
            "loglik_change": list(metrics.paired_difference(
                [r["loglik"] for r, _ in paired], [a["loglik"] for _, a in paired])),
            "agreement": aggregate.mean(metrics.token_agreement(r["output_ids"], a["output_ids"])
                                      for r, a in paired),
            "prefix_agreement": aggregate.mean(metrics.common_prefix_fraction(r["output_ids"], a["output_ids"])
                                             for r, a in paired),
            "exact_match": aggregate.mean(float(metrics.exact_match(r["text"], a["text"])) for r, a in paired),
            "loglik_mean": aggregate.mean(r["loglik"] for r in rs),
            "accepted_length_histogram": metrics.accepted_length_histogram(
                s.get("accepted_per_pass", []) for s in stats),
            # The tokens drafted per pass (0 = a plain step: chosen by -k auto, or a lookup
            # that found nothing), and -k auto's expected rate beside the measured one.
            "mean_k": aggregate.mean(k for s in stats for k in s.get("k_per_pass") or []),
            "plain_step_share": aggregate.mean(float(k == 0) for s in stats for k in s.get("k_per_pass") or []),
            "predicted_tokens_per_s_median": aggregate.median(
                s["predicted_tokens_per_s"] for s in stats if s.get("predicted_tokens_per_s")),
            "decode_tokens_per_s_median": aggregate.median(s["decode_tokens_per_s"] for s in stats),
            # the draft's reading of the prompt is once per request, not a cost of a pass
            "draft_s_per_pass": _ratio(_total(s["propose_s"] for s in stats) - (draft_prefill or 0.0) * len(stats),
                                       sum(s["target_passes"] for s in stats)),
            "draft_prefill_s_mean": draft_prefill,
            "target_s_per_pass": _ratio(_total(s["target_s"] for s in stats),
                                        sum(s["target_passes"] for s in stats)),
            "overhead_s_per_pass": aggregate.mean(s["overhead_per_pass_s"] for s in stats),
            "loaded_calls": sum(bool(r["load"]["flagged"]) for r in rs),
            "other_cpu_mean": aggregate.mean(r["load"]["other_cpu"] for r in rs),
        })
    return rows


def _total(values: Iterable[float | None]) -> float:
    """A sum of timings, undefined (NaN) where any is: a peer that does not time a part
    records NaN, which the journal's JSON stores as null."""
    values = list(values)
    return sum(values) if all(aggregate.defined(v) for v in values) else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def _speedup(rates: dict[str, dict[str, float]], label: str, baseline: str | None) -> float:
    """Median of the per-prompt ratios over the prompts both methods ran (same run)."""
    if baseline is None or baseline not in rates:
        return math.nan
    ours, base = rates[label], rates[baseline]
    common = [p for p in ours if p in base]
    return aggregate.speedup([ours[p] for p in common], [base[p] for p in common])


def summarize_by_category(records: Sequence[dict], methods: Sequence[MethodSpec]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[f"{r['dataset']}/{r['category']}"].append(r)
    return {name: summarize(rs, methods) for name, rs in groups.items()}


def environment() -> dict:
    versions = {}
    for package in ("torch", "transformers", "llama_cpp_python", "nsd"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "processor": platform.processor(),
            "cpu": cpu_description(), "kernel_switches": kernel_switches(), "versions": versions}


def _num(value: float | None, fmt: str = "{:.2f}", suffix: str = "") -> str:
    if not aggregate.defined(value):
        return "-"
    return fmt.format(value) + suffix


def _positions(values: Iterable[float]) -> str:
    shown = [_num(v) for v in values]
    return " ".join(shown) if shown else "-"


def weights_used(records: Sequence[dict]) -> str | None:
    """Which weight formats the calls ran on, e.g. "target original; draft q4_0" (more
    than one value per role when a resumed run picked differently); None if unrecorded."""
    roles: dict[str, Counter] = defaultdict(Counter)
    for r in records:
        for role, fmt in (r.get("weights") or {}).items():
            if fmt:
                roles[role][fmt] += 1
    if not roles:
        return None
    def show(counts: Counter) -> str:
        if len(counts) == 1:
            return next(iter(counts))
        return ", ".join(f"{fmt} ({n} calls)" for fmt, n in counts.most_common())
    shown = "; ".join(f"{role} {show(roles[role])}" for role in ("target", "draft") if role in roles)
    if "draft_vocab" in roles:  # nsd's own draft calls ran on a reduced head (--draft-vocab)
        shown += f" (nsd's draft head: {show(roles['draft_vocab'])} tokens)"
    return shown


def markdown(summary: Sequence[dict], by_category: dict[str, list[dict]], settings: dict,
             max_other_cpu: float, weights: str | None = None) -> str:
    lines = ["# nsd bench", ""]
    lines.append(f"Target `{settings.get('target')}`, draft `{settings.get('draft')}`, backend "
                 f"`{settings.get('backend')}`; datasets {', '.join(settings.get('datasets', []))}; "
                 f"max {settings['generation']['max_new_tokens']} new tokens, temperature "
                 f"{settings['generation']['temperature']}, k = {settings['generation']['k']}."
                 + (f" Weight formats: {weights}." if weights else ""))
    lines += ["", "tok/s counts output tokens up to a stop sequence. Speedups are medians of the "
              "per-prompt tokens/s ratios within this run (paired); hf-* peers "
              "are compared with hf-ar. τ = new tokens per target pass. Acceptance by position: "
              "P(draft token i accepted | reached). D/token: fidelity deviation bound per token. "
              "Agreement: token positions equal to the AR output (exact: identical text).", ""]
    lines += method_table(summary)
    if any(aggregate.defined(r.get("mean_k")) for r in summary):
        lines += ["", "Cost breakdown per target pass (ms) and the draft lengths used "
                  "(k̄: mean tokens drafted per pass; plain: share of passes that drafted nothing, as "
                  "chosen by -k auto or where prompt lookup found no match; draft prefill: the draft "
                  "model reading the prompt, once per request, mean per prompt and not in draft ms; ar: the "
                  "one-token step and the decode rate, prompt excluded, as measured in the run):",
                  ""] + cost_table(summary)
    if any(r["family"] != "ar" and not is_peer_family(r["family"]) for r in summary):
        lines += ["", "Fidelity against AR on the same prompts (95% intervals: Wilson for pass@1, "
                  "paired normal for the changes; relaxed: share of accepted drafts taken by a "
                  "relaxed rule):", ""] + fidelity_table(summary)
    loaded = sum(r["loaded_calls"] for r in summary)
    calls = sum(r["prompts"] for r in summary)
    if loaded:
        lines += ["", f"**Load warning:** {loaded} of {calls} timed calls ran while other "
                  f"processes used more than {100 * max_other_cpu:.0f}% of the CPU (column "
                  "'loaded'); their timings are less reliable. Rerun on an idle machine."]
    if len(by_category) > 1:
        lines += ["", "## By category", ""]
        header = "| category | method | prompts | tok/s | vs AR | vs SD | τ | D/token | pass@1 | agree | loglik |"
        lines += [header, "|---" * 11 + "|"]
        for name, rows in by_category.items():
            for r in rows:
                lines.append(f"| {name} | {r['method']} | {r['prompts']} | "
                             f"{_num(r['tokens_per_s_median'], '{:.1f}')} | "
                             f"{_num(r['speedup_vs_ar'], '{:.2f}', 'x')} | {_num(r['speedup_vs_sd'], '{:.2f}', 'x')} | "
                             f"{_num(r['tau'])} | {_num(r['deviation_per_token'], '{:.3f}')} | "
                             f"{_num(r['pass_at_1'])} | {_num(r['agreement'])} | {_num(r['loglik_mean'], '{:.3f}')} |")
    return "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> str:
    return _num(1e3 * seconds if aggregate.defined(seconds) else None, "{:.1f}")


def cost_table(rows: Sequence[dict]) -> list[str]:
    """The cost breakdown's Markdown lines: per method that drafted, τ, the draft lengths
    and the milliseconds per target pass (rows read back from JSON hold None for NaN).
    nsd's AR row comes first as the baseline: its verify ms is the one-token step as the
    run measured it, and its decode tok/s the rate the speculative rows have to beat once
    the prompt is read."""
    out = ["| method | τ | k̄ | plain | draft ms | verify ms | overhead ms | decode tok/s | predicted tok/s "
           "| draft prefill ms |", "|---" * 10 + "|"]
    for r in rows:
        if r.get("family") == "ar":
            out.append(f"| {r['method']} | {_num(r.get('tau'))} | - | - | - | {_ms(r.get('target_s_per_pass'))} | - | "
                       f"{_num(r.get('decode_tokens_per_s_median'), '{:.1f}')} | - | - |")
            continue
        if not aggregate.defined(r.get("mean_k")):
            continue
        out.append(f"| {r['method']} | {_num(r['tau'])} | {_num(r['mean_k'])} | "
                   f"{_num(r['plain_step_share'])} | {_ms(r['draft_s_per_pass'])} | "
                   f"{_ms(r['target_s_per_pass'])} | {_ms(r['overhead_s_per_pass'])} | "
                   f"{_num(r['decode_tokens_per_s_median'], '{:.1f}')} | "
                   f"{_num(r['predicted_tokens_per_s_median'], '{:.1f}')} | "
                   f"{_ms(r.get('draft_prefill_s_mean'))} |")
    return out


def method_table(rows: Sequence[dict]) -> list[str]:
    """The report's main table's Markdown lines, one row per method."""
    header = ("| method | prompts | tok/s (median) | vs AR | vs SD | τ | acceptance by position | "
              "D/token | pass@1 | agree w/ AR | exact | loglik | loaded |")
    out = [header, "|---" * 13 + "|"]
    for r in rows:
        out.append(f"| {r['method']} | {r['prompts']} | {_num(r['tokens_per_s_median'], '{:.1f}')} | "
                   f"{_num(r['speedup_vs_ar'], '{:.2f}', 'x')} | {_num(r['speedup_vs_sd'], '{:.2f}', 'x')} | "
                   f"{_num(r['tau'])} | {_positions(r['acceptance_by_position'])} | "
                   f"{_num(r['deviation_per_token'], '{:.3f}')} | {_num(r['pass_at_1'])} | "
                   f"{_num(r['agreement'])} | {_num(r['exact_match'])} | {_num(r['loglik_mean'], '{:.3f}')} | "
                   f"{r['loaded_calls'] or '-'} |")
    return out


def _interval(values: Sequence[float] | None, fmt: str, signed: bool = False) -> str:
    if not values or not aggregate.defined(values[0]):
        return "-"
    centre, lo, hi = values if len(values) == 3 else (None, *values)
    shown = "" if centre is None else (("{:+" + fmt[2:]) if signed else fmt).format(centre) + " "
    if not (aggregate.defined(lo) and aggregate.defined(hi)):
        return shown.strip() or "-"
    return f"{shown}[{fmt.format(lo)}, {fmt.format(hi)}]"


def _pass_cell(r: dict) -> str:
    if not aggregate.defined(r["pass_at_1"]):
        return "-"
    return f"{_num(r['pass_at_1'])} {_interval(r.get('pass_at_1_ci'), '{:.2f}')}".strip()


def fidelity_table(rows: Sequence[dict]) -> list[str]:
    """The fidelity table's Markdown lines (our methods only; peers have no AR pairing)."""
    out = ["| method | τ | relaxed | D/token | pass@1 [95% CI] | Δ pass@1 vs AR [95% CI] | "
           "Δ loglik/token vs AR [95% CI] | vs AR | vs SD |", "|---" * 9 + "|"]
    for r in rows:
        if is_peer_family(r["family"]):
            continue
        out.append(f"| {r['method']} | {_num(r['tau'])} | {_num(r['relaxed_share'])} | "
                   f"{_num(r['deviation_per_token'], '{:.3f}')} | "
                   f"{_pass_cell(r)} | "
                   f"{_interval(r.get('pass_at_1_change'), '{:.3f}', signed=True)} | "
                   f"{_interval(r.get('loglik_change'), '{:.3f}', signed=True)} | "
                   f"{_num(r['speedup_vs_ar'], '{:.2f}', 'x')} | {_num(r['speedup_vs_sd'], '{:.2f}', 'x')} |")
    return out


def paired_ratios(records: Sequence[dict]) -> dict[str, dict[str, float]]:
    """Per method, its paired median tokens/s ratio to each reference the run has (AR
    and llama.cpp's own decoding): what the documents' tables compare, kept so that the
    small summary answers them without the records."""
    labels = list(dict.fromkeys(r["method"] for r in records))
    references = [label for label in ("ar", *LLAMA_PEERS) if label in labels]
    return {label: {ref: paired_ratio(records, label, ref) for ref in references if ref != label}
            for label in labels}


def small_summary(results: dict) -> dict:
    """``results.json`` without its records, plus the paired ratios read from them and the
    per-prompt rates they come from: tens of kilobytes that the repository keeps of a run
    (``summary.json``), where the records run to megabytes."""
    small = {key: value for key, value in results.items() if key != "records"}
    small["paired"] = paired_ratios(results["records"])
    # Each prompt's tokens/s per method: what a paired median's bootstrap interval resamples.
    small["prompt_rates"] = {prompt: {m: float(f"{v:.6g}") for m, v in rates.items()}
                             for prompt, rates in prompt_rates(results["records"]).items()}
    small["weights"] = weights_used(results["records"])
    return small


def write_report(out_dir: Path, records: Sequence[dict], methods: Sequence[MethodSpec],
                 settings: dict, max_other_cpu: float) -> tuple[list[dict], str]:
    """Write ``results.json``, its small ``summary.json`` and ``report.md`` atomically;
    return the summary and the text."""
    summary = summarize(records, methods)
    by_category = summarize_by_category(records, methods)
    text = markdown(summary, by_category, settings, max_other_cpu, weights_used(records))
    results = {"settings": settings, "environment": environment(), "max_other_cpu": max_other_cpu,
               "summary": summary, "by_category": by_category, "records": list(records)}
    write_json_atomic(out_dir / "results.json", results)
    write_json_atomic(out_dir / SUMMARY, small_summary(results), indent=None)  # report.md is the readable one
    write_text_atomic(out_dir / "report.md", text)
    return summary, text
