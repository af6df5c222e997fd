"""BENCHMARKS.md's blocks of the measurement runs that are not ``nsd bench`` runs: the
verification kernels' step costs (``benchmarks/verify_kernel.py``), a long prompt's
prefill, the server soak, the serving benchmarks and the weight formats, each from its JSON
under ``benchmarks/results/``, with its plot beside it. :mod:`nsd.bench.headline` places
them in the documents, as it does the runs' own tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nsd import aggregate
from nsd.bench import plots, serve_report
from nsd.errors import NSDError

RESULTS = "benchmarks/results"


def _f(value: float | None, fmt: str = "{:.2f}") -> str:
    return fmt.format(value) if aggregate.defined(value) else "-"


@dataclass(frozen=True)
class MeasuredRef:
    """One cited measurement file under ``benchmarks/results/`` that is not an ``nsd bench``
    run (a kernel run of ``benchmarks/verify_kernel.py --out``, the soak, a serving or
    weight-format run): where it lies, its CPU class, the commit that added it, its command."""

    path: str  # the JSON under benchmarks/results/
    cpu: str  # a CpuClass key
    commit: str  # the commit that wrote the JSON into the repository
    command: str

    @property
    def block(self) -> str:
        """A kernel run's generated block: the file's name without .json, with dashes."""
        return "kernel-" + Path(self.path).stem.replace("_", "-")

    @property
    def plot(self) -> str:
        """Its plot beside it (drawn by :func:`draw_plots`): the same name, .png."""
        return f"{RESULTS}/{Path(self.path).with_suffix('.png').as_posix()}"


_VK = "python benchmarks/verify_kernel.py "
KERNELS = (
    MeasuredRef("verify_kernel.json", "amx", "068c68e",
              _VK + "--kernel amx --target qwen2.5-coder-1.5b-instruct --repeats 9 "
              "--ns 1,2,3,4,5,6,7,8,9,10,11,12,17 --out benchmarks/results/verify_kernel.json"),
    MeasuredRef("verify_kernel_vnni_zen4_runE.json", "vnni", "1030098",
              "GGML_NO_AMX=1 " + _VK + "--kernel vnni --repeats 9 --ns 1,2,3,4,5,6,7,8,9,12,16,17 "
              "--out benchmarks/results/verify_kernel_vnni_zen4_runE.json"),
    MeasuredRef("verify_kernel_vnni_zen4_runF.json", "vnni", "1030098",
              "GGML_NO_AMX=1 " + _VK + "--kernel vnni --repeats 9 --ns 1,2,3,4,5,6,7,8,9,12,16,17 "
              "--out benchmarks/results/verify_kernel_vnni_zen4_runF.json"),
    MeasuredRef("avx2/verify_kernel_avx2_zen3_quiet.json", "avx2", "07c2043",
              _VK + "--kernel avx2 --target qwen2.5-coder-1.5b-instruct "
              "--weights q4_0 --threads 2 --repeats 7 --ns 1,2,3,4,5,6,7,8,9,16 "
              "--out benchmarks/results/avx2/verify_kernel_avx2_zen3_quiet.json"),
)


def _read_run(root: Path, ref: MeasuredRef, what: str = "run") -> dict:
    """The measurement's JSON, or an NSDError naming the file and what it is."""
    path = root / RESULTS / ref.path
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise NSDError(f"{path}: cannot read the {what} ({exc})") from None


def _plot_lines(root: Path, ref: MeasuredRef, alt: str) -> list[str]:
    """A blank line and the run's plot, where it has been drawn (see draw_plots)."""
    return ["", f"![{alt}]({ref.plot})"] if (root / ref.plot).is_file() else []


