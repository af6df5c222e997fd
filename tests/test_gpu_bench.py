"""The GPU cost benchmark and its predictor, smoke-tested on the CPU with a tiny model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_costs_quick_runs_on_cpu_and_predicts(tmp_path: Path, capsys) -> None:
    costs_mod, predict_mod = _load("gpu_costs"), _load("gpu_predict")
    out = tmp_path / "gpu_costs_cpu.json"
    report = costs_mod.main(["--quick", "--models", "tiny", "--context", "16", "--device", "cpu",
                             "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["ns"] == [1, 2, 5] and saved["modes"] == ["eager"]
    assert set(saved["models"]["tiny"]["ms"]["eager"]) == {"1", "2", "5"}
    assert all(v > 0 for v in report["models"]["tiny"]["ms"]["eager"].values())
    acceptance = tmp_path / "acc.json"
    acceptance.write_text(json.dumps({"sd": [0.9, 0.8], "nsd@0.9": [0.99, 0.95]}))
    pred = predict_mod.main([str(out), "--acceptance", str(acceptance), "--pairs", "tiny:tiny"])
    printed = capsys.readouterr().out
    assert "PREDICTIONS" in printed and "not end-to-end" in printed
    rows = pred["predictions"]["acc"]["rows"]
    assert [r["method"] for r in rows] == ["ar", "nsd@0.9", "sd"]
    assert all(r["k"] in (1, 4) for r in rows[1:])  # only c(2) and c(5) were measured


def test_expected_tokens_and_acceptance_pooling(tmp_path: Path) -> None:
    predict_mod = _load("gpu_predict")
    assert predict_mod.expected_tokens([1.0], 4) == 5.0
    assert predict_mod.expected_tokens([0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    results = tmp_path / "results.json"
    stats = lambda att, acc: {"position_attempts": att, "position_accepts": acc}  # noqa: E731
    results.write_text(json.dumps({"records": [
        {"method": "sd/draft", "proposer": "draft", "stats": stats([4, 2], [2, 1])},
        {"method": "sd/draft", "proposer": "draft", "stats": stats([4], [4])},
        {"method": "sd/ngram", "proposer": "ngram", "stats": stats([9], [0])},
        {"method": "ar", "proposer": None, "stats": stats([], [])},
    ]}))
    assert predict_mod.acceptance_from_results(results) == {"sd": [0.75, 0.5]}
