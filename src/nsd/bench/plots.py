"""PNG figures from the per-method summary (matplotlib, headless Agg backend).

* ``speedup_vs_theta.png``: NSD speedup over AR against θ, one line per proposer, with
  exact SD as a dashed reference (θ = 0 is SD).
* ``quality_vs_speedup.png``: the trade-off: speedup over AR against quality (pass@1
  where HumanEval ran, else agreement with AR, else mean target log-likelihood).
* ``accepted_length.png``: how many draft tokens each target pass accepted, per method.
* ``speedup_vs_pass_change.png``: the frontier: speedup over AR against the change in
  pass@1 from AR (paired 95% interval as error bars), one point per method/θ/B.
* ``deviation_vs_loglik.png``: measured D/token against the change in the target's mean
  log-likelihood of the outputs (paired 95% interval).
* ``acceptance_by_position.png``: P(draft position i accepted | reached), one line per method.
* ``vllm_speedups.png`` (``benchmarks/vllm_bench.py``): each vLLM method's speed over vLLM
  plain, one bar per temperature, labelled with its D/token.
* The measurement plots BENCHMARKS.md shows beside their JSON (:mod:`nsd.bench.measured`):
  step cost against tokens per forward, a long prompt's prefill, memory over the server
  soak, tokens/s against concurrent clients, perplexity against size per weight format.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Sequence

from nsd.bench.methods import is_peer_family
from nsd.aggregate import defined as _ok


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: the benchmark runs on headless machines
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def _figure(path: Path, figsize: tuple[float, float]) -> Iterator:
    """One figure's axes; on leaving the block the figure is written to ``path``
    atomically, like every other output file, and closed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=figsize)
    try:
        yield ax
        fig.tight_layout()
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, dpi=120)
        tmp.replace(path)
    finally:
        plt.close(fig)


def quality_metric(summary: Sequence[dict]) -> tuple[str, str] | None:
    """The quality column to plot: the first one every speculative row has."""
    for key, name in (("pass_at_1", "pass@1"), ("agreement", "token agreement with AR"),
                      ("loglik_mean", "mean target log-likelihood (nats)")):
        if summary and all(_ok(r.get(key)) for r in summary):
            return key, name
    return None


def plot_speedup_vs_theta(summary: Sequence[dict], path: Path) -> Path | None:
    rows = [r for r in summary if r["family"] == "nsd" and _ok(r["speedup_vs_ar"])]
    if not rows:
        return None
    with _figure(path, (6, 4)) as ax:
        for proposer in dict.fromkeys(r["proposer"] for r in rows):
            points = sorted((r["theta"], r["speedup_vs_ar"]) for r in rows if r["proposer"] == proposer)
            line, = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"NSD ({proposer})")
            sd = [r for r in summary if r["method"] == f"sd/{proposer}" and _ok(r["speedup_vs_ar"])]
            if sd:
                ax.axhline(sd[0]["speedup_vs_ar"], linestyle="--", color=line.get_color(),
                           label=f"SD ({proposer})")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xlabel("θ (nucleus threshold)")
        ax.set_ylabel("speedup over AR (median tok/s ratio)")
        ax.legend()
    return path


def plot_quality_vs_speedup(summary: Sequence[dict], path: Path) -> Path | None:
    rows = [r for r in summary if _ok(r["speedup_vs_ar"])]
    metric = quality_metric(rows)
    if not rows or metric is None:
        return None
    key, name = metric
    with _figure(path, (6, 4)) as ax:
        for r in rows:
            ax.scatter(r["speedup_vs_ar"], r[key], marker="s" if r["family"].startswith("hf-") else "o")
            ax.annotate(r["method"], (r["speedup_vs_ar"], r[key]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("speedup over AR")
        ax.set_ylabel(name)
        ax.set_title("quality vs speed")
    return path


def plot_accepted_length(summary: Sequence[dict], path: Path) -> Path | None:
    rows = [r for r in summary if sum(r.get("accepted_length_histogram") or [])]
    if not rows:
        return None
    with _figure(path, (max(6, len(rows) * 0.9), 4)) as ax:
        width = 0.8 / len(rows)
        for i, r in enumerate(rows):
            counts = r["accepted_length_histogram"]
            total = sum(counts)
            xs = [n + (i - (len(rows) - 1) / 2) * width for n in range(len(counts))]
            ax.bar(xs, [c / total for c in counts], width=width, label=r["method"])
        ax.set_xlabel("draft tokens accepted in one target pass")
        ax.set_ylabel("share of passes")
        ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1.0), loc="upper left")  # outside the bars
    return path


def _frontier_rows(summary: Sequence[dict], key: str) -> list[dict]:
    return [r for r in summary if r["family"] != "ar" and not is_peer_family(r["family"])
            and r.get(key) and _ok(r[key][0])]


