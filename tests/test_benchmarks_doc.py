"""BENCHMARKS.md against the runs it reports: statements about settings match the
settings each run recorded."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _intro_sentences() -> list[str]:
    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    intro = " ".join(text.split("\n## ", 1)[0].split())
    return re.split(r"(?<=\.)\s+(?=[A-Z])", intro)


def test_intro_states_each_runs_own_typical_settings() -> None:
    # Every run with `typical` rows must be attributed, in the opening paragraph, the ε and
    # δ its settings.json recorded: the knobs changed between runs.
    sentences = _intro_sentences()
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
        assert len(about) == 1, (run, about)
        assert stated in about[0], (run, stated, about[0])
