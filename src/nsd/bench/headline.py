"""The results tables of README.md and BENCHMARKS.md, generated from the runs they cite
(``python benchmarks/headline.py``; ``--check`` says whether the documents are current).

Each table is computed from a run's ``summary.json`` (``results.json`` without the
records, :func:`nsd.bench.report.small_summary`), which the repository keeps of every
run, and written between two markers in the documents::

    <!-- generated: NAME (python benchmarks/headline.py) -->
    ...
    <!-- end: NAME -->

Nothing between the markers is typed by hand: a figure edited there differs from what
:func:`blocks` computes, and ``tests/test_benchmarks_doc.py`` fails. The runs cited, with
the CPU class, the command and the commit that last wrote each, are :data:`RUNS`; a run is
replaced by a newer one by editing its entry and running the script.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

from nsd import aggregate
from nsd.bench import frontier, measured, report, targets, vllm_report
from nsd.bench.measured import RESULTS
from nsd.bench.methods import LLAMA_PEERS
from nsd.bench.store import SUMMARY
from nsd.errors import NSDError

DOCUMENTS = ("README.md", "BENCHMARKS.md")


@dataclass(frozen=True)
class CpuClass:
    key: str
    name: str  # as the tables show it
    machine: str  # the machine the runs were measured on


CPU_CLASSES = (
    CpuClass("amx", "AMX", "Intel Xeon Sapphire Rapids, 2 cores"),
    CpuClass("vnni", "AVX-512 VNNI", "AMD EPYC Zen 4, 2 cores"),
    CpuClass("avx2", "AVX2", "AMD EPYC Zen 3, 2 cores"),
)


@dataclass(frozen=True)
class RunRef:
    """One cited run: where its summary lies, what it measured, how it was made."""

    path: str  # under benchmarks/results/
    cpu: str  # a CpuClass key
    task: str
    commit: str  # the commit that last wrote the run's results into the repository
    command: str
    proposer: str  # the proposer of the SD and NSD rows the headline reads
    headline: bool = False  # a row of the README's headline table


_AMX = "bash benchmarks/run_amx.sh humaneval-t0 spec-bench-t0 humaneval-t0.8 spec-bench-t0.8"
_ZEN4 = "OUT_ROOT=benchmarks/results/zen4-2026-12-07 bash benchmarks/run_noamx.sh humaneval-t0 spec-bench-t0"
_ZEN4_HOST = ("OUT_ROOT=benchmarks/results/zen4-host bash benchmarks/run_noamx.sh humaneval164-t0-hybrid "
              "spec-bench-t0.8-hybrid-x3 humaneval-t0.8-hybrid")
_FRONTIER = "bash benchmarks/run_frontier.sh"


def _zen3(task: str, out: str) -> str:
    """The Zen 3 runs' command: one nsd bench call per task, AR and llama.cpp's plain
    decoding in the same run."""
    return ("nsd bench --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --theta 0.9 "
            f"--max-new-tokens 128 --no-progress --rerun-loaded {task} "
            f"--methods ar,sd,nsd,llama-generate --out benchmarks/results/zen3/{out}")


RUNS: tuple[RunRef, ...] = (
    RunRef("amx/humaneval-t0", "amx", "HumanEval-40, T = 0", "444df9f", _AMX, "draft", True),
    RunRef("amx/spec-bench-t0", "amx", "Spec-Bench 13×3, T = 0", "444df9f", _AMX, "draft", True),
    RunRef("amx/humaneval-t0.8", "amx", "HumanEval-40, T = 0.8", "444df9f", _AMX, "draft"),
    RunRef("amx/spec-bench-t0.8", "amx", "Spec-Bench 13×3, T = 0.8", "444df9f", _AMX, "draft"),
    RunRef("zen4-2026-12-07/humaneval-t0", "vnni", "HumanEval-40, T = 0", "b6c99b3", _ZEN4, "hybrid", True),
    RunRef("zen4-2026-12-07/spec-bench-t0", "vnni", "Spec-Bench 13×3, T = 0", "b6c99b3", _ZEN4, "hybrid", True),
    RunRef("zen4-host/humaneval164-t0-hybrid", "vnni", "HumanEval-164, T = 0", "12bf785", _ZEN4_HOST, "hybrid"),
    RunRef("zen4-host/humaneval-t0.8-hybrid", "vnni", "HumanEval-40, T = 0.8", "12bf785", _ZEN4_HOST, "hybrid"),
    RunRef("zen4-host/spec-bench-t0.8-hybrid-x3", "vnni", "Spec-Bench 13×3, T = 0.8", "12bf785", _ZEN4_HOST,
           "hybrid"),
    RunRef("zen3/humaneval20-t0", "avx2", "HumanEval-20, T = 0", "bdd65bb",
           _zen3("--dataset humaneval --limit 20", "humaneval20-t0"), "hybrid"),
    RunRef("zen3/humaneval40-t0", "avx2", "HumanEval-40, T = 0", "29564ca",
           _zen3("--dataset humaneval --limit 40", "humaneval40-t0"), "hybrid", True),
    RunRef("zen3/specbench39-t0", "avx2", "Spec-Bench 13×3, T = 0", "a745dcb",
           _zen3("--dataset spec-bench --limit 3 --per-category", "specbench39-t0"), "hybrid", True),
    RunRef("zen3/humaneval40-t0.8", "avx2", "HumanEval-40, T = 0.8", "eb3a104",
           _zen3("--dataset humaneval --limit 40 --temperature 0.8 --top-p 0.95 --seed 0", "humaneval40-t0.8"),
           "hybrid"),
    RunRef("zen3/specbench39-t0.8", "avx2", "Spec-Bench 13×3, T = 0.8", "c738a1a",
           _zen3("--dataset spec-bench --limit 3 --per-category --temperature 0.8 --top-p 0.95 --seed 0",
                 "specbench39-t0.8"), "hybrid"),
)

# The quality-speed frontier: θ, budgets and typical acceptance at a fixed k = 4 (Zen 4,
# measured before nsd's VNNI kernels, when speculation with k = 4 was slower than AR there).
FRONTIER: tuple[RunRef, ...] = (
    RunRef("frontier/humaneval-t0", "vnni", "HumanEval-164, T = 0", "998fd5c", _FRONTIER, "draft"),
    RunRef("frontier/humaneval-t0.8", "vnni", "HumanEval-164, T = 0.8", "ca2b814", _FRONTIER, "draft"),
    RunRef("frontier/specbench-t0", "vnni", "Spec-Bench 13×3, T = 0", "43f37c6", _FRONTIER, "draft"),
    RunRef("frontier/specbench-t0.8", "vnni", "Spec-Bench 13×3, T = 0.8", "1d1f6c4", _FRONTIER, "draft"),
    # The same grid with the engines' rules, reduced to fit the time at hand (Zen 3).
    RunRef("frontier-zen3/specbench-t0", "avx2", "Spec-Bench 13×2, T = 0, with the engines' rules (Zen 3)",
           "d5b328a", 'FRONTIER_OUT=benchmarks/results/frontier-zen3 FRONTIER_ARGS="--limit 2 --no-progress" '
           "bash benchmarks/run_frontier.sh specbench-t0", "draft"),
    RunRef("frontier-zen3/specbench-t0.8", "avx2",
           "Spec-Bench 13×2, T = 0.8, with the engines' rules (Zen 3)", "9a7d998",
           'FRONTIER_OUT=benchmarks/results/frontier-zen3 FRONTIER_ARGS="--limit 2 --no-progress" '
           "bash benchmarks/run_frontier.sh specbench-t0.8", "draft"),
    RunRef("frontier-zen3/humaneval-t0", "avx2", "HumanEval-40, T = 0, with the engines' rules (Zen 3)",
           "7cbc5a7", 'FRONTIER_OUT=benchmarks/results/frontier-zen3 FRONTIER_ARGS="--limit 40 --no-progress" '
           "bash benchmarks/run_frontier.sh humaneval-t0", "draft"),
    RunRef("frontier-zen3/humaneval-t0.8", "avx2", "HumanEval-40, T = 0.8, with the engines' rules (Zen 3)",
           "900e076", 'FRONTIER_OUT=benchmarks/results/frontier-zen3 FRONTIER_ARGS="--limit 40 --no-progress" '
           "bash benchmarks/run_frontier.sh humaneval-t0.8", "draft"),
)
VLLM = RunRef("vllm", "vnni", "HumanEval 5 + Spec-Bench 5, T = 0 and 0.8", "7cd5386",
              ".venv-vllm/bin/python benchmarks/vllm_bench.py --limit 5 --max-tokens 128 "
              "--out benchmarks/results/vllm", "draft")
PICTURE = "frontier/humaneval-t0/speedup_vs_pass_change.png"  # the README's one picture


def load_summary(root: Path, run: RunRef) -> dict:
    path = root / RESULTS / run.path / SUMMARY
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise NSDError(f"{path}: cannot read the run's summary ({exc})") from None


def _row(summary: dict, family: str, proposer: str) -> dict | None:
    for row in summary["summary"]:
        if row["family"] == family and (family == "ar" or row["proposer"] == proposer) \
                and (family != "nsd" or row["theta"] == 0.9):
            return row
    return None


def _x(value: float | None) -> str:
    return f"{value:.2f}x" if aggregate.defined(value) else "-"


def _f(value: float | None, fmt: str = "{:.2f}") -> str:
    return fmt.format(value) if aggregate.defined(value) else "-"


def _faster_peer(summary: dict, method: str) -> str:
    """``method`` against the faster of llama.cpp's own plain and speculative decoding
    (by each one's paired ratio to AR), as the speed targets compare them."""
    paired = summary["paired"]
    peers = [p for p in LLAMA_PEERS if p in paired and aggregate.defined(paired[p].get("ar"))]
    if not peers:
        return "no llama.cpp peer in the run"
    peer = max(peers, key=lambda p: paired[p]["ar"])
    return f"{_x(paired[method][peer])} ({peer})"


def _loaded(summary: dict) -> str:
    """A note on the timed calls that ran beside another busy process (empty when none
    did, or the run predates the count): their speeds are the less reliable ones."""
    rows = summary["summary"]
    counts = [r.get("loaded_calls") for r in rows]
    if not all(isinstance(c, int) for c in counts) or not sum(counts):
        return ""
    return f" ({sum(counts)} of {sum(r['prompts'] for r in rows)} calls loaded)"


def _link(run: RunRef) -> str:
    return f"[`{run.path}`]({RESULTS}/{run.path}/)"


def headline_table(root: Path) -> str:
    """The README's table: per CPU class its headline runs, NSD θ 0.9 and SD against AR
    and against llama.cpp, with D/token and pass@1; a class without a run says so."""
    lines = ["| CPU class | task | AR tok/s | SD vs AR | NSD θ 0.9 vs AR | NSD vs llama.cpp | NSD D/token "
             "| pass@1 AR / SD / NSD | run (commit) |", "|---" * 9 + "|"]
    for cpu in CPU_CLASSES:
        runs = [r for r in RUNS if r.cpu == cpu.key and r.headline]
        if not runs:
            lines.append(f"| {cpu.name} ({cpu.machine}) | not yet measured | | | | | | | |")
            continue
        for run in runs:
            summary = load_summary(root, run)
            ar, sd, nsd = (_row(summary, f, run.proposer) for f in ("ar", "sd", "nsd"))
            if ar is None or sd is None or nsd is None:
                raise NSDError(f"{run.path}: no AR, SD and NSD θ 0.9 rows with the {run.proposer} proposer")
            passes = " / ".join(_f(r["pass_at_1"]) for r in (ar, sd, nsd)) \
                if any(aggregate.defined(r["pass_at_1"]) for r in (ar, sd, nsd)) else "n/a (no tests)"
            lines.append(f"| {cpu.name} ({cpu.machine}) | {run.task}{_loaded(summary)} "
                         f"| {_f(ar['tokens_per_s_median'], '{:.1f}')} "
                         f"| {_x(sd['speedup_vs_ar'])} | **{_x(nsd['speedup_vs_ar'])}** "
                         f"| {_faster_peer(summary, nsd['method'])} "
                         f"| {_f(nsd['deviation_per_token'], '{:.3f}')} | {passes} "
                         f"| {_link(run)} ({run.commit}) |")
    return "\n".join(lines)


def _cpu_line(summary: dict) -> str:
    cpu = summary.get("environment", {}).get("cpu") or {}
    if not cpu:
        return "CPU not recorded"
    return f"{cpu.get('model')}, {cpu.get('cores')} cores, AMX {cpu.get('amx')}"


def run_block(root: Path, run: RunRef, fidelity: bool = False) -> str:
    """One run in BENCHMARKS.md: what it is, its command and commit, its table (the
    report's own, computed by :mod:`nsd.bench.report` from the summary) and its plot."""
    summary = load_summary(root, run)
    generation = summary["settings"]["generation"]
    rows = summary["summary"]
    table = report.fidelity_table(rows) if fidelity else report.method_table(rows)
    if not fidelity and any(aggregate.defined(r.get("mean_k")) for r in rows):
        table += ["", "Where the time goes, per target pass (k̄: mean tokens drafted per pass; plain: "
                  "share of passes that drafted nothing; draft prefill: the draft model reading the prompt, "
                  "once per request, mean per prompt and not in draft ms, - where the run predates "
                  "that measure; ar: the one-token step and the decode rate, prompt excluded, as measured "
                  "in the run):", "", *report.cost_table(rows)]
    if fidelity:  # a frontier run: which rule is fastest at each quality level
        execute = any(aggregate.defined(r.get("pass_at_1")) for r in rows)
        points, quality = frontier.frontier_points(rows, execute)
        table += ["", *frontier.fastest_table(points, quality, rows, execute)]
        if against_best := frontier.nsd_against_best(points, rows, execute, summary.get("prompt_rates")):
            table += ["", *against_best]
        if cost := frontier.relaxed_cost_table(rows, generation["temperature"]):
            table += ["", "What the relaxed accepts cost (D per relaxed accept is 1 at T = 0; the last "
                      "column is the log-likelihood change against SD divided by the relaxed "
                      "accepts per token):",
                      "", *cost]
        if positions := frontier.position_table(rows):
            table += ["", *positions]
    plot = next((p for p in (f"{RESULTS}/{run.path}/{name}" for name in
                             (("frontier_rules.png",) if fidelity else ()) +
                             ("speedup_vs_pass_change.png", "quality_vs_speedup.png"))
                 if (root / p).is_file()), f"{RESULTS}/{run.path}/quality_vs_speedup.png")
    lines = [f"#### {run.task}: `{RESULTS}/{run.path}/`", "",
             f"CPU as recorded: {_cpu_line(summary)}. k = {generation['k']}, "
             f"{generation['max_new_tokens']} new tokens at most, weights: {summary.get('weights') or 'not recorded'}. "
             f"Results committed in {run.commit}. Command:", "", "```bash", run.command, "```", "",
             *table, "", f"![{run.task}]({plot})"]
    return "\n".join(lines)


def vllm_block(root: Path) -> str:
    path = root / RESULTS / VLLM.path / "results.json"
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise NSDError(f"{path}: cannot read the vLLM run ({exc})") from None
    lines = [f"Run `{RESULTS}/{VLLM.path}/` ({'; '.join(results['environment'])}), committed in "
             f"{VLLM.commit}. Command:", "", "```bash", VLLM.command, "```", "",
             *vllm_report.render_table(results["summary"]["All prompts"]), "",
             f"![each vLLM method's speed over vLLM plain, with its D/token]({RESULTS}/{VLLM.path}/vllm_speedups.png)"]
    return "\n".join(lines)


def targets_block(root: Path) -> str:
    """The CPU speed targets (:mod:`nsd.bench.targets`) read from the runs' summaries: the
    stated targets one row each, the "every method ≥ 0.97× AR" rows counted."""
    runs = {}
    for ref in RUNS:
        run = dataclasses.replace(targets.load_run(root / RESULTS / ref.path), name=ref.path, cpu_class=ref.cpu)
        runs[run.name] = run
    checks = [c for run in runs.values() for c in targets.check(run)]
    floor = [c for c in checks if c.target.family == "*"]
    lowest = min(floor, key=lambda c: c.ratio)
    met = sum(c.ratio >= c.target.at_least for c in floor)
    return "\n".join([targets.format_checks([c for c in checks if c.target.family != "*"], runs), "",
                      f"{floor[0].target.label}: {met} of {len(floor)} met; the lowest {lowest.ratio:.2f}x "
                      f"({lowest.method}, `{lowest.run}`)."])


def blocks(root: Path) -> dict[str, str]:
    """Every generated block by name, as the documents must hold it."""
    out = {"headline": headline_table(root),
           "picture": f"![speed against the change in pass@1, per method]({RESULTS}/{PICTURE})"}
    for cpu in CPU_CLASSES:
        runs = [r for r in RUNS if r.cpu == cpu.key]
        out[f"runs-{cpu.key}"] = "\n\n".join(run_block(root, r) for r in runs) if runs else \
            f"Not yet measured: no `nsd bench` run on an {cpu.name} CPU ({cpu.machine}) is in the repository."
    out["targets"] = targets_block(root)
    out["frontier"] = "\n\n".join(run_block(root, r, fidelity=True) for r in FRONTIER)
    out["vllm"] = vllm_block(root)
    for ref in measured.KERNELS:
        out[ref.block] = measured.kernel_block(root, ref)
    out["prefill-avx2"] = measured.prefill_block(root)
    out["soak"] = measured.soak_block(root)
    out["serve"] = measured.serve_block(root)
    out["formats"] = measured.formats_block(root)
    return out


_BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) \(python benchmarks/headline\.py\) -->\n)"
                    r"(?P<body>.*?)"
                    r"(\n<!-- end: (?P=name) -->)", re.S)


