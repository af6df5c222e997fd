"""The benchmark loop on mock models: the grid, the journal and resuming, settings checks,
atomic outputs, the report and the plots, and the ``nsd bench`` command itself."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mock import MockLM
from nsd import options as optspec
from nsd.api import Engine, GenerationConfig
from nsd.bench import cli as bench_cli
from nsd.bench.datasets import BenchPrompt
from nsd.bench.methods import expand_methods
from nsd.bench.plots import write_plots
from nsd.bench.report import cost_table, weights_used, write_report
from nsd.bench.runner import BenchRunner, RunConfig
from nsd.bench.speed import visible_tokens
from nsd.bench.store import Journal, jsonable, read_journal, write_json_atomic
from nsd.cli import main
from nsd.draftlen.priors import lookup_measured
from nsd.errors import NSDError

VOCAB = 16


class LetterTokenizer:
    """Token i <-> letter 'a' + i; enough of a Hugging Face tokenizer for the engine."""

    eos_token_id = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text if not c.isspace()]

    def decode(self, tokens, skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + int(t)) for t in tokens)


def fake_engine() -> Engine:
    """A real :class:`Engine` whose models are mock LMs (no weights loaded)."""
    draft = MockLM(vocab_size=VOCAB, seed=0, sharpness=1.5)
    draft.table += torch.randn(draft.table.shape, generator=torch.Generator().manual_seed(1))
    engine = Engine.from_backends(MockLM(vocab_size=VOCAB, seed=0), LetterTokenizer(), draft,
                                  eos_token_ids=())
    engine.calls = 0
    generate = engine.generate

    def counting_generate(prompt, config=GenerationConfig(), chat=False):
        engine.calls += 1
        return generate(prompt, config, chat)

    engine.generate = counting_generate
    return engine


PROMPTS = [BenchPrompt(uid=f"toy:{i}", dataset="toy", category="even" if i % 2 == 0 else "odd",
                       text=text, chat=False) for i, text in enumerate(["abcab", "hello there", "xyzxyz"])]
METHODS = expand_methods(["ar", "sd", "nsd", "nsd-budget", "typical"], [0.5, 0.9], [1.0],
                         ["draft", "ngram"])
CONFIG = RunConfig(methods=METHODS, generation=GenerationConfig(max_new_tokens=12, k=4), warmup=False)
SETTINGS = {"target": "mock", "generation": {"max_new_tokens": 12}}


def test_method_grid_labels() -> None:
    labels = [m.label for m in METHODS]
    assert labels == ["ar", "sd/draft", "sd/ngram", "nsd@0.5/draft", "nsd@0.9/draft", "nsd@0.5/ngram",
                      "nsd@0.9/ngram", "nsd-budget@B1/draft", "nsd-budget@B1/ngram",
                      "typical/draft", "typical/ngram"]
    budget = METHODS[labels.index("nsd-budget@B1/draft")]
    assert budget.theta == 0.9 and budget.sd_baseline == "sd/draft" and budget.ar_baseline == "ar"
    with pytest.raises(NSDError, match="unknown method"):
        expand_methods(["fast"], [0.9], [], ["draft"])
    with pytest.raises(NSDError, match="nsd-budget needs --budget"):
        expand_methods(["nsd-budget"], [0.9], [], ["draft"])
    with pytest.raises(NSDError, match=r"theta must be a number in \[0, 1\]"):
        expand_methods(["nsd"], [1.5], [], ["draft"])
    # A budget without the method that spends it would be silently unused.
    with pytest.raises(NSDError, match="--budget is used only by the nsd-budget method"):
        expand_methods(["ar", "nsd"], [0.9], [4.0], ["draft"])
    with pytest.raises(NSDError, match="--budget-theta is used only by the nsd-budget method"):
        expand_methods(["nsd"], [0.9], [], ["draft"], 0.9)


def test_run_grid_and_resume(tmp_path: Path) -> None:
    engine = fake_engine()
    records = BenchRunner(engine, CONFIG, Journal(tmp_path, SETTINGS), progress=False).run(PROMPTS)
    assert len(records) == len(PROMPTS) * len(METHODS) == engine.calls
    by = {(r["prompt"], r["method"]): r for r in records}
    # Greedy exact SD reproduces AR exactly; relaxed methods carry their fidelity cost.
    for p in PROMPTS:
        ar = by[(p.uid, "ar")]
        assert ar["stats"]["tau"] == 1.0 and ar["stats"]["new_tokens"] == 12
        assert by[(p.uid, "sd/draft")]["token_ids"] == ar["token_ids"]
        assert by[(p.uid, "sd/ngram")]["token_ids"] == ar["token_ids"]
        assert by[(p.uid, "nsd-budget@B1/draft")]["stats"]["deviation"] <= 1.0 + 1e-9
        assert by[(p.uid, "nsd@0.9/draft")]["proposer"] == "draft"
        assert isinstance(ar["loglik"], float) and ar["load"]["other_cpu"] >= 0.0
    assert len((tmp_path / "journal.jsonl").read_text().splitlines()) == len(records)

    # A second run into the same folder finds everything done and generates nothing.
    again = fake_engine()
    resumed = BenchRunner(again, CONFIG, Journal(tmp_path, SETTINGS), progress=False).run(PROMPTS)
    assert again.calls == 0 and resumed == records


def test_resume_skips_only_journaled_records(tmp_path: Path) -> None:
    config = RunConfig(methods=METHODS[:3], generation=GenerationConfig(max_new_tokens=6, k=4), warmup=False)
    journal = Journal(tmp_path, SETTINGS)
    BenchRunner(fake_engine(), config, journal, progress=False).run(PROMPTS[:1])
    # Simulate a crash mid-write: a torn last line is dropped, not fatal.
    with open(tmp_path / "journal.jsonl", "a", encoding="utf-8") as f:
        f.write('{"prompt": "toy:1", "meth')
    engine = fake_engine()
    records = BenchRunner(engine, config, Journal(tmp_path, SETTINGS), progress=False).run(PROMPTS)
    assert engine.calls == (len(PROMPTS) - 1) * 3
    assert len(records) == len(PROMPTS) * 3
    lines = (tmp_path / "journal.jsonl").read_text().splitlines()
    assert len(lines) == len(records) and all(json.loads(line) for line in lines)


def test_different_settings_are_refused_unless_overwrite(tmp_path: Path) -> None:
    config = RunConfig(methods=METHODS[:1], generation=GenerationConfig(max_new_tokens=4, k=4), warmup=False)
    BenchRunner(fake_engine(), config, Journal(tmp_path, SETTINGS), progress=False).run(PROMPTS[:1])
    other = {**SETTINGS, "target": "another-model"}
    with pytest.raises(NSDError, match=r"different settings \(target: 'mock' -> 'another-model'\).*--overwrite"):
        Journal(tmp_path, other)
    journal = Journal(tmp_path, other, overwrite=True)
    assert len(journal) == 0 and not (tmp_path / "journal.jsonl").exists()


def test_warmup_is_not_recorded(tmp_path: Path) -> None:
    config = RunConfig(methods=METHODS[:3], generation=GenerationConfig(max_new_tokens=4, k=4), warmup=True)
    engine = fake_engine()
    records = BenchRunner(engine, config, Journal(tmp_path, SETTINGS), progress=False).run(PROMPTS[:1])
    assert len(records) == 3 and engine.calls == 3 + 3  # ar, sd/draft, sd/ngram paths warmed
    # One warm-up per family and proposer: both θ of NSD share one, SD has its own (the
    # rules differ), and nsd-budget and typical each theirs.
    methods = [m for m in METHODS if m.proposer in (None, "draft")]
    config = RunConfig(methods=methods, generation=GenerationConfig(max_new_tokens=4, k=4), warmup=True)
    engine = fake_engine()
    records = BenchRunner(engine, config, Journal(tmp_path / "b", SETTINGS), progress=False).run(PROMPTS[:1])
    assert len(methods) == 6 and engine.calls == 6 + 5  # ar, sd, nsd (x2 θ), nsd-budget, typical


def test_draft_proposer_needs_a_draft(tmp_path: Path) -> None:
    engine = fake_engine()
    engine.draft = None
    config = RunConfig(methods=METHODS[1:2], generation=GenerationConfig(max_new_tokens=4, k=4), warmup=False)
    with pytest.raises(NSDError, match="draft proposer needs a draft model"):
        BenchRunner(engine, config, Journal(tmp_path, SETTINGS), progress=False).run(PROMPTS[:1])


def test_atomic_json_and_jsonable(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    write_json_atomic(path, {"a": math.nan, "b": [math.inf, -math.inf, 1.5], "c": (1, 2)})
    assert json.loads(path.read_text()) == {"a": None, "b": ["inf", "-inf", 1.5], "c": [1, 2]}
    write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temp file left behind
    assert jsonable({"x": {"y": math.nan}}) == {"x": {"y": None}}


def test_report_and_plots(tmp_path: Path) -> None:
    records = BenchRunner(fake_engine(), CONFIG, Journal(tmp_path, SETTINGS), progress=False).run(PROMPTS)
    settings = {"target": "mock", "draft": "mock-draft", "backend": "hf", "datasets": ["toy"],
                "generation": {"max_new_tokens": 12, "temperature": 0.0, "k": 4}}
    summary, text = write_report(tmp_path, records, METHODS, settings, max_other_cpu=0.25)
    rows = {r["method"]: r for r in summary}
    assert rows["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert rows["sd/draft"]["agreement"] == 1.0 and rows["sd/draft"]["exact_match"] == 1.0
    assert rows["sd/draft"]["deviation_per_token"] == 0.0
    assert rows["nsd@0.9/draft"]["tau"] >= 1.0
    assert rows["sd/draft"]["acceptance_by_position"]
    assert math.isnan(rows["ar"]["speedup_vs_sd"])
    assert "| nsd@0.9/draft |" in text and "## By category" in text and "toy/even" in text
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["records"]) == len(records) and results["environment"]["cpu_count"]
    assert (tmp_path / "report.md").read_text() == text
    made = write_plots(summary, tmp_path)
    assert {p.name for p in made} == {"speedup_vs_theta.png", "quality_vs_speedup.png",
                                      "accepted_length.png", "acceptance_by_position.png",
                                      "deviation_vs_loglik.png"}  # no pass@1 here: no frontier plot
    for p in made:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_peer_without_draft_timings_reports_after_a_resume(tmp_path: Path) -> None:
    # transformers' peers time no draft or prefill part: NaN, stored as null in the
    # journal. A report built from the journal (a resumed run) summed them and failed.
    records = BenchRunner(fake_engine(), CONFIG, Journal(tmp_path, SETTINGS), progress=False).run(PROMPTS)
    for r in records:
        if r["method"] == "ar":
            r["stats"].update(propose_s=math.nan, prefill_s=math.nan, overhead_per_pass_s=math.nan)
    back = [json.loads(json.dumps(jsonable(r))) for r in records]
    assert any(r["stats"]["propose_s"] is None for r in back)
    settings = {"target": "mock", "draft": "mock-draft", "backend": "hf", "datasets": ["toy"],
                "generation": {"max_new_tokens": 12, "temperature": 0.0, "k": 4}}
    summary, _ = write_report(tmp_path / "report", back, METHODS, settings, max_other_cpu=0.25)
    rows = {r["method"]: r for r in summary}
    assert math.isnan(rows["ar"]["draft_s_per_pass"]) and rows["sd/draft"]["draft_s_per_pass"] >= 0


def test_weight_formats_are_recorded_per_call(tmp_path: Path) -> None:
    engine = fake_engine()
    engine.target_model.weights, engine.draft_model.weights = "original", "q4_0"
    config = RunConfig(methods=METHODS[:3], generation=GenerationConfig(max_new_tokens=4, k=2), warmup=False)
    records = BenchRunner(engine, config, Journal(tmp_path, SETTINGS), progress=False).run(PROMPTS)
    by_method = {r["method"]: r["weights"] for r in records}
    assert by_method == {"ar": {"target": "original"}, "sd/ngram": {"target": "original"},
                         "sd/draft": {"target": "original", "draft": "q4_0"}}
    assert weights_used(records) == "target original; draft q4_0"
    # A resumed run that picked another target format says so, with counts.
    mixed = records + [{**records[0], "weights": {"target": "q4_0"}}]
    assert weights_used(mixed) == f"target original ({len(records)} calls), q4_0 (1 calls); draft q4_0"
    assert weights_used([{"weights": {}}, {}]) is None


def test_fidelity_changes_are_paired_with_ar(tmp_path: Path) -> None:
    records = BenchRunner(fake_engine(), CONFIG, Journal(tmp_path, SETTINGS), progress=False).run(PROMPTS)
    # Pretend HumanEval ran: AR solves prompts 0 and 1, nsd@0.5/draft only prompt 0.
    solved = {("ar", "toy:0"), ("ar", "toy:1"), ("nsd@0.5/draft", "toy:0")}
    for r in records:
        r["passed"] = (r["method"], r["prompt"]) in solved
    settings = {"target": "mock", "draft": "mock-draft", "backend": "hf", "datasets": ["toy"],
                "generation": {"max_new_tokens": 12, "temperature": 0.0, "k": 4}}
    summary, text = write_report(tmp_path, records, METHODS, settings, max_other_cpu=0.25)
    rows = {r["method"]: r for r in summary}
    nsd = rows["nsd@0.5/draft"]
    assert nsd["pass_at_1"] == pytest.approx(1 / 3)
    assert nsd["pass_at_1_change"][0] == pytest.approx(-1 / 3)  # (0 - 0) + (0 - 1) + (0 - 0) over 3
    lo, hi = nsd["pass_at_1_ci"]
    assert 0.0 < lo < 1 / 3 < hi < 1.0
    assert rows["ar"]["pass_at_1_change"] == [0.0, 0.0, 0.0]
    ll = [r["loglik"] for r in records if r["method"] == "nsd@0.5/draft"]
    ref = [r["loglik"] for r in records if r["method"] == "ar"]
    assert nsd["loglik_change"][0] == pytest.approx(sum(ll) / 3 - sum(ref) / 3)
    assert "Δ pass@1 vs AR" in text and "| nsd@0.5/draft |" in text
    made = {p.name for p in write_plots(summary, tmp_path)}
    assert "speedup_vs_pass_change.png" in made


def test_cli_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps({"id": i, "prompt": p.text}) + "\n" for i, p in enumerate(PROMPTS)))
    monkeypatch.setattr(bench_cli, "_engine", lambda args, draft: fake_engine())
    out = tmp_path / "out"
    argv = ["bench", "--dataset", str(data), "--limit", "2", "--no-chat", "--methods", "ar,sd,nsd",
            "--theta", "0.5,0.9", "--proposers", "draft,ngram", "--max-new-tokens", "8",
            "--out", str(out), "--no-progress", "--no-warmup"]
    assert main(argv) == 0
    report = capsys.readouterr().out
    assert "| nsd@0.5/ngram |" in report
    assert {"results.json", "summary.json", "report.md", "journal.jsonl", "settings.json"} <= \
        {p.name for p in out.iterdir()}
    results = json.loads((out / "results.json").read_text())
    assert len(results["records"]) == 2 * 7
    # The small summary the repository keeps: everything but the records, plus the paired
    # ratios that the documents' tables read (the same figures as the report's "vs AR").
    small = json.loads((out / "summary.json").read_text())
    assert {k: v for k, v in small.items() if k not in ("paired", "weights", "prompt_rates")} == \
        {k: v for k, v in results.items() if k != "records"}
    # And each prompt's tokens/s per method, which the paired medians' intervals resample.
    assert small["prompt_rates"] == {r["prompt"]: {**small["prompt_rates"][r["prompt"]],
                                                   r["method"]: pytest.approx(r["tokens_per_s"], rel=1e-5)}
                                     for r in results["records"]}
    for row in results["summary"]:
        if row["method"] != "ar":
            assert small["paired"][row["method"]]["ar"] == pytest.approx(row["speedup_vs_ar"])
    # Everything journaled: the report is rebuilt without loading a model.
    monkeypatch.setattr(bench_cli, "_engine", lambda args, draft: pytest.fail("loaded a model"))
    assert main(argv) == 0
    assert capsys.readouterr().out == report
    # Changed decoding settings into the same folder: a clear error, exit status 2.
    assert main(argv + ["--temperature", "0.7"]) == 2
    assert "different settings" in capsys.readouterr().err
    # A run journaled before nsd had a knob (its settings lack it) resumes while the knob
    # stays at its default, and is refused once it is set.
    settings = json.loads((out / "settings.json").read_text())
    del settings["generation"]["draft_context"], settings["generation"]["fly_window_size"]
    (out / "settings.json").write_text(json.dumps(settings))
    assert main(argv) == 0
    assert capsys.readouterr().out == report
    assert main(argv + ["--draft-context", "64"]) == 2
    assert "(generation.draft_context: unset -> 64)" in capsys.readouterr().err
    assert main(argv + ["--methods", "ar,fast"]) == 2
    assert "unknown method 'fast'" in capsys.readouterr().err
    assert main(argv + ["--target", "custom.gguf"]) == 2  # a custom target brings no draft
    assert "need a draft model" in capsys.readouterr().err


def test_cli_default_proposer_and_engine_default_come_from_the_options(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    data = tmp_path / "toy.jsonl"
    data.write_text(json.dumps({"id": 0, "prompt": PROMPTS[0].text}) + "\n")
    monkeypatch.setattr(bench_cli, "_engine", lambda args, draft: fake_engine())
    argv = ["bench", "--dataset", str(data), "--no-chat", "--methods", "ar,nsd", "--theta", "0.9",
            "--max-new-tokens", "4", "--out", str(tmp_path / "out"), "--no-progress", "--no-warmup"]
    # The default pair has stored prompt-lookup estimates: the hybrid proposer.
    assert lookup_measured(bench_cli.DEFAULT_TARGET, bench_cli.DEFAULT_DRAFT)
    assert main(argv) == 0
    assert "| nsd@0.9/hybrid |" in capsys.readouterr().out
    # The bench follows the one definition of the default.
    monkeypatch.setattr(optspec, "DEFAULT_PROPOSER", "draft")
    assert main(argv + ["--overwrite"]) == 0
    assert "| nsd@0.9/draft |" in capsys.readouterr().out
    # Models without stored lookup estimates (here mock LMs) draft with the draft model alone.
    assert not lookup_measured(None, None) and not lookup_measured("my.gguf", "draft.gguf")
    assert fake_engine().proposer_kind == "draft"
    alone = Engine.from_backends(MockLM(vocab_size=VOCAB, seed=0), LetterTokenizer(), eos_token_ids=())
    assert alone.proposer_kind == optspec.default_proposer(False) == "ngram"


def test_visible_tokens_drop_the_overshoot_past_a_stop() -> None:
    tok = LetterTokenizer()
    tokens = [0, 1, 2, 3, 4]  # "abcde"
    assert visible_tokens(tok, tokens, "abc") == [0, 1, 2]
    assert visible_tokens(tok, tokens, "abcde") == tokens
    assert visible_tokens(tok, tokens, "") == []


def test_stop_strings_compare_the_visible_output(tmp_path: Path) -> None:
    engine = fake_engine()
    prompt = BenchPrompt(uid="toy:stop", dataset="toy", category="toy", text="abc", chat=False)
    full = engine.generate(engine.encode(prompt.text), GenerationConfig(method="ar", max_new_tokens=16)).text
    stop = full[6:8]
    config = RunConfig(methods=expand_methods(["ar", "sd"], [], [], ["draft"]), warmup=False,
                       generation=GenerationConfig(max_new_tokens=16, k=4, stop=(stop,)))
    ar, sd = BenchRunner(engine, config, Journal(tmp_path, SETTINGS), progress=False).run([prompt])
    assert ar["stats"]["stop_reason"] == sd["stats"]["stop_reason"] == "stop"
    assert ar["text"] == sd["text"] == full[:full.find(stop)]
    assert ar["output_ids"] == sd["output_ids"]
    assert len(sd["output_ids"]) <= len(sd["token_ids"])
    assert sd["tokens_per_s"] == pytest.approx(len(sd["output_ids"]) / sd["stats"]["wall_s"])


def test_k_variants_are_labelled_and_paired_with_their_sd(tmp_path: Path) -> None:
    specs = expand_methods(["ar", "sd", "nsd"], [0.9], [], ["draft"], ks=["auto", 2])
    labels = [s.label for s in specs]
    assert labels == ["ar", "sd/draft/k=auto", "sd/draft/k=2", "nsd@0.9/draft/k=auto", "nsd@0.9/draft/k=2"]
    by = {s.label: s for s in specs}
    assert by["nsd@0.9/draft/k=2"].sd_baseline == "sd/draft/k=2"
    assert by["nsd@0.9/draft/k=2"].generation_config(GenerationConfig()).k == 2
    assert by["sd/draft/k=auto"].generation_config(GenerationConfig(k=3)).k == "auto"
    for bad in (0, 65):  # -k's own range, named by the flag, before any model loads
        with pytest.raises(NSDError, match=r"--ks must be a whole number in \[1, 64\]"):
            expand_methods(["sd"], [0.9], [], ["draft"], ks=[bad])
    # -k auto in the loop: the report carries the chosen k's and the cost breakdown.
    config = RunConfig(methods=specs, generation=GenerationConfig(max_new_tokens=8, k_max=3), warmup=False)
    records = BenchRunner(fake_engine(), config, Journal(tmp_path, SETTINGS), progress=False).run(PROMPTS[:2])
    auto = [r for r in records if r["method"] == "sd/draft/k=auto"]
    assert auto and all(r["stats"]["k_per_pass"] for r in auto)
    # Fixed k = 2, shortened only where fewer tokens remain to generate.
    assert all(r["stats"]["k_per_pass"][0] == 2 and set(r["stats"]["k_per_pass"]) <= {0, 1, 2}
               for r in records if r["method"] == "sd/draft/k=2")
    settings = {"target": "mock", "draft": "mock-draft", "backend": "hf", "datasets": ["toy"],
                "generation": {"max_new_tokens": 8, "temperature": 0.0, "k": "auto"}}
    summary, text = write_report(tmp_path, records, specs, settings, max_other_cpu=0.25)
    assert "Cost breakdown per target pass" in text
    assert 1.0 < {r["method"]: r["mean_k"] for r in summary}["sd/draft/k=2"] <= 2.0


def test_draft_context_variants_are_labelled_paired_and_run(tmp_path: Path) -> None:
    specs = expand_methods(["ar", "sd", "nsd"], [0.9], [], ["draft"], ks=[2], contexts=[0, 3])
    labels = [s.label for s in specs]
    assert labels == ["ar", "sd/draft/k=2/ctx=all", "sd/draft/k=2/ctx=3",
                      "nsd@0.9/draft/k=2/ctx=all", "nsd@0.9/draft/k=2/ctx=3"]
    by = {s.label: s for s in specs}
    assert by["nsd@0.9/draft/k=2/ctx=3"].sd_baseline == "sd/draft/k=2/ctx=3"
    assert by["sd/draft/k=2/ctx=3"].generation_config(GenerationConfig()).draft_context == 3
    assert by["sd/draft/k=2/ctx=all"].generation_config(GenerationConfig(draft_context=9)).draft_context == 0
    assert by["ar"].generation_config(GenerationConfig(draft_context=9)).method == "ar"
    ngram = expand_methods(["sd"], [], [], ["ngram", "draft"], contexts=[0, 3])
    assert [s.label for s in ngram] == ["sd/ngram", "sd/draft/ctx=all", "sd/draft/ctx=3"]
    with pytest.raises(NSDError, match="--draft-contexts must be a whole number >= 0"):
        expand_methods(["sd"], [0.9], [], ["draft"], contexts=[-1])
    config = RunConfig(methods=specs, generation=GenerationConfig(max_new_tokens=8), warmup=False)
    records = BenchRunner(fake_engine(), config, Journal(tmp_path, SETTINGS), progress=False).run(PROMPTS[:2])
    # Greedy SD stays AR whatever the draft reads.
    by_prompt: dict[str, dict[str, dict]] = {}
    for r in records:
        by_prompt.setdefault(r["prompt"], {})[r["method"]] = r
    for rs in by_prompt.values():
        assert rs["sd/draft/k=2/ctx=3"]["output_ids"] == rs["sd/draft/k=2/ctx=all"]["output_ids"] == rs["ar"]["output_ids"]


def test_rerun_loaded_drops_whole_prompts(tmp_path: Path) -> None:
    journal = Journal(tmp_path, SETTINGS)
    for prompt, method, flagged in [("p1", "ar", False), ("p1", "sd/draft", True),
                                    ("p2", "ar", False), ("p2", "sd/draft", False)]:
        journal.append({"prompt": prompt, "method": method, "load": {"flagged": flagged}})
    assert journal.drop_loaded_prompts() == 1
    assert set(journal.records) == {("p2", "ar"), ("p2", "sd/draft")}
    reread = Journal(tmp_path, SETTINGS)  # the journal on disk says the same
    assert set(reread.records) == {("p2", "ar"), ("p2", "sd/draft")}


def test_read_journal_is_read_only_and_strict_in_the_middle(tmp_path: Path) -> None:
    good = [{"prompt": "toy:0", "method": "ar", "x": 1}, {"prompt": "toy:0", "method": "sd", "x": 2}]
    path = tmp_path / "journal.jsonl"
    live = "".join(json.dumps(r) + "\n" for r in good) + '{"prompt": "toy:1", "me'
    path.write_text(live)
    records, torn = read_journal(path)
    assert torn and list(records) == [("toy:0", "ar"), ("toy:0", "sd")]
    assert path.read_text() == live  # a run may still be appending: never rewritten here
    path.write_text(json.dumps(good[0]) + "\nnot json\n" + json.dumps(good[1]) + "\n")
    with pytest.raises(NSDError, match=r"journal.jsonl:2 is corrupt"):
        read_journal(path)
    assert read_journal(tmp_path / "missing.jsonl") == ({}, False)


def test_read_journal_line_ends_and_torn_tails(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    odd = {"prompt": "toy:0", "method": "ar", "text": "a\u2028b\u0085c\u2029d"}  # not line ends here
    whole = (json.dumps(odd, ensure_ascii=False) + "\n").encode()
    path.write_bytes(whole)
    assert read_journal(path) == ({("toy:0", "ar"): odd}, False)
    # A write cut inside a multi-byte character, and a torn line followed by a blank one.
    cut = json.dumps({"prompt": "toy:1", "method": "ar", "text": "é"}, ensure_ascii=False).encode()
    for tail in (cut[:cut.index("é".encode()) + 1], b'{"prompt": "toy:1"\n\n'):
        path.write_bytes(whole + tail)
        assert read_journal(path) == ({("toy:0", "ar"): odd}, True)
    path.write_bytes(whole + b'{"prompt": "toy:1"}\n')  # whole JSON, but no method: not torn
    with pytest.raises(NSDError, match=r"journal.jsonl:2 is not a benchmark record \(KeyError"):
        read_journal(path)


def test_torn_last_line_ending_in_newline_is_dropped_on_resume(tmp_path: Path) -> None:
    config = RunConfig(methods=METHODS[:1], generation=GenerationConfig(max_new_tokens=4, k=4), warmup=False)
    BenchRunner(fake_engine(), config, Journal(tmp_path, SETTINGS), progress=False).run(PROMPTS[:1])
    with open(tmp_path / "journal.jsonl", "a", encoding="utf-8") as f:
        f.write('{"prompt": "toy:1"\n')  # torn, yet newline-terminated (e.g. a bad copy)
    BenchRunner(fake_engine(), config, Journal(tmp_path, SETTINGS), progress=False).run(PROMPTS)
    # Had the torn line stayed, it would now be a corrupt middle line and block every resume.
    assert len(Journal(tmp_path, SETTINGS)) == len(PROMPTS)


def test_use_proposer_switches_and_checks_the_draft() -> None:
    engine = fake_engine()
    engine.use_proposer("ngram")
    assert engine.proposer_kind == "ngram"
    engine.use_proposer("draft")
    assert engine.proposer_kind == "draft"
    with pytest.raises(NSDError, match="unknown proposer"):
        engine.use_proposer("eagle")
    engine.draft = None
    with pytest.raises(NSDError, match="draft proposer needs a draft model"):
        engine.use_proposer("draft")
    assert engine.proposer_kind == "draft"  # a refused switch changes nothing


def test_changed_settings_are_named_by_dotted_key(tmp_path: Path) -> None:
    settings = {"target": "mock", "threads": 4,
                "generation": {"max_new_tokens": 32, "temperature": 0.0, "k": 4, "stop": []}}
    Journal(tmp_path, settings)
    changed = {**settings, "generation": {**settings["generation"], "max_new_tokens": 16}}
    with pytest.raises(NSDError) as exc:
        Journal(tmp_path, changed)
    message = str(exc.value)
    assert "(generation.max_new_tokens: 32 -> 16)" in message
    assert "temperature" not in message and "{" not in message  # not both whole dicts
    # Keys only one side has, and more changes than are worth listing.
    more = {"target": "other", "threads": 8, "generation": {"k": 2, "seed": 1}}
    with pytest.raises(NSDError) as exc:
        Journal(tmp_path, more)
    message = str(exc.value)
    assert "generation.k: 4 -> 2" in message and "generation.max_new_tokens: 32 -> unset" in message
    assert "generation.seed: unset -> 1" in message and "and 3 more" in message


def test_a_run_that_cannot_start_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys) -> None:
    data = tmp_path / "toy.jsonl"
    data.write_text(json.dumps({"id": 0, "prompt": PROMPTS[0].text}) + "\n")
    monkeypatch.setenv("NSD_LLAMA_TOOLS", str(tmp_path / "no-tools"))
    monkeypatch.setattr(bench_cli, "_engine", lambda args, draft: pytest.fail("loaded a model"))
    out = tmp_path / "out"
    argv = ["bench", "--dataset", str(data), "--no-chat", "--methods", "ar,llama-speculative",
            "--max-new-tokens", "4", "--out", str(out), "--no-progress", "--no-warmup", "--no-plots"]
    assert main(argv) == 2
    assert "llama-speculative-simple, not found" in capsys.readouterr().err
    assert not out.exists()
    # A failure later in the start (here the model load) leaves an earlier run as it was,
    # even with --overwrite.
    monkeypatch.setattr(bench_cli, "_engine", lambda args, draft: fake_engine())
    argv = argv[:argv.index("--methods") + 1] + ["ar"] + argv[argv.index("--methods") + 2:]
    assert main(argv) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def cannot_load(args, draft):
        raise NSDError("cannot load the model")

    monkeypatch.setattr(bench_cli, "_engine", cannot_load)
    for extra in (["--overwrite"], ["--max-new-tokens", "3", "--out", str(tmp_path / "new")]):
        assert main(argv + extra) == 2
        assert "cannot load the model" in capsys.readouterr().err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not (tmp_path / "new").exists()


def test_deferred_journal_writes_on_first_append(tmp_path: Path) -> None:
    out = tmp_path / "out"
    journal = Journal(out, SETTINGS, defer_writes=True)
    assert not out.exists() and len(journal) == 0
    journal.append({"prompt": "p", "method": "ar"})
    assert json.loads((out / "settings.json").read_text()) == SETTINGS
    assert len(Journal(out, SETTINGS)) == 1
    # --overwrite with deferred writes: the earlier run goes only once a record replaces it.
    again = Journal(out, SETTINGS, overwrite=True, defer_writes=True)
    assert len(again) == 0 and len(read_journal(out / "journal.jsonl")[0]) == 1
    again.append({"prompt": "q", "method": "ar"})
    assert list(read_journal(out / "journal.jsonl")[0]) == [("q", "ar")]
    # A folder that cannot be made fails at once, not after the models load.
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(NSDError, match="file is not a folder"):
        Journal(blocker / "out", SETTINGS, defer_writes=True)


@pytest.mark.parametrize("flags, message", [
    (["--budget", "-1"], "--budget values must be finite numbers >= 0 (an unlimited budget is plain nsd), got -1"),
    (["--budget", "nan"], "--budget values must be finite numbers >= 0"),
    (["--budget", "inf"], "--budget values must be finite numbers >= 0"),
    (["--budget-theta", "5"], "--budget-theta must be"),
    (["--theta", "5"], "--theta must be"),
])
@pytest.mark.parametrize("methods", ["ar", "ar,sd,nsd", "nsd-budget"])
def test_grid_values_are_checked_whatever_the_methods(flags, message, methods, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    data = tmp_path / "toy.jsonl"
    data.write_text(json.dumps({"id": 0, "prompt": PROMPTS[0].text}) + "\n")
    monkeypatch.setattr(bench_cli, "_engine", lambda args, draft: pytest.fail("loaded a model"))
    argv = ["bench", "--dataset", str(data), "--no-chat", "--methods", methods, "--budget", "2",
            "--out", str(tmp_path / "out"), "--no-progress", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_the_draft_prefill_is_reported_apart_from_the_draft_per_pass(tmp_path: Path) -> None:
    records = BenchRunner(fake_engine(), CONFIG, Journal(tmp_path, SETTINGS), progress=False).run(PROMPTS)
    settings = {"target": "mock", "draft": "mock-draft", "backend": "hf", "datasets": ["toy"],
                "generation": {"max_new_tokens": 12, "temperature": 0.0, "k": 4}}
    sd = [r for r in records if r["method"] == "sd/draft"]
    for r in sd:  # as if the draft had spent a third of its time reading the prompt
        r["stats"]["propose_s"] = 0.3
        r["stats"]["draft_prefill_s"] = 0.1
    summary, _ = write_report(tmp_path / "new", records, METHODS, settings, max_other_cpu=1.0)
    row = next(r for r in summary if r["method"] == "sd/draft")
    passes = sum(r["stats"]["target_passes"] for r in sd)
    assert row["draft_s_per_pass"] == pytest.approx(0.2 * len(sd) / passes)
    assert row["draft_prefill_s_mean"] == pytest.approx(0.1)
    assert cost_table(summary)[0].endswith("| draft prefill ms |")
    assert any(line.startswith("| sd/draft |") and line.endswith("| 100.0 |") for line in cost_table(summary))
    for r in sd:  # a record made before the measure: nothing subtracted, the column says so
        del r["stats"]["draft_prefill_s"]
    old, _ = write_report(tmp_path / "old", records, METHODS, settings, max_other_cpu=1.0)
    row = next(r for r in old if r["method"] == "sd/draft")
    assert row["draft_s_per_pass"] == pytest.approx(0.3 * len(sd) / passes)
    assert row["draft_prefill_s_mean"] is None
    assert any(line.startswith("| sd/draft |") and line.endswith("| - |") for line in cost_table(old))


def test_the_cost_table_opens_with_ar_as_the_baseline(tmp_path: Path) -> None:
    # AR's row gives the one-token step as the run measured it and the decode rate the
    # speculative rows must beat; it has no draft columns.
    records = BenchRunner(fake_engine(), CONFIG, Journal(tmp_path, SETTINGS), progress=False).run(PROMPTS)
    settings = {"target": "mock", "draft": "mock-draft", "backend": "hf", "datasets": ["toy"],
                "generation": {"max_new_tokens": 12, "temperature": 0.0, "k": 4}}
    summary, _ = write_report(tmp_path / "out", records, METHODS, settings, max_other_cpu=1.0)
    ar = next(r for r in summary if r["family"] == "ar")
    lines = cost_table(summary)
    assert lines[2].startswith(f"| {ar['method']} | 1.00 | - | - | - | {1e3 * ar['target_s_per_pass']:.1f} | - |")
    assert lines[2].endswith("| - | - |")