def _errorbar_points(ax, rows: Sequence[dict], x_of, key: str, horizontal: bool) -> None:
    """One point per row; ``key`` holds (centre, low, high) drawn as an error bar. Methods
    are named in a legend beside the axes, not next to their points: NSD settings often
    land within a few hundredths of each other and labels on the points overprint."""
    for r in rows:
        centre, lo, hi = r[key]
        err = [[centre - lo], [hi - centre]] if _ok(lo) and _ok(hi) else None
        x, y = (centre, x_of(r)) if horizontal else (x_of(r), centre)
        ax.errorbar(x, y, xerr=err if horizontal else None, yerr=None if horizontal else err,
                    fmt="o", capsize=3, label=r["method"])
    ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1.0), loc="upper left")


def plot_speedup_vs_pass_change(summary: Sequence[dict], path: Path) -> Path | None:
    rows = [r for r in _frontier_rows(summary, "pass_at_1_change") if _ok(r["speedup_vs_ar"])]
    if not rows:
        return None
    with _figure(path, (8.5, 4.5)) as ax:  # wide enough for the legend beside the axes
        _errorbar_points(ax, rows, lambda r: r["speedup_vs_ar"], "pass_at_1_change", horizontal=True)
        ax.axvline(0.0, color="grey", linewidth=0.8)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xlabel("change in pass@1 vs AR (paired 95% interval)")
        ax.set_ylabel("speedup over AR")
        ax.set_title("quality-speed frontier")
    return path


def plot_deviation_vs_loglik(summary: Sequence[dict], path: Path) -> Path | None:
    rows = [r for r in _frontier_rows(summary, "loglik_change") if _ok(r["deviation_per_token"])]
    if not rows:
        return None
    with _figure(path, (8.5, 4.5)) as ax:  # wide enough for the legend beside the axes
        _errorbar_points(ax, rows, lambda r: r["deviation_per_token"], "loglik_change", horizontal=False)
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_xlabel("D per token (fidelity bound spent)")
        ax.set_ylabel("change in mean target log-likelihood vs AR (nats/token)")
    return path


def plot_acceptance_by_position(summary: Sequence[dict], path: Path) -> Path | None:
    rows = [r for r in summary if any(_ok(v) for v in r.get("acceptance_by_position") or [])]
    if not rows:
        return None
    with _figure(path, (7, 4.5)) as ax:
        for r in rows:
            values = r["acceptance_by_position"]
            ax.plot(range(1, len(values) + 1), values, marker="o", label=r["method"])
        # Positions are whole numbers; the default locator puts ticks at 1.5, 2.5. An integer
        # locator (not one tick per position) stays legible at a long draft length too.
        from matplotlib.ticker import MaxNLocator  # matplotlib loads lazily, with the figure

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(accepted | reached)")
        ax.set_ylim(0.0, 1.02)
        ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1.0), loc="upper left")
    return path


def write_plots(summary: Sequence[dict], out_dir: Path) -> list[Path]:
    """Every plot the summary has data for; returns the files written."""
    made = [plot_speedup_vs_theta(summary, out_dir / "speedup_vs_theta.png"),
            plot_quality_vs_speedup(summary, out_dir / "quality_vs_speedup.png"),
            plot_accepted_length(summary, out_dir / "accepted_length.png"),
            plot_speedup_vs_pass_change(summary, out_dir / "speedup_vs_pass_change.png"),
            plot_deviation_vs_loglik(summary, out_dir / "deviation_vs_loglik.png"),
            plot_acceptance_by_position(summary, out_dir / "acceptance_by_position.png")]
    return [p for p in made if p is not None]


