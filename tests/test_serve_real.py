"""A real ``nsd serve`` process on the small SmolLM2 model (n-gram proposer, no draft),
driven by the official ``openai`` client and by many concurrent plain HTTP clients."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from nsd.models.loader import llama_available
from serve_support import sse_events, wait_until

MODEL = "smollm2-135m-instruct"
SRC = str(Path(__file__).resolve().parent.parent / "src")
# One thread: on a busy machine llama.cpp's spinning worker threads slow it down many-fold.
# The file as given (no measured choice of weight format, which could differ between the
# server and the `nsd generate` it is compared with).
COMMON = ["--target", MODEL, "--proposer", "ngram", "--n-ctx", "2048", "--threads", "1",
          "--weights", "original"]

pytestmark = [
    pytest.mark.serve_real,
    pytest.mark.skipif(os.environ.get("NSD_SKIP_REAL_MODELS") == "1", reason="NSD_SKIP_REAL_MODELS=1"),
]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def server():
    if not llama_available():
        pytest.skip("llama-cpp-python is not installed (run scripts/install.sh); the server tests "
                    "run the GGUF model on llama.cpp")
    from nsd.models.registry import fetch_gguf

    fetch_gguf(MODEL)  # a no-op once cached
    proc = subprocess.Popen([sys.executable, "-m", "nsd.cli", "serve", *COMMON, "--port", "0",
                             "--queue-size", "8", "--max-new-tokens", "32", "-k", "4",
                             "--log-level", "warning"],
                            env=_env(), stderr=subprocess.PIPE, text=True)
    url = None
    deadline = time.monotonic() + 300
    while url is None and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            pytest.fail(f"nsd serve exited with status {proc.returncode}")
        if line.startswith("nsd serve: "):
            url = line.split(" at ", 1)[1].strip()
    assert url is not None, "nsd serve did not start"
    # Keep draining stderr so the server never blocks on a full pipe.
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, timeout=60)
    yield url
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(60) == 0  # a clean shutdown
    finally:
        if proc.poll() is None:
            proc.kill()


def _client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="not-needed", max_retries=0, timeout=300)


def _nsd(usage) -> dict:
    return usage.model_extra["nsd"]


SAMPLING = {"max_tokens": 24, "temperature": 0.7, "seed": 5,
            "extra_body": {"nsd": {"method": "nsd", "theta": 0.9, "k": 4}}}
PROMPT = "Write one sentence about the sea."  # an instruction: for the chat endpoint
# A plain completion needs text to continue: SmolLM2 may end an instruction given without
# its chat template at once (seed 5 does), which would leave nothing to compare.
COMPLETION_PROMPT = "The sea is"


def test_openai_client_completion_streamed_equals_whole(server: str) -> None:
    client = _client(server)
    whole = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, **SAMPLING)
    text = whole.choices[0].text
    assert text and whole.usage.completion_tokens == _nsd(whole.usage)["new_tokens"] > 0
    streamed, usage = "", None
    for chunk in client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, stream=True,
                                           stream_options={"include_usage": True}, **SAMPLING):
        if chunk.choices:
            streamed += chunk.choices[0].text
        if chunk.usage is not None:
            usage = chunk.usage
    assert streamed == text
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert _nsd(usage)["accepted_per_pass"] == _nsd(whole.usage)["accepted_per_pass"]


def test_openai_client_chat_streamed_equals_whole(server: str) -> None:
    client = _client(server)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, **SAMPLING)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason in ("stop", "length")
    stats = _nsd(whole.usage)
    assert stats["method"] == "nsd" and stats["tau"] >= 1.0 and "deviation_per_token" in stats
    parts, usage = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **SAMPLING):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(parts) == text
    assert usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("chat", [False, True])
def test_same_tokens_as_nsd_generate(server: str, chat: bool) -> None:
    proc = subprocess.run([sys.executable, "-m", "nsd.cli", "generate", *COMMON, "--method", "nsd",
                           "--theta", "0.9", "-k", "4", "--temperature", "0.7", "--seed", "5",
                           "--max-new-tokens", "24", "--json", "--prompt",
                           PROMPT if chat else COMPLETION_PROMPT]
                          + (["--chat"] if chat else []),
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    expected = json.loads(proc.stdout.strip().splitlines()[-1])
    client = _client(server)
    if chat:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                           **SAMPLING)
        text = r.choices[0].message.content
    else:
        r = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, **SAMPLING)
        text = r.choices[0].text
    stats = _nsd(r.usage)
    assert text == expected["text"]
    for key in ("prompt_tokens", "new_tokens", "target_passes", "accepted_tokens", "relaxed_accepts",
                "accepted_per_pass", "stop_reason"):
        assert stats[key] == expected["stats"][key], key
    assert stats["deviation"] == pytest.approx(expected["stats"]["deviation"])
    assert r.usage.prompt_tokens == expected["stats"]["prompt_tokens"]


def _ask(url: str, i: int, stream: bool) -> tuple[int, str | None]:
    n = 10 * i + 3  # each client's prompt has its own continuation
    body = {"model": MODEL, "prompt": f"Continue the sequence: {n}, {n + 1}, {n + 2},",
            "max_tokens": 8, "temperature": 0.0, "stream": stream}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    if r.status_code == 429:
        return 429, None
    assert r.status_code == 200, r.text
    if not stream:
        return 200, r.json()["choices"][0]["text"]
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] is not None
    return 200, "".join(e["choices"][0]["text"] for e in events[:-1])


def test_sixteen_concurrent_clients(server: str) -> None:
    clients, per_client = 16, 3
    expected = {i: _ask(server, i, False)[1] for i in range(clients)}  # sequential answers
    assert len(set(expected.values())) == clients

    def client(i: int) -> list[tuple[int, str | None]]:
        return [_ask(server, i, stream=j % 2 == 0) for j in range(per_client)]

    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(client, range(clients)))
    ok = 0
    for i, outcomes in enumerate(results):
        assert len(outcomes) == per_client
        for status, text in outcomes:
            assert status in (200, 429)
            if status == 200:
                assert text == expected[i]  # its own tokens, nobody else's
                ok += 1
    assert ok >= 9  # the running request plus a full queue of 8, at least
    health = httpx.get(f"{server}/health").json()
    assert health == {"status": "ok", "model": MODEL, "busy": False, "running": 0,
                      "parallel": 4, "queue_depth": 0}


def test_disconnect_mid_stream_frees_the_worker(server: str) -> None:
    body = {"model": MODEL, "prompt": "Continue the sequence: 1, 2, 3,", "max_tokens": 1500,
            "stream": True, "nsd": {"method": "ar"}}
    with httpx.Client(timeout=300) as client:
        with client.stream("POST", f"{server}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        # The stream is closed; the 1500-token generation (many seconds) must stop at once.
    start = time.perf_counter()
    wait_until(lambda: not httpx.get(f"{server}/health").json()["busy"], timeout=10)
    r = httpx.post(f"{server}/v1/completions", timeout=300,
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 200 and time.perf_counter() - start < 20
    metrics = httpx.get(f"{server}/metrics").text
    cancelled = [line for line in metrics.splitlines()
                 if line.startswith('nsd_cancellations_total{reason="disconnect"}')]
    assert cancelled and float(cancelled[0].split()[-1]) >= 1
    assert "nsd_tau_bucket" in metrics and "nsd_time_to_first_token_seconds_count" in metrics
