"""README.md, BENCHMARKS.md and docs/ against the runs they report: the generated tables
are what the cited runs give (a figure typed by hand fails), every path they cite under
benchmarks/results/ is in the repository, and statements about settings match the
settings each run recorded."""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path

import pytest

from nsd.bench import headline, measured, metrics

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCUMENTS = ["README.md", "BENCHMARKS.md", *sorted(p.relative_to(ROOT).as_posix()
                                                   for p in (ROOT / "docs").glob("*.md"))]


def _read(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def test_generated_tables_are_what_the_cited_runs_give() -> None:
    assert headline.stale(ROOT) == [], "run: python benchmarks/headline.py"


def test_each_document_holds_its_generated_blocks() -> None:
    # A block deleted from a document (its table then typed by hand elsewhere) fails too.
    generated = headline.blocks(ROOT)
    readme, benchmarks = headline.marked(_read("README.md")), headline.marked(_read("BENCHMARKS.md"))
    assert set(readme) == {"headline", "picture"}
    assert set(benchmarks) == set(generated) - {"picture"}
    for document, blocks in (("README.md", readme), ("BENCHMARKS.md", benchmarks)):
        for name, body in blocks.items():
            assert body == generated[name], (document, name)


@pytest.mark.parametrize("document", ["README.md", "BENCHMARKS.md"])
def test_a_figure_edited_by_hand_is_caught(document: str) -> None:
    # Change one speedup inside a generated table, as a hand edit would: the generated
    # text differs, and regenerating puts the run's figure back.
    text = _read(document)
    generated = headline.blocks(ROOT)
    start = text.index("<!-- generated: headline")
    match = re.compile(r"\d+\.\d\dx").search(text, start)
    figure = match.group(0)
    edited = text[:match.start()] + f"{float(figure[:-1]) + 0.01:.2f}x" + text[match.end():]
    assert headline.render(edited, generated) != edited
    assert headline.render(edited, generated) == text


def test_headline_reads_each_cpu_class_and_says_which_are_unmeasured() -> None:
    table = headline.headline_table(ROOT)
    for cpu in headline.CPU_CLASSES:
        assert f"| {cpu.name} (" in table
    for run in headline.RUNS:
        if run.headline:
            summary = headline.load_summary(ROOT, run)
            nsd = next(r for r in summary["summary"] if r["family"] == "nsd" and r["proposer"] == run.proposer
                       and r["theta"] == 0.9)
            row = next(line for line in table.splitlines() if f"`{run.path}`" in line)
            assert f"**{nsd['speedup_vs_ar']:.2f}x**" in row
            # The summary's speedup is the paired median the records give (small_summary).
            assert nsd["speedup_vs_ar"] == pytest.approx(summary["paired"][nsd["method"]]["ar"])
    measured = {run.cpu for run in headline.RUNS}
    for cpu in headline.CPU_CLASSES:
        if cpu.key not in measured:
            assert f"| {cpu.name} ({cpu.machine}) | not yet measured |" in table


def test_a_frontier_summary_keeps_the_per_prompt_rates_of_its_paired_ratios() -> None:
    # The bootstrap intervals in the frontier blocks resample these rates: they must be
    # the ones the run's paired medians came from.
    kept = 0
    for run in headline.FRONTIER:
        summary = headline.load_summary(ROOT, run)
        if "prompt_rates" not in summary:
            continue  # written before the rates were kept: its block has no interval table
        kept += 1
        for method, refs in summary["paired"].items():
            if "ar" in refs:
                assert metrics.paired_ratio(summary["prompt_rates"], method, "ar") == \
                    pytest.approx(refs["ar"], rel=1e-5, nan_ok=True)
    assert kept >= 4  # the Zen 3 runs with the engines' rules


def test_a_headline_row_says_how_many_of_its_calls_ran_under_load() -> None:
    # The headline table has no 'loaded' column: a run whose timings were partly taken
    # beside another busy process says so in its task cell, and a clean run says nothing.
    rows = [{"loaded_calls": 3, "prompts": 40}, {"loaded_calls": 0, "prompts": 40}]
    assert headline._loaded({"summary": rows}) == " (3 of 80 calls loaded)"
    assert headline._loaded({"summary": [{"loaded_calls": 0, "prompts": 40}]}) == ""
    assert headline._loaded({"summary": [{"loaded_calls": None, "prompts": 40}]}) == ""  # predates the count
    table = headline.headline_table(ROOT)
    for run in headline.RUNS:
        if run.headline:
            rows = headline.load_summary(ROOT, run)["summary"]
            loaded = sum(r.get("loaded_calls") or 0 for r in rows)
            line = next(line for line in table.splitlines() if f"`{run.path}`" in line)
            assert (f"{loaded} of " in line) == (loaded > 0), line


def test_each_measurement_table_shows_its_plot() -> None:
    text = _read("BENCHMARKS.md")
    for ref in (*measured.KERNELS, measured.SOAK, measured.SERVE_BATCHING, measured.FORMATS, measured.PREFILL):
        assert (ROOT / ref.plot).is_file(), f"run: python benchmarks/headline.py (draws {ref.plot})"
        assert f"]({ref.plot})" in text


def test_the_prefill_block_is_the_runs_median_ratio() -> None:
    data = json.loads((RESULTS / measured.PREFILL.path).read_text(encoding="utf-8"))
    ms = data["prefill"]["ms"]
    block = measured.prefill_block(ROOT)
    assert f"**{ms['ggml'] / ms['avx2 small-batch']:.2f}x**" in block
    assert f"median of {data['prefill']['repeats']}" in block


# Paths the documents name as examples or placeholders, not as data they cite.
PLACEHOLDERS = {"benchmarks/results/my-run", "benchmarks/results/RUN/journal.jsonl",
                "benchmarks/results/RUN/results.json", "benchmarks/results/amx/*-default/"}
_PATH = re.compile(r"benchmarks/results/[\w.\-/{},*]*")


def _expand(path: str) -> list[str]:
    """``a/{b,c}/d`` as ``a/b/d`` and ``a/c/d`` (shell brace expansion, one level)."""
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [p for option in match.group(1).split(",")
            for p in _expand(path[:match.start()] + option + path[match.end():])]


def _cited(document: str) -> set[str]:
    found = {p.rstrip(".,") for p in _PATH.findall(_read(document))}
    return {p for p in found if p not in PLACEHOLDERS}


def _in_repository(path: str) -> bool:
    if glob.glob(str(ROOT / path)):
        return True
    # A run's per-call records (journal.jsonl, the full results.json) are kept in git
    # history, not in the tree (docs/benchmarks.md): citing one is fine where the run's
    # small summary is here (a glob such as runs/*/journal.jsonl: where some run's is).
    file = Path(path)
    return file.name in ("journal.jsonl", "results.json") and \
        any((Path(folder) / "summary.json").is_file() for folder in glob.glob(str(ROOT / file.parent)))


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_cited_result_path_exists(document: str) -> None:
    missing = [p for cited in sorted(_cited(document)) for p in _expand(cited) if not _in_repository(p)]
    assert missing == [], f"{document} cites {missing}"


def test_the_path_check_catches_a_missing_run() -> None:
    assert not _in_repository("benchmarks/results/amx/no-such-run/")
    assert not _in_repository("benchmarks/results/no-such-run/journal.jsonl")
    assert _expand("x/{a,b}/y") == ["x/a/y", "x/b/y"]


def _opening_sentences() -> list[str]:
    """The opening paragraph of BENCHMARKS.md and the original one quoted in the lab
    notes: where each run's typical-acceptance settings are stated."""
    current = _read("BENCHMARKS.md").split("\n## ", 1)[0]
    notes = "\n".join(line[1:] for line in _read("docs/lab-notes.md").split("\n## ", 1)[0].splitlines()
                      if line.startswith(">"))
    return [s for text in (current, notes)
            for s in re.split(r"(?<=\.)\s+(?=[A-Z])", " ".join(text.split()))]


def test_intro_states_each_runs_own_typical_settings() -> None:
    # Every run with `typical` rows must be attributed, in an opening paragraph, the ε and
    # δ its settings.json recorded: the knobs changed between runs.
    sentences = _opening_sentences()
    runs = [settings.parent for settings in RESULTS.rglob("settings.json")
            if (settings.parent / "report.md").is_file()
            and "| typical" in (settings.parent / "report.md").read_text(encoding="utf-8")]
    assert len(runs) >= 3
    for run in runs:
        generation = json.loads((run / "settings.json").read_text(encoding="utf-8"))["generation"]
        stated = f"ε = {generation['typical_epsilon']:g}, δ = {generation['typical_delta']:g}"
        # A run is named by its own folder or by the folder that groups it (frontier/).
        names = {f"`{p.relative_to(ROOT).as_posix()}/`" for p in (run, run.parent) if p != RESULTS}
        about = [s for s in sentences if any(name in s for name in names)]
        assert about, run
        for sentence in about:
            assert stated in sentence, (run, stated, sentence)


def test_each_cited_commit_holds_its_run() -> None:
    # The commit a table names must be one that has the run's files (a typo, or a run
    # replaced without updating its entry, fails); needs the git history.
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT,
                             capture_output=True, text=True).stdout.strip()
    if shallow != "false":
        pytest.skip("a shallow clone lacks the history the runs' commits are in")
    for run in (*headline.RUNS, *headline.FRONTIER, headline.VLLM):
        spec = f"{run.commit}:{headline.RESULTS}/{run.path}/settings.json"
        found = subprocess.run(["git", "cat-file", "-e", spec], cwd=ROOT, capture_output=True)
        assert found.returncode == 0, spec


def test_the_measurement_plots_draw_from_their_runs(tmp_path: Path) -> None:
    # The committed PNGs are only redrawn when missing: draw each once here from its run,
    # so a plot function that no longer reads its JSON fails in the suite, not at the next run.
    from nsd.bench import plots

    def run(ref):
        return json.loads((RESULTS / ref.path).read_text(encoding="utf-8"))

    drawn = [plots.plot_kernel_costs(run(ref), tmp_path / f"k{i}.png") for i, ref in enumerate(measured.KERNELS)]
    drawn += [plots.plot_soak_memory(run(measured.SOAK)["samples"], tmp_path / "soak.png"),
              plots.plot_serve_scaling(run(measured.SERVE_BATCHING)["rows"], tmp_path / "serve.png"),
              plots.plot_weight_formats(run(measured.FORMATS)["rows"], tmp_path / "formats.png"),
              plots.plot_prefill(run(measured.PREFILL)["prefill"]["ms"], 1500, tmp_path / "prefill.png")]
    for path in drawn:
        assert path is not None and path.stat().st_size > 1000