def plot_vllm_speedups(summary: Sequence[dict], path: Path) -> Path | None:
    """Bars of ``vs_plain`` per method (rows of nsd.bench.vllm_report.summary_table), one
    per temperature side by side, each labelled with the method's measured D/token."""
    methods = list(dict.fromkeys(r["method"] for r in summary))
    temps = sorted({r["temperature"] for r in summary})
    cell = {(r["method"], r["temperature"]): r for r in summary}
    if not methods or not any(_ok(r.get("vs_plain")) for r in summary):
        return None
    width = 0.8 / len(temps)
    with _figure(path, (7.5, 4.0)) as ax:
        for j, t in enumerate(temps):
            xs = [i + (j - (len(temps) - 1) / 2) * width for i in range(len(methods))]
            rows = [cell.get((m, t)) for m in methods]
            ys = [r["vs_plain"] if r and _ok(r.get("vs_plain")) else 0.0 for r in rows]
            bars = ax.bar(xs, ys, width=width, label=f"T = {t:g}")
            for bar, r in zip(bars, rows):
                if r and _ok(r.get("d_per_token")):
                    ax.annotate(f"D {r['d_per_token']:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=6)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(methods)))
        ax.set_xticklabels(methods, rotation=20, ha="right", fontsize=7)
        ax.set_ylabel("speed over vLLM plain (paired median)")
        ax.legend(fontsize=7)
    return path


def _label(ax, xlabel: str, ylabel: str) -> None:
    """Axis names, a y axis from zero, and the legend: the measurement plots' common finish."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)


def plot_kernel_costs(data: dict, path: Path) -> Path | None:
    """Step cost c(n) in ms against the tokens in the forward, one line per path of a
    ``benchmarks/verify_kernel.py`` run (ggml's and nsd's kernel, measured interleaved), with
    c(1)·n dashed: what n one-token steps would cost."""
    paths = data.get("paths") or {}
    if not paths:
        return None
    with _figure(path, (6.0, 3.6)) as ax:
        for name, costs in paths.items():
            ns = sorted(costs["c_ms"], key=int)
            ax.plot([int(n) for n in ns], [costs["c_ms"][n] for n in ns], marker="o", label=name)
        first = next(iter(paths.values()))["c_ms"]
        ns = sorted((int(n) for n in first))
        ax.plot(ns, [first["1"] * n for n in ns], color="grey", lw=0.8, ls="--", label="n one-token steps (ggml)")
        _label(ax, "tokens in the forward (n)", "ms per forward (median)")
        ax.set_ylim(top=1.15 * max(max(c["c_ms"].values()) for c in paths.values()))  # the dashed line runs on
    return path


def plot_soak_memory(samples: Sequence[dict], path: Path) -> Path | None:
    """The server's resident memory and its prompt cache's bytes over a soak run (MiB
    against minutes), with the cache's budget dashed: memory should level off once the
    cache is full."""
    if not samples:
        return None
    mib = 2 ** 20
    minutes = [s["t_s"] / 60 for s in samples]
    with _figure(path, (6.0, 3.6)) as ax:
        ax.plot(minutes, [s["process_resident_memory_bytes"] / mib for s in samples], label="resident memory")
        ax.plot(minutes, [s["nsd_prefix_cache_bytes_held"] / mib for s in samples], label="prompt cache held")
        ax.axhline(samples[0]["nsd_prefix_cache_budget_bytes"] / mib, color="grey", lw=0.8, ls="--",
                   label="prompt cache budget")
        _label(ax, "minutes", "MiB")
    return path


def plot_serve_scaling(rows: Sequence[dict], path: Path) -> Path | None:
    """Aggregate tokens/s against concurrent clients, one line per method (the median over
    rounds, as nsd.bench.serve_report.scaling_table gives it)."""
    import statistics

    by_key: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        by_key.setdefault((r["method"], r["clients"]), []).append(r["tokens_per_s"])
    if not by_key:
        return None
    with _figure(path, (5.0, 3.4)) as ax:
        for method in dict.fromkeys(m for m, _ in by_key):
            clients = sorted(c for m, c in by_key if m == method)
            ax.plot(clients, [statistics.median(by_key[(method, c)]) for c in clients], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({c for _, c in by_key}))
        ax.set_xticklabels([str(c) for c in sorted({c for _, c in by_key})])
        _label(ax, "concurrent clients", "tokens/s, all clients (median of rounds)")
    return path


def plot_weight_formats(rows: Sequence[dict], path: Path) -> Path | None:
    """Perplexity against file size per weight format (benchmarks/weight_formats.py), each
    point labelled with its format and its argmax agreement with the original file."""
    if not rows:
        return None
    with _figure(path, (5.0, 3.4)) as ax:
        for r in rows:
            ax.scatter(r["size_mib"], r["perplexity"])
            ax.annotate(f"{r['format']} (argmax = original {r['argmax_agreement_with_original']:.3f})",
                        (r["size_mib"], r["perplexity"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel("file size (MiB)")
        ax.set_ylabel("perplexity, held-in text")
        lo, hi = min(r["size_mib"] for r in rows), max(r["size_mib"] for r in rows)
        ax.set_xlim(lo - 0.1 * (hi - lo), hi + 0.6 * (hi - lo))
    return path


def plot_prefill(ms: dict[str, float], tokens: int, path: Path) -> Path | None:
    """One long prompt's prefill time per path (benchmarks/verify_kernel.py --prefill)."""
    if not ms:
        return None
    with _figure(path, (4.5, 2.6)) as ax:
        names = list(ms)
        bars = ax.barh(names, [ms[n] / 1000 for n in names])
        for bar, n in zip(bars, names):
            ax.annotate(f"{ms[n] / 1000:.1f} s", (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                        xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
        ax.set_xlabel(f"seconds to prefill {tokens} tokens")
        ax.set_xlim(0, 1.2 * max(ms.values()) / 1000)
    return path
