"""HumanEval pass@1: run ``prompt + completion + test + check(entry_point)`` in isolation.

This executes model-written code. As in OpenAI's human-eval harness, each program runs in
a separate process, in an empty temporary directory, with a wall-clock limit and (on
POSIX) memory and CPU limits; a program that hangs is killed with its whole process group.
It is not a sandbox: run untrusted models' output in a container.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# Standard HumanEval post-processing (Codex paper and human-eval practice): the completion
# is the function body; anything at column 0 after it is a new top-level statement. The
# instruct models also like to close a Markdown fence.
HUMANEVAL_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```", "\nassert ")

_MEMORY_LIMIT = 4 << 30  # bytes of address space for one test program


@dataclass(frozen=True)
class ExecResult:
    passed: bool
    status: str  # "passed", "failed" or "timeout"
    detail: str = ""  # the tail of stderr for a failure


def truncate_completion(text: str, stops: tuple[str, ...] = HUMANEVAL_STOPS) -> str:
    """Cut ``text`` at the first stop sequence."""
    cut = len(text)
    for stop in stops:
        at = text.find(stop)
        if 0 <= at < cut:
            cut = at
    return text[:cut]


def extract_code(text: str) -> str:
    """The first fenced code block of a chat answer (the whole text if it has none)."""
    match = re.search(r"```[\w+-]*\n(.*?)(?:```|$)", text, re.DOTALL)
    return match.group(1) if match else text


def program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """The program human-eval runs: the function, its tests, and the call that checks it."""
    return f"{prompt}{completion}\n\n{test}\n\ncheck({entry_point})\n"


def _limit_resources() -> None:  # pragma: no cover - runs in the child process
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (_MEMORY_LIMIT, _MEMORY_LIMIT))
    except (ImportError, ValueError, OSError):
        pass  # not POSIX, or the limit is already lower: the timeout still applies


def run_program(source: str, timeout_s: float = 10.0) -> ExecResult:
    """Run ``source`` with a fresh isolated interpreter; passed iff it exits with status 0."""
    with tempfile.TemporaryDirectory(prefix="nsd-humaneval-") as tmp:
        path = os.path.join(tmp, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
        # -I: ignore PYTHON* variables and the user site. The child leads its own process
        # group, so a timeout also kills anything it spawned.
        proc = subprocess.Popen([sys.executable, "-I", path], cwd=tmp, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True,
                                preexec_fn=_limit_resources if os.name == "posix" else None)
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return ExecResult(False, "timeout", f"no exit within {timeout_s:g}s")
    if proc.returncode == 0:
        return ExecResult(True, "passed")
    tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
    return ExecResult(False, "failed", tail[0][-300:])


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (AttributeError, ProcessLookupError, PermissionError):
        proc.kill()


def check_completion(prompt: str, completion: str, test: str, entry_point: str,
                     timeout_s: float = 10.0) -> ExecResult:
    """pass/fail of one HumanEval completion (already truncated)."""
    return run_program(program(prompt, completion, test, entry_point), timeout_s)


def stops_for(prompt) -> tuple[str, ...]:
    """The stop strings a benchmark call adds for ``prompt`` (a
    :class:`~nsd.bench.datasets.BenchPrompt`): a HumanEval code completion ends at a new
    top-level statement; a chat answer ends at the chat template's end of turn."""
    return HUMANEVAL_STOPS if prompt.entry_point is not None and not prompt.chat else ()


def is_scored(prompt) -> bool:
    """Whether ``prompt`` carries tests to score its answer for pass@1 (HumanEval)."""
    return prompt.test is not None and prompt.entry_point is not None


def score_humaneval(prompt, text: str, timeout_s: float = 10.0, execute: bool = True) -> dict:
    """A HumanEval answer post-processed and, with ``execute``, run against its tests: the
    fields ``completion``, ``passed``, ``exec_status`` and ``exec_detail`` of a benchmark
    record (the last three None when not executed). Call it after the clock stopped."""
    if prompt.chat:  # a chat answer holds a whole program in a code block
        completion, header = extract_code(text), ""
    else:  # a code completion continues the prompt's function body
        completion, header = truncate_completion(text), prompt.text
    out = {"completion": completion, "passed": None, "exec_status": None, "exec_detail": None}
    if execute:
        result = check_completion(header, completion, prompt.test, prompt.entry_point, timeout_s)
        out.update(passed=result.passed, exec_status=result.status, exec_detail=result.detail)
    return out
