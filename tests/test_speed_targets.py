"""nsd.bench.targets (what benchmarks/speed_targets.py prints) on hand-made runs: which
targets a run's temperature brings in, the paired ratios against AR and against the faster
llama.cpp peer, AMX-only targets marked on other CPUs, and the part-by-part shortfall."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from nsd.bench import targets as tg
from nsd.errors import NSDError


def record(prompt: str, method: str, tok_s: float, *, wall: float = 2.0, prefill: float = 0.4,
           draft: float = 0.6, verify: float = 0.8, passes: int = 10) -> dict:
    family = method.split("@")[0].split("/")[0]
    theta = float(method.split("@")[1].split("/")[0]) if "@" in method else None
    stats = {"wall_s": wall, "prefill_s": prefill, "propose_s": draft, "target_s": verify,
             "target_passes": passes, "new_tokens": int(tok_s * wall)}
    return {"prompt": prompt, "method": method, "family": family, "theta": theta,
            "tokens_per_s": tok_s, "stats": stats}


def write_run(directory: Path, records: list[dict], temperature: float, amx: bool | None) -> Path:
    directory.mkdir(parents=True)
    (directory / "journal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    settings = {"generation": {"temperature": temperature}}
    if amx is None:  # a run still going: settings.json only
        (directory / "settings.json").write_text(json.dumps(settings))
    else:
        (directory / "results.json").write_text(json.dumps(
            {"settings": settings, "environment": {"cpu": {"model": "Some CPU", "amx": str(amx)}}}))
    return directory


def greedy_records() -> list[dict]:
    rows = []
    # Per prompt: nsd/ar 1.5, 2.0, 1.7 (median 1.7); sd/ar 1.2, 1.0, 1.1 (median 1.1);
    # llama-generate/ar 1.0, llama-speculative/ar 1.2, 0.9, 1.3 (the faster peer: speculative).
    for p, nsd, sd, spec in (("p0", 15, 12, 12), ("p1", 20, 10, 9), ("p2", 17, 11, 13)):
        rows += [record(p, "ar", 10), record(p, "nsd@0.9/draft", nsd), record(p, "nsd@0.7/draft", 25),
                 record(p, "sd/draft", sd), record(p, "llama-generate", 10), record(p, "llama-speculative", spec)]
    return rows


def test_greedy_amx_run_checks_every_zero_temperature_target(tmp_path: Path) -> None:
    run = tg.load_run(write_run(tmp_path / "he", greedy_records(), 0.0, amx=True))
    checks = {(c.target.label, c.method): c for c in tg.check(run)}
    assert set(checks) == {
        ("NSD θ 0.9 ≥ 1.6× AR at T = 0", "nsd@0.9/draft"),
        ("SD ≥ 1.1× AR at T = 0", "sd/draft"),
        ("NSD θ 0.9 ≥ 1.6× the faster llama.cpp decoding", "nsd@0.9/draft"),
        # every method of nsd's own, θ 0.7 included; the peers are not ours to hold to it
        ("every method ≥ 0.97× AR", "nsd@0.9/draft"), ("every method ≥ 0.97× AR", "nsd@0.7/draft"),
        ("every method ≥ 0.97× AR", "sd/draft")}
    nsd = checks[("NSD θ 0.9 ≥ 1.6× AR at T = 0", "nsd@0.9/draft")]
    assert nsd.ratio == pytest.approx(1.7) and nsd.verdict == "met"
    assert checks[("SD ≥ 1.1× AR at T = 0", "sd/draft")].ratio == pytest.approx(1.1)
    peer = checks[("NSD θ 0.9 ≥ 1.6× the faster llama.cpp decoding", "nsd@0.9/draft")]
    # Against llama-speculative per prompt: 15/12, 20/9, 17/13 -> median 1.3077.
    assert peer.reference == "llama-speculative"
    assert peer.ratio == pytest.approx(17 / 13) and peer.verdict == "NOT met"


def test_sampled_run_on_a_cpu_without_amx_marks_amx_targets(tmp_path: Path) -> None:
    rows = [r for r in greedy_records() if not r["method"].startswith("llama")]
    run = tg.load_run(write_run(tmp_path / "he8", rows, 0.8, amx=False))
    checks = {(c.target.label, c.method): c for c in tg.check(run)}
    assert ("SD ≥ 1.1× AR at T = 0", "sd/draft") not in checks  # a greedy target
    sampled = checks[("NSD θ 0.9 ≥ 1.3× AR at T > 0", "nsd@0.9/draft")]
    assert sampled.verdict == "would be met (stated for AMX)"
    assert checks[("every method ≥ 0.97× AR", "sd/draft")].verdict == "met"  # for every CPU


def test_avx2_targets_are_read_only_on_runs_known_to_be_from_an_avx2_cpu(tmp_path: Path) -> None:
    # A run records its CPU's model and AMX, not its vector extensions: the AVX2 targets
    # apply where the caller says the run is from an AVX2-only CPU, and nowhere else.
    rows = [r for r in greedy_records() if not r["method"].startswith("llama")]
    run = tg.load_run(write_run(tmp_path / "he", rows, 0.0, amx=False))
    assert not any(c.target.cpu == "avx2" for c in tg.check(run))
    avx2 = {(c.target.label, c.method): c for c in tg.check(dataclasses.replace(run, cpu_class="avx2"))}
    nsd = avx2[("NSD θ 0.9 ≥ 1.3× AR at T = 0 (AVX2)", "nsd@0.9/draft")]
    assert nsd.applies and nsd.verdict in ("met", "NOT met")
    assert nsd.verdict == ("met" if nsd.ratio >= 1.3 else "NOT met")
    sd = avx2[("SD ≥ 1.05× AR at T = 0 (AVX2)", "sd/draft")]
    assert sd.ratio == pytest.approx(1.1) and sd.verdict == "met"  # 1.1 against 1.05
    assert avx2[("SD ≥ 1.1× AR at T = 0", "sd/draft")].verdict.endswith("(stated for AMX)")


def test_shortfall_splits_the_missing_time_by_part(tmp_path: Path) -> None:
    # AR: 20 tokens in 2 s per prompt (0.1 s/token). NSD: 24 tokens in 2 s, 1.2x; for 1.5x
    # it may take 24 * 0.1 / 1.5 = 1.6 s, a cut of 0.4 s per prompt.
    rows = [record(p, m, r, prefill=0.5, draft=0.5) for p in ("p0", "p1") for m, r in (("ar", 10), ("nsd@0.9/draft", 12))]
    run = tg.load_run(write_run(tmp_path / "r", rows, 0.0, amx=None))
    assert run.cpu.startswith("CPU not recorded") and not run.amx
    gap = tg.shortfall(run, "nsd@0.9/draft", 1.5)
    assert gap["ratio_aggregate"] == pytest.approx(1.2)
    assert gap["needed_ms_per_token"] == pytest.approx(1e3 * 1.6 / 24)
    parts = gap["parts"]
    assert parts["prefill"]["now"] == pytest.approx(500) and parts["prefill"]["unit"] == "ms/prompt"
    assert parts["prefill"]["alone"] == pytest.approx(100)
    assert parts["draft"]["now"] == pytest.approx(50) and parts["draft"]["alone"] == pytest.approx(10)
    assert parts["verify"]["alone"] == pytest.approx(40)
    assert parts["rest"]["now"] == pytest.approx(20) and parts["rest"]["alone"] is None  # 0.2 s < 0.4 s
    assert tg.shortfall(run, "nsd@0.9/draft", 1.2) is None  # met: nothing to cut
    assert "not enough alone" in tg.format_shortfall(run.name, gap)


def test_a_directory_without_a_journal_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(NSDError, match="no journal.jsonl or summary.json"):
        tg.load_run(tmp_path)


def test_a_run_kept_as_its_summary_gives_the_same_checks(tmp_path: Path) -> None:
    # The repository keeps a run's summary.json, not its journal: the paired ratios stored
    # there (report.paired_ratios, from the same records) give the same verdicts.
    from nsd.bench.report import paired_ratios

    records = greedy_records()
    full = tg.load_run(write_run(tmp_path / "full", records, 0.0, amx=True))
    kept = tmp_path / "kept"
    kept.mkdir()
    rows = [{"method": m, "family": r["family"], "theta": r["theta"]}
            for m, r in {r["method"]: r for r in records}.items()]
    (kept / "summary.json").write_text(json.dumps({
        "settings": {"generation": {"temperature": 0.0}},
        "environment": {"cpu": {"model": "Some CPU", "amx": "True"}},
        "summary": rows, "paired": paired_ratios(records)}))
    summary = tg.load_run(kept)
    assert not summary.records and summary.amx
    ours, theirs = tg.check(summary), tg.check(full)
    assert [(c.target, c.method, c.reference, c.verdict) for c in ours] == \
        [(c.target, c.method, c.reference, c.verdict) for c in theirs]
    assert [c.ratio for c in ours] == pytest.approx([c.ratio for c in theirs])
    assert len(ours) == 6
    assert tg.shortfall(summary, "nsd@0.9/draft", 1.8) is None  # needs the records