def kernel_block(root: Path, ref: MeasuredRef) -> str:
    """c(n)/c(1) of ggml's path and nsd's kernel side by side, the one-token step's ratio,
    their agreement and which batch sizes kept every row bitwise the one-token step's."""
    data = _read_run(root, ref, "kernel run")
    theirs, ours = data["paths"]  # ggml's first, as verify_kernel.py writes them
    ns = sorted(data["paths"][ours]["ratio"], key=int)
    table = ["| n | " + " | ".join(ns) + " |", "|---" * (len(ns) + 1) + "|"]
    for name in (theirs, ours):
        ms = data["paths"][name]["c_ms"]
        table.append(f"| {name} c(n) ms | " + " | ".join(f"{ms[n]:.1f}" for n in ns) + " |")
    for name in (theirs, ours):
        ratios = data["paths"][name]["ratio"]
        table.append(f"| {name} c(n)/c(1) | " + " | ".join(f"{ratios[n]:.2f}" for n in ns) + " |")
    # the same costs over ggml's one-token step: the base a target set against ggml's c(1) means
    base = data["paths"][theirs]["c_ms"]["1"]
    table.append(f"| {ours} c(n) / {theirs} c(1) | "
                 + " | ".join(f"{data['paths'][ours]['c_ms'][n] / base:.2f}" for n in ns) + " |")
    one = data["paths"][ours]["c_ms"]["1"] / data["paths"][theirs]["c_ms"]["1"]
    agree = [v["new vs old"] for n, v in data["agreement"].items() if n.isdigit()]
    cpu = data["cpu"]
    # runs made before verify_kernel.py checked batch invariance do not say
    rows = data.get("batch_rows_equal_one_token_steps")
    invariance = "" if rows is None else " Batch rows bitwise equal to one-token steps at " + "; ".join(
        f"{name}: n = {', '.join(n for n in ns if rows[name][n]) or 'none'}" for name in (theirs, ours)) + "."
    return "\n".join([
        f"Run `{RESULTS}/{ref.path}` (CPU as recorded: {cpu['model']}, {cpu['cores']} cores, AMX {cpu['amx']}; "
        f"{data['weights']} weights, {data['threads']} threads, {data['prompt_tokens']}-token prompt, "
        f"median of {data['repeats']}, both paths in each repetition), committed in {ref.commit}. Command:",
        "", "```bash", ref.command, "```", "", *table, "",
        f"One-token step: {ours} / {theirs} = {one:.2f}. Argmax agreement with {theirs} "
        f"{min(a['argmax_agree'] for a in agree):.3f} at every n (softmax TV at most "
        f"{max(a['tv_max'] for a in agree):.3f})." + invariance]
        + _plot_lines(root, ref, f"step cost against tokens in the forward: {theirs} and {ours}"))


SOAK = MeasuredRef("serve/soak-20min-zen3.json", "avx2", "7ad1858",
                 "python benchmarks/serve_soak.py --minutes 20 --clients 4 "
                 "--json benchmarks/results/serve/soak-20min-zen3.json -- --target smollm2-135m-instruct "
                 "--proposer ngram --n-ctx 2048 --threads 1")


PREFILL = MeasuredRef("avx2/prefill_avx2_zen3_quiet.json", "avx2", "52e0872",
                    _VK + "--kernel avx2 --target qwen2.5-coder-1.5b-instruct --weights q4_0 --threads 2 "
                    "--repeats 1 --ns 1,2 --prefill 1500 --prefill-repeats 3 "
                    "--out benchmarks/results/avx2/prefill_avx2_zen3_quiet.json")


def prefill_block(root: Path, ref: MeasuredRef = PREFILL) -> str:
    """A long prompt's prefill on ggml's path and on nsd's kernel, interleaved (the run's
    c(1)/c(2) are from one repetition and left out)."""
    data = _read_run(root, ref, "prefill run")
    theirs, ours = data["paths"]
    pre, cpu = data["prefill"], data["cpu"]
    ms = pre["ms"]
    return "\n".join([
        f"Run `{RESULTS}/{ref.path}` (CPU as recorded: {cpu['model']}, {cpu['cores']} cores, AMX {cpu['amx']}; "
        f"{data['weights']} weights, {data['threads']} threads; a {pre['tokens']}-token prompt, no cache, "
        f"median of {pre['repeats']} after a warm-up, both paths in each repetition), committed in {ref.commit}. "
        "Command:", "", "```bash", ref.command, "```", "",
        "| path | prefill s | prompt tokens/s |", "|---|---|---|",
        *(f"| {name} | {ms[name] / 1000:.1f} | {pre['tokens'] / (ms[name] / 1000):.0f} |" for name in (theirs, ours)),
        "", f"{ours} over {theirs}: **{ms[theirs] / ms[ours]:.2f}x**.",
        *_plot_lines(root, ref, f"prefill time of a {pre['tokens']}-token prompt per path")])


