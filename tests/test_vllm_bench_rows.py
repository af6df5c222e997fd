"""benchmarks/vllm_bench.py's rows without vLLM (nsd.bench.vllm_report, and the journal,
rotation and HumanEval scoring it shares with nsd bench): summaries, pass@1, the journal
and resuming, settings checks, method rotation and the Markdown table, on hand-made rows."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from nsd.bench import vllm_report as vb
from nsd.bench.datasets import BenchPrompt
from nsd.bench.humaneval_exec import score_humaneval, stops_for
from nsd.bench.schedule import method_order, missing
from nsd.bench.store import JOURNAL, SETTINGS as SETTINGS_FILE, Journal
from nsd.errors import NSDError


def ledger(steps: int, tokens: int, deviation: float, reached: list[int], accepted: list[int]) -> dict:
    return {"steps": steps, "tokens": tokens, "deviation": deviation,
            "position_reached": reached, "position_accepted": accepted}


def row(prompt: str, method: str, temperature: float, tokens: int, wall: float, *, generated=None,
        led=None, passed=None, flagged=False, dataset="humaneval") -> dict:
    return {"prompt": prompt, "dataset": dataset, "method": method, "temperature": temperature,
            "tokens": tokens, "generated": tokens if generated is None else generated, "wall": wall,
            "ledger": led, "passed": passed, "load": {"flagged": flagged, "other_cpu": 0.0}}


def test_imports_without_vllm() -> None:
    assert "vllm" not in sys.modules


def test_summarise_pools_rows_of_one_method() -> None:
    rows = [row("humaneval:0", "vLLM SD draft", 0.0, 10, 2.0, generated=12, passed=True,
                led=ledger(4, 12, 0.5, [4, 3, 2, 1], [3, 2, 1, 0])),
            row("humaneval:1", "vLLM SD draft", 0.0, 20, 3.0, passed=False, flagged=True,
                led=ledger(5, 20, 1.5, [5, 5], [5, 4])),
            row("spec-bench:1", "vLLM SD draft", 0.0, 6, 1.0, dataset="spec-bench",
                led=ledger(2, 6, 0.0, [2, 2, 2], [2, 2, 0]))]
    s = vb.summarise(rows)
    assert s["prompts"] == 3 and s["tokens"] == 36
    assert s["tok_s"] == pytest.approx(36 / 6.0)
    assert s["tok_s_median"] == pytest.approx(6.0)  # per-row rates 5, 6.67, 6
    assert s["tau"] == pytest.approx(38 / 11)
    # D over every generated token (12 + 20 + 6), not the 36 visible ones.
    assert s["d_per_token"] == pytest.approx(2.0 / 38)
    assert s["d_max"] == 1.5
    assert s["per_position"] == pytest.approx([10 / 11, 8 / 10, 1 / 4, 0.0])
    assert s["loaded"] == 1
    p = s["pass_at_1"]
    assert (p["passed"], p["n"], p["rate"]) == (1, 2, 0.5)
    assert p["ci"] == pytest.approx([0.0945312, 0.9054688], abs=1e-6)


def test_plain_rows_have_no_acceptance_and_spec_bench_no_pass_at_1() -> None:
    s = vb.summarise([row("spec-bench:1", "vLLM plain", 0.8, 8, 4.0, dataset="spec-bench")])
    assert (s["tau"], s["per_position"], s["d_per_token"], s["d_max"]) == (1.0, None, 0.0, 0.0)
    assert s["pass_at_1"] is None
    line = vb.format_row({"method": "vLLM plain", "temperature": 0.8, **s})
    assert line == "| vLLM plain | 0.8 | 1 | 2.00 | - | - | 1.00 | - | 0.000 | 0.00 | - | 0 |"


def test_summary_table_groups_by_temperature_then_method() -> None:
    rows = [row("a", "NSD", 0.0, 4, 1.0, passed=True), row("a", "SD", 0.0, 2, 1.0, passed=True),
            row("b", "SD", 0.0, 6, 1.0, passed=True), row("a", "SD", 0.8, 3, 1.0, passed=False),
            row("a", "other", 0.0, 1, 1.0)]  # not in the selection
    table = vb.summary_table(rows, ["SD", "NSD"], [0.0, 0.8])
    assert [(s["method"], s["temperature"], s["prompts"]) for s in table] == \
        [("SD", 0.0, 2), ("NSD", 0.0, 1), ("SD", 0.8, 1)]  # (NSD, 0.8) has no rows
    assert table[0]["tok_s"] == pytest.approx(4.0)
    assert table[2]["pass_at_1"]["rate"] == 0.0


def test_speeds_are_paired_per_prompt_and_temperature() -> None:
    # tok/s = tokens / wall: plain 1, 2, 4 on prompts a, b, c; NSD 2, 3, 12 (ratios 2, 1.5, 3).
    rows = [row(u, vb.PLAIN, 0.0, n, 1.0) for u, n in (("a", 1), ("b", 2), ("c", 4))]
    rows += [row(u, "NSD", 0.0, n, 1.0) for u, n in (("a", 2), ("b", 3), ("c", 12))]
    rows += [row("a", vb.SD_DRAFT, 0.0, 4, 1.0), row("a", "NSD", 0.8, 9, 1.0)]
    assert vb.paired_ratio(rows, "NSD", vb.PLAIN, 0.0) == pytest.approx(2.0)  # ratio of medians: 3/2
    assert vb.paired_ratio(rows, "NSD", vb.SD_DRAFT, 0.0) == pytest.approx(0.5)  # only prompt a pairs
    assert math.isnan(vb.paired_ratio(rows, "NSD", vb.PLAIN, 0.8))  # no plain row at 0.8
    table = {(s["method"], s["temperature"]): s for s in vb.summary_table(rows, [vb.PLAIN, "NSD"], [0.0, 0.8])}
    assert table[("NSD", 0.0)]["vs_plain"] == pytest.approx(2.0)
    assert table[(vb.PLAIN, 0.0)]["vs_plain"] == pytest.approx(1.0)
    assert "| 2.00x | 0.50x |" in vb.format_row(table[("NSD", 0.0)])



def test_speedup_plot_draws_the_summary_and_skips_an_empty_one(tmp_path: Path) -> None:
    from nsd.bench.plots import plot_vllm_speedups

    rows = [row(u, vb.PLAIN, t, n, 1.0) for u, n in (("a", 1), ("b", 2)) for t in (0.0, 0.8)]
    rows += [row(u, "NSD", t, 2 * n, 1.0, led=ledger(n, 2 * n, 0.5, [n], [n]))
             for u, n in (("a", 1), ("b", 2)) for t in (0.0, 0.8)]
    table = vb.summary_table(rows, [vb.PLAIN, "NSD"], [0.0, 0.8])
    out = plot_vllm_speedups(table, tmp_path / "p.png")
    assert out == tmp_path / "p.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_vllm_speedups([], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()

def test_markdown_table_with_pass_at_1_interval() -> None:
    rows = [row("humaneval:0", "vLLM+NSD θ0.9", 0.0, 10, 2.0, passed=True, flagged=True,
                led=ledger(2, 10, 0.25, [2, 2, 1], [2, 1, 0]))]
    table = vb.summary_table(rows, ["vLLM+NSD θ0.9"], [0.0])
    text = vb.render_report(["# title"], [("All prompts", table)])
    lines = text.splitlines()
    assert lines[0] == "# title" and "## All prompts" in lines
    assert ("| method | temp | prompts | tok/s | vs plain | vs SD draft | acceptance length | "
            "accept by position | D/token | max D | pass@1 [95% CI] | loaded |") in lines
    assert "| vLLM+NSD θ0.9 | 0 | 1 | 5.00 | - | - | 5.00 | [1.00, 0.50, 0.00] | 0.025 | 0.25 | " \
           "1.00 [0.21, 1.00] (1/1) | 1 |" in lines
    # A position no step reached shows "-".
    nan_row = {**table[0], "per_position": [1.0, math.nan]}
    assert "| [1.00, -] |" in vb.format_row(nan_row)


def test_method_order_rotates_per_prompt() -> None:
    methods = ["SD", "NSD", "NSD B"]
    assert method_order(methods, 0) == ["SD", "NSD", "NSD B"]
    assert method_order(methods, 1) == ["NSD", "NSD B", "SD"]
    assert method_order(methods, 5) == ["NSD B", "SD", "NSD"]
    assert sorted(method_order(methods, i)[0] for i in range(3)) == sorted(methods)
    assert method_order(["plain"], 7) == ["plain"]


SETTINGS = {"datasets": ["humaneval"], "limit": 5, "max_tokens": 128, "temperatures": [0.0, 0.8]}


def journal(folder: Path, settings: dict = SETTINGS, overwrite: bool = False) -> Journal:
    return Journal(folder, settings, overwrite=overwrite, key=vb.row_key)


def test_journal_resume_skips_done_rows_and_drops_a_truncated_last_line(tmp_path: Path) -> None:
    path = tmp_path / JOURNAL
    first = journal(tmp_path)
    first.append(row("humaneval:0", "SD", 0.0, 5, 1.0, passed=True))
    first.append(row("humaneval:0", "SD", 0.8, 5, 1.0, led={"deviation": math.nan}))
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"prompt": "humaneval:1", "tempera')  # killed mid-write
    done = journal(tmp_path).records
    assert set(done) == {("humaneval:0", 0.0, "SD"), ("humaneval:0", 0.8, "SD")}
    assert done[("humaneval:0", 0.8, "SD")]["ledger"]["deviation"] is None  # NaN -> null
    assert path.read_text(encoding="utf-8").endswith("}\n")  # the partial line is gone
    # 2 prompts x 2 temperatures x 2 methods, 2 rows done.
    assert missing(vb.row_keys(["humaneval:0", "humaneval:1"], [0, 0.8], ["SD", "NSD"]), done) == 6
    journal(tmp_path).append(row("humaneval:1", "NSD", 0.8, 5, 1.0))
    assert len(journal(tmp_path).records) == 3
    assert missing(vb.row_keys(["humaneval:0"], [0.0, 0.8], ["SD"]), journal(tmp_path).records) == 0


def test_journal_with_a_corrupt_middle_line_stops(tmp_path: Path) -> None:
    journal(tmp_path)
    path = tmp_path / JOURNAL
    path.write_text("not json\n" + json.dumps(row("a", "SD", 0.0, 1, 1.0)) + "\n", encoding="utf-8")
    with pytest.raises(NSDError, match="journal.jsonl:1 is corrupt"):
        journal(tmp_path)


def test_settings_mismatch_stops_unless_overwrite(tmp_path: Path) -> None:
    settings = SETTINGS
    journal(tmp_path, settings).append(row("a", "SD", 0.0, 1, 1.0))
    assert len(journal(tmp_path, dict(settings)).records) == 1  # same settings: resume
    with pytest.raises(NSDError, match=r"max_tokens: 128 -> 64.*--overwrite"):
        journal(tmp_path, {**settings, "max_tokens": 64})
    journal(tmp_path, {**settings, "max_tokens": 64}, overwrite=True)
    assert not (tmp_path / JOURNAL).exists()
    assert json.loads((tmp_path / SETTINGS_FILE).read_text())["max_tokens"] == 64


def test_journal_without_settings_stops(tmp_path: Path) -> None:
    (tmp_path / JOURNAL).write_text(json.dumps(row("a", "SD", 0.0, 1, 1.0)) + "\n", encoding="utf-8")
    with pytest.raises(NSDError, match="without settings.json"):
        journal(tmp_path, {"limit": 1})


def test_score_humaneval_truncates_and_runs_the_tests() -> None:
    prompt = BenchPrompt(uid="humaneval:x", dataset="humaneval", category="humaneval",
                         text="def add(a, b):\n", chat=False, entry_point="add",
                         test="def check(candidate):\n    assert candidate(2, 3) == 5\n")
    good = score_humaneval(prompt, "    return a + b\n\ndef other():\n    return 1/0\n", 10.0)
    assert good["completion"] == "    return a + b\n" and good["passed"] is True
    bad = score_humaneval(prompt, "    return a - b\n", 10.0)
    assert bad["passed"] is False and bad["exec_status"] == "failed"
    unrun = score_humaneval(prompt, "    return a + b\n", 10.0, execute=False)
    assert unrun == {"completion": "    return a + b\n", "passed": None, "exec_status": None,
                     "exec_detail": None}
    assert stops_for(prompt) and "\ndef " in stops_for(prompt)
    assert stops_for(BenchPrompt(uid="humaneval:y", dataset="humaneval", category="humaneval",
                                 text="Write add.", chat=True, entry_point="add", test="")) == ()
