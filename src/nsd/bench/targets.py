"""Speed targets checked against finished ``nsd bench`` runs (``benchmarks/speed_targets.py``).

Each target is a paired ratio: the median over prompts of one method's tokens/s over a
reference's on the same prompt in the same interleaved run (:mod:`nsd.bench.speed`). The
targets are the CPU speed targets the project set itself: some hold for any CPU, some
only where the CPU has AMX (issue 26), some for AVX2-only CPUs (issue 44, with nsd's AVX2
kernels). A run on a CPU without AMX still shows its figure against the AMX targets, marked
as not applicable, because "what it is without AMX" is asked for too; the AVX2 targets are
read only on runs known to come from an AVX2-only CPU.

Where a ratio to AR falls short, :func:`shortfall` says what the method's time would have
to be, part by part (prefill, drafting, verification, the rest), each part alone taking the
whole cut with the others held at their measured cost. It reads aggregate times (all
prompts' seconds over all their tokens), which weigh long answers more than the paired
median does, so it is a guide to where the time must come from, not a second verdict.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from nsd.bench.methods import LLAMA_PEERS, is_peer_family
from nsd.bench.speed import by_prompt, paired_ratio
from nsd.bench.store import SUMMARY, read_journal
from nsd.errors import NSDError


@dataclass(frozen=True)
class Target:
    label: str
    family: str  # "nsd", "sd", or "*" for every method of nsd's own (peers left out)
    reference: str  # "ar", or "llama": the faster of llama.cpp's own plain and speculative decoding
    at_least: float
    temperature: str  # "zero", "sampled" or "any"
    cpu: str  # the CPU class it is stated for: "amx", "avx2" (AVX2 without AVX-512) or "any"


TARGETS: tuple[Target, ...] = (
    Target("NSD θ 0.9 ≥ 1.6× AR at T = 0", "nsd", "ar", 1.6, "zero", "amx"),
    Target("NSD θ 0.9 ≥ 1.3× AR at T > 0", "nsd", "ar", 1.3, "sampled", "amx"),
    Target("SD ≥ 1.1× AR at T = 0", "sd", "ar", 1.1, "zero", "amx"),
    Target("NSD θ 0.9 ≥ 1.6× the faster llama.cpp decoding", "nsd", "llama", 1.6, "zero", "amx"),
    Target("NSD θ 0.9 ≥ 1.3× AR at T = 0 (AVX2)", "nsd", "ar", 1.3, "zero", "avx2"),
    Target("NSD θ 0.9 ≥ 1.1× AR at T > 0 (AVX2)", "nsd", "ar", 1.1, "sampled", "avx2"),
    Target("SD ≥ 1.05× AR at T = 0 (AVX2)", "sd", "ar", 1.05, "zero", "avx2"),
    Target("every method ≥ 0.97× AR", "*", "ar", 0.97, "any", "any"),
)


@dataclass(frozen=True)
class Run:
    """One finished (or partial) ``nsd bench`` output directory: its records, or, for a
    run the repository keeps only the summary of, its summary rows and paired ratios."""

    name: str
    records: tuple[dict, ...]
    temperature: float
    cpu: str
    amx: bool
    rows: tuple[dict, ...] = ()  # summary.json's rows, where there are no records
    paired: dict | None = None  # summary.json's paired ratios: method -> reference -> ratio
    # "avx2" where the caller knows the run came from an AVX2-only CPU (a run records its
    # CPU's model and AMX, not its vector extensions): the AVX2 targets are read only then
    cpu_class: str = ""


@dataclass(frozen=True)
class Check:
    run: str
    target: Target
    method: str
    reference: str  # the method label the ratio is against
    ratio: float
    applies: bool  # False: a target stated for AMX, read on a CPU without it

    @property
    def verdict(self) -> str:
        if math.isnan(self.ratio):
            return "no paired prompts"
        met = self.ratio >= self.target.at_least
        if not self.applies:
            return ("would be met" if met else "would not be met") + " (stated for AMX)"
        return "met" if met else "NOT met"


def load_run(directory: Path) -> Run:
    """A run's records (its journal) with the temperature and CPU it recorded; without a
    journal, its ``summary.json`` (the paired ratios the checks need, no shortfall)."""
    journal, results = directory / "journal.jsonl", directory / "results.json"
    if not journal.is_file():
        if (directory / SUMMARY).is_file():
            return _load_summary(directory)
        raise NSDError(f"{directory}: no journal.jsonl or {SUMMARY} (is this an `nsd bench --out` directory?)")
    records = tuple(read_journal(journal)[0].values())
    if not records:
        raise NSDError(f"{journal}: no records yet")
    settings_path = results if results.is_file() else directory / "settings.json"
    try:
        saved = json.loads(settings_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise NSDError(f"{settings_path}: cannot read the run's settings ({exc})") from None
    settings = saved.get("settings", saved)
    # results.json is written when the run ends; a run still going has only settings.json,
    # which does not record the CPU.
    cpu = saved.get("environment", {}).get("cpu", {})
    return Run(name=directory.as_posix().rstrip("/"), records=records,
               temperature=float(settings["generation"]["temperature"]),
               cpu=cpu.get("model", "CPU not recorded (run unfinished)"),
               amx=str(cpu.get("amx", "False")) == "True")


def _load_summary(directory: Path) -> Run:
    path = directory / SUMMARY
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        rows, paired = tuple(saved["summary"]), saved["paired"]
    except (OSError, ValueError, KeyError) as exc:
        raise NSDError(f"{path}: cannot read the run's summary ({exc})") from None
    cpu = saved.get("environment", {}).get("cpu", {})
    return Run(name=directory.as_posix().rstrip("/"), records=(),
               temperature=float(saved["settings"]["generation"]["temperature"]),
               cpu=cpu.get("model", "CPU not recorded"), amx=str(cpu.get("amx", "False")) == "True",
               rows=rows, paired=paired)


def _methods(run: Run) -> list[tuple[str, str, float | None]]:
    """(label, family, θ) of each method, in the run's order."""
    source = run.records or run.rows
    return list({r["method"]: (r["method"], r["family"], r.get("theta")) for r in source}.values())