def soak_block(root: Path, ref: MeasuredRef = SOAK) -> str:
    """The server soak (benchmarks/serve_soak.py): requests and statuses per kind, 5xx,
    latency, greedy answers against their run alone, prompt reuse after a dropped stream,
    and resident memory beside the prompt cache's bytes over the run."""
    data = _read_run(root, ref, "soak run")
    table = ["| kind | requests | statuses | p50 s | p95 s |", "|---|---|---|---|---|"]
    for kind, row in data["by_kind"].items():
        statuses = ", ".join(f"{n} × {code}" for code, n in sorted(row["statuses"].items()))
        table.append(f"| {kind} | {row['count']} | {statuses} | {_f(row['p50_s'])} | {_f(row['p95_s'])} |")
    mib = 2 ** 20
    samples = data["samples"]
    full = next(s for s in samples if s["nsd_prefix_cache_bytes_held"] >= 0.9 * s["nsd_prefix_cache_budget_bytes"])
    after = [s["process_resident_memory_bytes"] / mib for s in samples if s["t_s"] >= full["t_s"]]
    checks = ", ".join(f"{name.replace('_', ' ')}: {'yes' if ok else 'no'}" for name, ok in data["checks"].items())
    return "\n".join([
        f"Run `{RESULTS}/{ref.path}`: {data['minutes']:g} minutes, {data['settings']['clients']} clients on "
        f"the loopback, committed in {ref.commit}. Command:", "", "```bash", ref.command, "```", "", *table, "",
        f"{data['requests']} requests; 5xx: {data['server_errors_5xx']}; transport errors: "
        f"{len(data['transport_errors'])}; bad inputs with another status than their 4xx: "
        f"{data['bad_inputs_wrong_status']}. Greedy answers checked against their run alone: "
        f"{data['greedy_checked']}, of which {len(data['greedy_mismatches'])} differed "
        + "; ".join(f"({m['expected']!r} alone, {m['got']!r} in the batch)" for m in data["greedy_mismatches"][:3])
        + f". Follow-ups right after a dropped stream reusing its prompt: {data['follow_ups_after_drop_reusing']} "
        f"of {data['follow_ups_after_drop']} (on average {data['follow_up_cached_share']:.2f} of the prompt cached). "
        f"Resident memory {samples[0]['process_resident_memory_bytes'] / mib:.0f} MiB at the start; the prompt "
        f"cache reached its {data['cache_budget_mb']:.0f} MiB limit at {full['t_s'] / 60:.1f} min, after which "
        f"memory stayed between {min(after):.0f} and {max(after):.0f} MiB. The soak's own checks: {checks}.",
        *_plot_lines(root, ref, "resident memory and prompt cache over the soak")])


SERVE_BATCHING = MeasuredRef("zen4-host/serve-batching.json", "vnni", "b747e41",
                           "python benchmarks/serve_load.py --methods ar,nsd --concurrency 1,4,16 --rounds 2 "
                           "--requests 1 --max-tokens 48 --json benchmarks/results/zen4-host/serve-batching.json "
                           "-- --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct "
                           "--parallel 16 --n-ctx 1024 --proposer draft")
SERVE_REUSE = MeasuredRef("zen4-2026-12-07/serve_prefix_cache_defaults.json", "vnni", "52928b3",
                        "python benchmarks/serve_prefix_cache.py --proposer hybrid --max-chars 2600 "
                        "--json benchmarks/results/zen4-2026-12-07/serve_prefix_cache_defaults.json")


