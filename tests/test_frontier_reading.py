"""nsd.bench.frontier (what benchmarks/frontier_reading.py prints) on a hand-made journal:
only prompts every method has finished are read, the paired speed ratio is a median of
per-prompt ratios, and each relaxed method gets its sentence with the paired quality
change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nsd.bench import frontier as fr
from nsd.bench.methods import expand_methods
from nsd.bench.report import small_summary, summarize
from nsd.errors import NSDError

METHODS = expand_methods(["ar", "sd", "nsd"], [0.9], [], ["draft"])  # ar, sd/draft, nsd@0.9/draft


def record(prompt: str, method: str, tok_s: float, passed: bool) -> dict:
    family = method.split("@")[0].split("/")[0]
    stats = {"new_tokens": 10, "target_passes": 10 if family == "ar" else 4, "accepted_tokens": 6,
             "drafted_tokens": 8, "position_attempts": [4, 3], "position_accepts": [3, 3],
             "position_relaxed": [0, 2] if family == "nsd" else [0, 0],
             "position_deviation": [0.0, 0.5] if family == "nsd" else [0.0, 0.0],
             "relaxed_accepts": 2 if family == "nsd" else 0, "deviation": 0.5 if family == "nsd" else 0.0,
             "wall_s": 10 / tok_s, "decode_tokens_per_s": tok_s, "propose_s": 0.1, "target_s": 0.2,
             "overhead_per_pass_s": 0.001}
    return {"prompt": prompt, "method": method, "family": family, "tokens_per_s": tok_s,
            "stats": stats, "passed": passed, "loglik": -0.2, "output_ids": [1] * 10,
            "token_ids": [1] * 10, "text": "x", "category": "c", "dataset": "toy",
            "load": {"flagged": False, "other_cpu": 0.0}}


def test_partial_journal_keeps_complete_prompts_and_pairs_ratios(tmp_path: Path) -> None:
    rows = [record("p0", "ar", 10, True), record("p0", "sd/draft", 5, True), record("p0", "nsd@0.9/draft", 6, False),
            record("p1", "ar", 10, True), record("p1", "sd/draft", 8, True), record("p1", "nsd@0.9/draft", 12, True),
            record("p2", "ar", 10, True), record("p2", "sd/draft", 8, True),  # nsd missing: left out
            record("p3", "ar", 10, True), record("p3", "sd/draft", 4, False), record("p3", "nsd@0.9/draft", 6, True)]
    journal = tmp_path / "journal.jsonl"
    journal.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"prompt": "p4", "meth')
    records, n = fr.complete_records(journal, METHODS)
    assert n == 3 and {r["prompt"] for r in records} == {"p0", "p1", "p3"}
    # Per-prompt nsd/sd ratios 1.2, 1.5, 1.5: median 1.5 (a ratio of medians would say 6/5 = 1.2).
    assert fr.paired_ratio(records, "nsd@0.9/draft", "sd/draft") == pytest.approx(1.5)
    assert fr.paired_ratio(records, "nsd@0.9/draft", "ar") == pytest.approx(0.6)
    sd_line, *lines = fr.reading(records, summarize(records, METHODS), execute=True)
    # Exact SD against AR: fails p3 only -> -1/3, (+0 / −1).
    assert sd_line.startswith("- **sd/draft** (exact): pass@1 0.667, change vs AR -0.333")
    assert "(+0 / −1 problems)" in sd_line
    assert len(lines) == 1 and lines[0].startswith("- **nsd@0.9/draft**: 1.50× SD's speed and 0.60× AR's")
    # pass@1 2 of 3; changes vs AR on the same prompts: -1, 0, 0 -> mean -1/3.
    assert "pass@1 0.667, change vs AR -0.333" in lines[0] and "log-likelihood change vs AR" in lines[0]
    # Against SD (passes True, True, False): nsd fails p0, passes p3 -> changes -1, 0, +1.
    assert "(+0 / −1 problems), vs SD +0.000" in lines[0] and "(+1 / −1)" in lines[0]
    assert "identical to AR's 3, to SD's 3" in lines[0]  # the toy outputs are all [1] * 10
    vs_sd = fr.against(records, "nsd@0.9/draft", "sd/draft")
    assert (vs_sd["gains"], vs_sd["losses"]) == (1, 1) and vs_sd["change"][0] == pytest.approx(0.0)


def test_first_prompts_keeps_the_run_order() -> None:
    rows = [record(p, m, 10, True) for p in ("p2", "p0", "p1") for m in ("ar", "sd/draft")]
    kept = fr.first_prompts(rows, 2)
    assert [r["prompt"] for r in kept] == ["p2", "p2", "p0", "p0"]
    assert fr.first_prompts(rows, 10) == rows


def test_read_run_from_a_journal_and_the_blocks_printed(tmp_path: Path) -> None:
    rows = [record(p, m, 10, True) for p in ("p0", "p1") for m in [s.label for s in fr.METHODS]]
    rows += [record("p2", "ar", 10, True)]  # unfinished: left out
    (tmp_path / "journal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, state = fr.read_run(tmp_path)
    assert state == "in progress: the 2 prompts every method has finished"
    assert len(records) == 2 * len(fr.METHODS)
    records, state = fr.read_run(tmp_path, first=1)
    assert state.endswith("; the first 1 read") and {r["prompt"] for r in records} == {"p0"}
    blocks = fr.run_reading("run", records, state)
    assert blocks[0] == f"## run ({state})\n" and blocks[1].startswith("| method |")
    assert fr.run_reading("run", [], "x") == ["## run (x)\n\nnothing to show yet\n"]
    with pytest.raises(NSDError, match="no results.json or journal.jsonl"):
        fr.read_run(tmp_path / "missing")


def test_rules_frontier_table_and_plot_from_a_smoke_sized_run(tmp_path: Path) -> None:
    # Methods outside the grid (a smoke run's own knob values) are rebuilt from the records.
    speeds = {"ar": 10, "sd/draft": 12, "nsd@0.9/draft": 15, "topk_delta@K10,d0.6/draft": 14,
              "fly@h0.1/draft": 13}
    passes = {"ar": (True, True), "sd/draft": (True, True), "nsd@0.9/draft": (True, False),
              "topk_delta@K10,d0.6/draft": (True, True), "fly@h0.1/draft": (False, False)}
    rows = [record(p, m, speeds[m], passes[m][i]) for i, p in enumerate(("p0", "p1")) for m in speeds]
    (tmp_path / "journal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, state = fr.read_run(tmp_path)
    assert state == "in progress: the 2 prompts every method has finished"
    blocks = fr.run_reading("run", records, state)
    table = next(b for b in blocks if b.startswith("Fastest rule")).splitlines()
    assert blocks[-2].startswith("| method | relaxed / 100 tokens")  # what the relaxed accepts cost
    assert blocks[-1].startswith("By draft position")  # where they happen, and what they charge
    assert table[2] == "| quality ≥ | fastest | speedup | nsd | topk_delta | fly |"
    # At AR's pass@1 (2/2) nsd and fly fall short: top-K/δ is the fastest there.
    assert table[4] == "| AR's | topk_delta@K10,d0.6/draft | 1.40 | - | 1.40 | - |"
    assert table[5] == "| AR − 1 problem | nsd@0.9/draft | 1.50 | 1.50 | 1.40 | - |"
    assert table[6].startswith("| AR − 2 problems | nsd@0.9/draft | 1.50 | 1.50 | 1.40 | 1.30 |")
    # NSD's fastest point against the fastest other one, prompt by prompt (15/14 on both).
    against = next(b for b in blocks if b.startswith("NSD against the fastest other")).splitlines()
    assert against[4] == "| AR's | none | topk_delta@K10,d0.6/draft | - | - | - |"
    assert against[5] == "| AR − 1 problem | nsd@0.9/draft | topk_delta@K10,d0.6/draft | 1.07 | [1.07, 1.07] | 2 |"
    summary = summarize(records, fr.run_methods(records))
    points, _ = fr.frontier_points(summary, True)
    assert fr.nsd_against_best(points, summary, True, None) == []  # a summary without per-prompt rates
    # The run's small summary keeps those rates, so BENCHMARKS.md prints the same table.
    small = small_summary({"settings": {}, "records": records})
    assert small["prompt_rates"]["p1"] == {m: float(v) for m, v in speeds.items()}
    assert fr.nsd_against_best(points, summary, True, small["prompt_rates"]) == against
    path = fr.write_rules_plot(tmp_path, records)
    assert path == tmp_path / "frontier_rules.png" and path.stat().st_size > 1000


def test_relaxed_cost_table_divides_the_loglik_change_by_the_relaxed_rate() -> None:
    rows = []
    for p in ("p0", "p1"):
        rows += [record(p, "ar", 10, True), record(p, "sd/draft", 12, True)]
        nsd = record(p, "nsd@0.9/draft", 15, True)
        nsd["loglik"] = -0.3  # 0.1 nats/token below AR's -0.2 on both prompts
        rows.append(nsd)
    lines = fr.relaxed_cost_table(summarize(rows, METHODS))
    assert lines[0].startswith("| method | relaxed / 100 tokens | D per relaxed accept | Δ loglik/token vs SD")
    # 2 relaxed accepts in 10 tokens per prompt: 20 per 100, D 0.5 each time -> 0.25 per
    # accept; -0.1 nats/token over 0.2 relaxed accepts/token -> -0.5 nats per accept.
    assert lines[2:] == ["| nsd@0.9/draft | 20.0 | 0.25 | -0.100 | -0.50 |"]
    # A summary written before relaxed_per_token: no table rather than a guess.
    old = [{k: v for k, v in r.items() if k != "relaxed_per_token"} for r in summarize(rows, METHODS)]
    assert fr.relaxed_cost_table(old) == []
    # Sampled runs: the change is chance at these sizes, so no table.
    assert fr.relaxed_cost_table(summarize(rows, METHODS), temperature=0.8) == []
    assert fr.relaxed_cost_table(summarize(rows, METHODS), temperature=0.0) == lines


def test_run_temperature_from_the_run_settings(tmp_path: Path) -> None:
    assert fr.run_temperature(tmp_path) is None  # no settings.json
    (tmp_path / "settings.json").write_text(json.dumps({"generation": {"temperature": 0.8}}))
    assert fr.run_temperature(tmp_path) == 0.8
    (tmp_path / "settings.json").write_text("{not json")
    assert fr.run_temperature(tmp_path) is None


def test_position_table_pools_each_position_over_the_blocks_reaching_it() -> None:
    rows = []
    for p in ("p0", "p1"):
        rows += [record(p, "ar", 10, True), record(p, "sd/draft", 12, True), record(p, "nsd@0.9/draft", 15, True)]
    lines = fr.position_table(summarize(rows, METHODS))
    assert lines[2] == "| method | τ | accepted | relaxed | D charged |"
    # Per prompt 4 blocks reach position 1 (3 accept, none relaxed) and 3 reach position 2
    # (all accept, 2 relaxed, D 0.5 there): pooled 6/8, 6/6; 0/8, 4/6; 0/8, 1.0/6.
    assert lines[4:] == ["| sd/draft | 2.50 | 0.75 1.00 | 0.00 0.00 | 0.000 0.000 |",
                         "| nsd@0.9/draft | 2.50 | 0.75 1.00 | 0.00 0.67 | 0.000 0.167 |"]
    # Records from before the per-position counts: no table rather than zeros.
    for r in rows:
        del r["stats"]["position_relaxed"], r["stats"]["position_deviation"]
    assert fr.position_table(summarize(rows, METHODS)) == []