def _ratio(run: Run, method: str, reference: str) -> float:
    if run.paired is None:
        return paired_ratio(run.records, method, reference)
    value = run.paired.get(method, {}).get(reference)
    return math.nan if value is None else value


def _applies(target: Target, temperature: float) -> bool:
    return {"zero": temperature == 0, "sampled": temperature > 0, "any": True}[target.temperature]


def check(run: Run, targets: Sequence[Target] = TARGETS) -> list[Check]:
    """Every target that concerns this run's temperature, for each method it names."""
    methods = _methods(run)
    labels = [label for label, _, _ in methods]
    family = {label: f for label, f, _ in methods}
    theta = {label: t for label, _, t in methods}
    peers = [p for p in LLAMA_PEERS if p in labels]
    faster_peer = max(peers, key=lambda p: _ratio(run, p, "ar"), default=None)
    out = []
    for target in targets:
        if not _applies(target, run.temperature) or (target.cpu == "avx2" and run.cpu_class != "avx2"):
            continue
        if target.reference == "llama":
            if faster_peer is None:
                continue
            reference = faster_peer
        else:
            reference = target.reference
        for label in labels:
            f = family[label]
            if label == reference or f == "ar" or is_peer_family(f):
                continue
            if target.family != "*" and (f != target.family or (f == "nsd" and theta[label] != 0.9)):
                continue
            out.append(Check(run.name, target, label, reference,
                             _ratio(run, label, reference), target.cpu != "amx" or run.amx))
    return out


def shortfall(run: Run, method: str, at_least: float, reference: str = "ar") -> dict | None:
    """What ``method``'s time per token would have to be for ``at_least`` × the reference's
    aggregate speed, and what each part would have to cost alone (None when it is met,
    the run has no paired prompts, or only its summary is at hand)."""
    pairs = [(rs[method], rs[reference]) for rs in by_prompt(run.records).values()
             if method in rs and reference in rs]
    if not pairs:
        return None

    def visible(r: dict) -> float:
        return r["tokens_per_s"] * r["stats"]["wall_s"]

    ours = [m["stats"] for m, _ in pairs]
    tokens = sum(visible(m) for m, _ in pairs)
    ref_s_per_token = sum(a["stats"]["wall_s"] for _, a in pairs) / sum(visible(a) for _, a in pairs)
    parts = {"prefill": sum(s["prefill_s"] for s in ours), "draft": sum(s["propose_s"] for s in ours),
             "verify": sum(s["target_s"] for s in ours)}
    wall = sum(s["wall_s"] for s in ours)
    parts["rest"] = wall - sum(parts.values())
    allowed = tokens * ref_s_per_token / at_least
    cut = wall - allowed
    if cut <= 0:
        return None
    passes = sum(s["target_passes"] for s in ours)
    return {"method": method, "ratio_aggregate": ref_s_per_token * tokens / wall, "at_least": at_least,
            "ms_per_token": 1e3 * wall / tokens, "needed_ms_per_token": 1e3 * allowed / tokens,
            "passes": passes, "prompts": len(pairs), "tau": sum(s["new_tokens"] for s in ours) / passes,
            # The prompt's prefill is paid once per prompt, the rest once per pass.
            "parts": {name: {"unit": "ms/prompt" if name == "prefill" else "ms/pass",
                             "now": 1e3 * seconds / (len(pairs) if name == "prefill" else passes),
                             "alone": (1e3 * (seconds - cut) / (len(pairs) if name == "prefill" else passes)
                                       if seconds > cut else None)}
                      for name, seconds in parts.items()}}


def format_checks(checks: Sequence[Check], runs: dict[str, Run]) -> str:
    lines = ["| run | CPU | T | target | method | vs | paired ratio | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for c in checks:
        run = runs[c.run]
        cpu = f"{run.cpu}{', AMX' if run.amx else ', no AMX'}"
        lines.append(f"| {c.run} | {cpu} | {run.temperature:g} | {c.target.label} | {c.method} | {c.reference} "
                     f"| {c.ratio:.2f}x | {c.verdict} |")
    return "\n".join(lines)


def format_shortfall(run: str, gap: dict) -> str:
    parts = ", ".join(
        f"{name} {p['now']:.1f} {p['unit']} → "
        + (f"{p['alone']:.1f} alone" if p["alone"] is not None else "not enough alone")
        for name, p in gap["parts"].items())
    return (f"- {run}, {gap['method']}: {gap['ratio_aggregate']:.2f}x AR in aggregate over {gap['prompts']} prompts "
            f"(τ {gap['tau']:.2f}, {gap['passes']} passes); {gap['at_least']:g}x needs "
            f"{gap['needed_ms_per_token']:.1f} ms/token against {gap['ms_per_token']:.1f}: {parts}")