def serve_block(root: Path, batching: MeasuredRef = SERVE_BATCHING, reuse: MeasuredRef = SERVE_REUSE) -> str:
    """``nsd serve`` with several clients (throughput against one client, paired by round)
    and a conversation's next turn with and without its prompt reused."""
    load, chat = _read_run(root, batching, "serving run"), _read_run(root, reuse, "serving run")
    settings = load["settings"]
    cpu = chat["cpu"]
    return "\n".join([
        f"**Several clients at once.** Run `{RESULTS}/{batching.path}`, committed in {batching.commit}: one server "
        f"with 16 slots, every client sending one streamed chat completion of up to {settings['max_tokens']} tokens "
        f"at temperature {settings['temperature']:g}; levels {settings['concurrency']} clients, "
        f"{settings['rounds']} rounds, the second in reverse order. Command:",
        "", "```bash", batching.command, "```", "", *serve_report.scaling_table(load["rows"]),
        *_plot_lines(root, batching, "tokens/s against concurrent clients"), "",
        f"**The next turn of a conversation.** Run `{RESULTS}/{reuse.path}` (CPU as recorded: {cpu['model']}, "
        f"{cpu['cores']} cores, AMX {cpu['amx']}; proposer {chat['proposer']}, k = {chat['k']}, "
        f"{chat['max_tokens']} tokens a turn), committed in {reuse.commit}. Command:",
        "", "```bash", reuse.command, "```", "", *serve_report.reuse_table(chat["rows"]), "",
        f"The second turn's first token from the live cache: **{serve_report.reuse_speedup(chat['rows']):.1f}x** "
        "sooner than the same prompt cold."])


FORMATS = MeasuredRef("weight_formats_1.5b.json", "vnni", "08ff267",
                    "python benchmarks/weight_formats.py --model qwen2.5-coder-1.5b-instruct --repeats 9 "
                    "--problems 20 --out benchmarks/results/weight_formats_1.5b.json")


def formats_block(root: Path, ref: MeasuredRef = FORMATS) -> str:
    """What each weight format costs in quality (benchmarks/weight_formats.py): size,
    perplexity of held-in text and argmax agreement with the original file. Its timings are
    left out when the run was flagged as loaded (they were, for this run)."""
    data = _read_run(root, ref, "weight-format run")
    base = data["rows"][0]["perplexity"]  # the original file comes first
    table = ["| format | file | MiB | perplexity | vs original | argmax = original |", "|---|---|---|---|---|---|"]
    table += [f"| {r['format']} | `{r['file']}` | {r['size_mib']:.0f} | {r['perplexity']:.3f} | {r['perplexity'] / base - 1:+.1%} | "
              f"{r['argmax_agreement_with_original']:.3f} |" for r in data["rows"]]
    loaded = data.get("load", {}).get("flagged")
    cpu = data["cpu"]
    return "\n".join([
        f"Run `{RESULTS}/{ref.path}` ({data['model']}; {data['held_in_tokens']} held-in tokens of HumanEval "
        f"problems with their canonical solutions; CPU as recorded: {cpu['model']}, {cpu['cores']} cores), "
        f"committed in {ref.commit}. Command:", "", "```bash", ref.command, "```", "", *table, "",
        "Its step-cost columns are not shown: the run was flagged as made under load." if loaded else
        "Step costs per format: `c_ms` in the run's JSON.",
        *_plot_lines(root, ref, "perplexity against file size per weight format")])


def draw_plots(root: Path) -> list[str]:
    """Draw each cited measurement's plot that is not there yet (a drawn PNG is kept as it
    is: matplotlib's bytes vary between versions, and the run it shows does not)."""
    drawn = []
    jobs = [(ref, plots.plot_kernel_costs) for ref in KERNELS] + [
        (SOAK, lambda data, path: plots.plot_soak_memory(data["samples"], path)),
        (SERVE_BATCHING, lambda data, path: plots.plot_serve_scaling(data["rows"], path)),
        (FORMATS, lambda data, path: plots.plot_weight_formats(data["rows"], path)),
        (PREFILL, lambda data, path: plots.plot_prefill(data["prefill"]["ms"], data["prefill"]["tokens"], path))]
    for ref, draw in jobs:
        target = root / ref.plot
        if not target.is_file() and draw(_read_run(root, ref), target) is not None:
            drawn.append(ref.plot)
    return drawn
