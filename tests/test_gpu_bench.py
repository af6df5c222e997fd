"""The GPU cost measurement and its predictor (nsd.bench.gpu_costs, nsd.bench.gpu_predict),
smoke-tested on the CPU with a tiny model; the two commands once end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402

from nsd.bench import gpu_costs, gpu_predict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def test_gpu_costs_quick_runs_on_cpu_and_predicts(tmp_path: Path) -> None:
    lines: list[str] = []
    report = gpu_costs.measure(["tiny"], torch.device("cpu"), torch.float32, [1, 2, 5], context=16,
                               reps=3, warmup=2, modes=["eager"], log=lines.append)
    saved = json.loads(json.dumps(report))  # as the command writes it
    assert saved["ns"] == [1, 2, 5] and saved["modes"] == ["eager"]
    assert set(saved["models"]["tiny"]["ms"]["eager"]) == {"1", "2", "5"}
    assert all(v > 0 for v in report["models"]["tiny"]["ms"]["eager"].values())
    assert any(line.startswith("  tiny (") for line in lines) and "nsd overhead" in lines[-1]
    printed: list[str] = []
    pred = gpu_predict.prediction_report(saved, "gpu_costs_cpu.json",
                                         {"acc": {"sd": [0.9, 0.8], "nsd@0.9": [0.99, 0.95]}},
                                         ["tiny:tiny"], log=printed.append)
    text = "\n".join(printed)
    assert "PREDICTIONS" in text and "not end-to-end" in text
    rows = pred["predictions"]["acc"]["rows"]
    assert [r["method"] for r in rows] == ["ar", "nsd@0.9", "sd"]
    assert all(r["k"] in (1, 4) for r in rows[1:])  # only c(2) and c(5) were measured


def test_the_commands_end_to_end(tmp_path: Path) -> None:
    costs = tmp_path / "gpu_costs_cpu.json"
    run = subprocess.run([sys.executable, str(BENCH / "gpu_costs.py"), "--quick", "--models", "tiny",
                          "--context", "16", "--device", "cpu", "--out", str(costs)],
                         capture_output=True, text=True, timeout=600, env=ENV)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("device cpu (") and f"wrote {costs}" in run.stdout
    acceptance = tmp_path / "acc.json"
    acceptance.write_text(json.dumps({"sd": [0.9, 0.8]}))
    run = subprocess.run([sys.executable, str(BENCH / "gpu_predict.py"), str(costs), "--acceptance",
                          str(acceptance), "--pairs", "tiny:tiny"], capture_output=True, text=True, timeout=600,
                         env=ENV)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "PREDICTIONS" in run.stdout and "| tiny:tiny | eager | sd |" in run.stdout
    assert json.loads((tmp_path / "gpu_predict_cpu.json").read_text())["predictions"]["acc"]["rows"]


def test_expected_tokens_and_acceptance_pooling(tmp_path: Path) -> None:
    assert gpu_predict.expected_tokens([1.0], 4) == 5.0
    assert gpu_predict.expected_tokens([0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    results = tmp_path / "results.json"
    stats = lambda att, acc: {"position_attempts": att, "position_accepts": acc}  # noqa: E731
    results.write_text(json.dumps({"records": [
        {"method": "sd/draft", "proposer": "draft", "stats": stats([4, 2], [2, 1])},
        {"method": "sd/draft", "proposer": "draft", "stats": stats([4], [4])},
        {"method": "sd/ngram", "proposer": "ngram", "stats": stats([9], [0])},
        {"method": "ar", "proposer": None, "stats": stats([], [])},
    ]}))
    assert gpu_predict.acceptance_from_results(results) == {"sd": [0.75, 0.5]}
    # The small summary the repository keeps gives the same pooled rates (an unreached
    # position, NaN in the summary and null in its JSON, is left out as above).
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"summary": [
        {"method": "sd/draft", "proposer": "draft", "acceptance_by_position": [0.75, 0.5, None]},
        {"method": "sd/ngram", "proposer": "ngram", "acceptance_by_position": [0.0]},
        {"method": "ar", "proposer": None, "acceptance_by_position": []},
    ]}))
    assert gpu_predict.acceptance_from_results(summary) == {"sd": [0.75, 0.5]}