def render(text: str, generated: dict[str, str]) -> str:
    """``text`` with every marked block replaced by its generated content (an unknown
    block name is an error: a table nobody regenerates would go stale)."""
    def fill(match: re.Match) -> str:
        name = match["name"]
        if name not in generated:
            raise NSDError(f"unknown generated block {name!r}")
        return match.group(1) + generated[name] + match.group(4)
    return _BLOCK.sub(fill, text)


def marked(text: str) -> dict[str, str]:
    """The marked blocks of a document as it stands, by name."""
    return {m["name"]: m["body"] for m in _BLOCK.finditer(text)}


def stale(root: Path) -> list[str]:
    """The documents whose marked blocks differ from what the runs give ([] = current)."""
    generated = blocks(root)
    out = []
    for name in DOCUMENTS:
        text = (root / name).read_text(encoding="utf-8")
        if render(text, generated) != text:
            out.append(name)
    return out


def write(root: Path) -> list[str]:
    """Regenerate the marked blocks in place (drawing missing kernel plots first); returns
    the documents that changed."""
    measured.draw_plots(root)
    generated = blocks(root)
    changed = []
    for name in DOCUMENTS:
        path = root / name
        text = path.read_text(encoding="utf-8")
        new = render(text, generated)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(name)
    return changed
