"""Scheduling on a slow mock engine: the bounded queue (429 + Retry-After), per-request
timeouts, cancellation on client disconnect, many concurrent clients, SIGTERM shutdown."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from nsd.api import GenerationConfig
from nsd.serve import ServerConfig
from serve_support import MockTokenizer, mock_engine, running_server, sse_events, wait_until

DELAY = 0.02  # seconds per target forward of the slow mock
AR = GenerationConfig(method="ar", max_new_tokens=8)


def _post(url: str, prompt: str, max_tokens: int, stream: bool = False, seed: int = 0,
          timeout: float = 60) -> httpx.Response:
    body = {"model": "mock", "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
            "seed": seed, "temperature": 1.0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def _metric(url: str, line_start: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("parallel", [1, 2])
def test_full_queue_answers_429_with_retry_after(parallel: int) -> None:
    config = ServerConfig(model_name="mock", defaults=AR, queue_size=1, parallel=parallel)
    with running_server(mock_engine(delay=DELAY), config) as (url, app):
        with ThreadPoolExecutor(parallel + 1) as pool:
            running = [pool.submit(_post, url, f"ab{i}", 40) for i in range(parallel)]  # ~0.8 s each
            wait_until(lambda: app.state.worker.running == parallel)
            queued = pool.submit(_post, url, "abd", 5)
            wait_until(lambda: app.state.worker.depth == 1)
            refused = _post(url, "abe", 5)
            assert refused.status_code == 429
            assert int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["code"] == "queue_full"
            assert all(r.result().status_code == 200 for r in running)
            assert queued.result().status_code == 200
        assert _metric(url, 'nsd_rejections_total{reason="queue_full"}') == 1
        assert httpx.get(f"{url}/health").json()["queue_depth"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_request_timeout(stream: bool) -> None:
    config = ServerConfig(model_name="mock", defaults=AR, request_timeout_s=0.3)
    with running_server(mock_engine(delay=DELAY), config) as (url, app):
        r = _post(url, "abc", 500, stream=stream)
        if stream:
            events = sse_events(r.text)
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout"
        else:
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        wait_until(lambda: not app.state.worker.busy, timeout=2)  # cancelled at the next block
        assert _post(url, "abc", 3).status_code == 200
        assert _metric(url, 'nsd_cancellations_total{reason="timeout"}') == 1


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_cancels_generation(stream: bool) -> None:
    config = ServerConfig(model_name="mock", defaults=AR)
    with running_server(mock_engine(delay=DELAY), config) as (url, app):
        # 2000 tokens would take ~40 s; the next request must not wait for them.
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"model": "mock", "prompt": "abc", "max_tokens": 2000, "stream": stream})
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                          f"\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
            if stream:  # read until the first text chunk has arrived
                received = b""
                while received.count(b"data: ") < 2:
                    received += sock.recv(4096)
            wait_until(lambda: app.state.worker.busy)
            time.sleep(0.1)
        start = time.perf_counter()
        wait_until(lambda: not app.state.worker.busy, timeout=3)
        r = _post(url, "abd", 3)
        assert r.status_code == 200 and time.perf_counter() - start < 3
        assert _metric(url, 'nsd_cancellations_total{reason="disconnect"}') == 1


def test_sixteen_concurrent_clients_get_their_own_answers() -> None:
    clients, per_client = 16, 4
    config = ServerConfig(model_name="mock", defaults=AR, queue_size=8)
    prompts = [f"client{i:02d}" for i in range(clients)]
    with running_server(mock_engine(delay=0.002), config) as (url, app):
        # Sequential answers first: each client's prompt and seed fix its expected text.
        expected = {p: _post(url, p, 10, seed=i).json()["choices"][0]["text"]
                    for i, p in enumerate(prompts)}
        assert len(set(expected.values())) == clients

        def client(i: int) -> list[tuple[int, str | None]]:
            out = []
            for j in range(per_client):
                stream = j % 2 == 1
                r = _post(url, prompts[i], 10, stream=stream, seed=i)
                if r.status_code == 429:
                    out.append((429, None))
                    time.sleep(0.05)
                    continue
                assert r.status_code == 200, r.text
                if stream:
                    events = sse_events(r.text)
                    assert events[-1] == "[DONE]"
                    text = "".join(e["choices"][0]["text"] for e in events[:-1])
                else:
                    text = r.json()["choices"][0]["text"]
                out.append((200, text))
            return out

        with ThreadPoolExecutor(clients) as pool:
            results = list(pool.map(client, range(clients)))
        answered = 0
        for i, outcomes in enumerate(results):
            assert len(outcomes) == per_client  # none lost
            for status, text in outcomes:
                if status == 200:
                    assert text == expected[prompts[i]]  # not mixed with another's tokens
                    answered += 1
        assert answered >= clients  # the queue admits a good share
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "model": "mock", "busy": False,
                                                     "running": 0, "parallel": 4, "queue_depth": 0}
        # The answers above were decoded side by side: forwards carried several requests.
        assert app.state.worker.batcher.stats.largest > 1
        assert _metric(url, "nsd_batch_sequences_total") > _metric(url, "nsd_batch_forwards_total") > 0
        assert _metric(url, "nsd_requests_in_progress") == 0


SERVER_SCRIPT = """
import sys
from nsd.api import GenerationConfig
from nsd.serve import ServerConfig, run_server
from serve_support import mock_engine
config = ServerConfig(model_name="mock", port=0, defaults=GenerationConfig(method="ar"),
                      shutdown_timeout_s=10, parallel=1)
run_server(config, lambda: mock_engine(delay=0.02), log_level="warning")
"""


def test_sigterm_finishes_running_request_and_refuses_queued() -> None:
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent / "src"), str(tests)])}
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT], env=env, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert "listening at http://" in proc.stderr.readline()  # while the model loads
        line = proc.stderr.readline()
        assert "nsd serve: mock at http://" in line, line
        url = line.split(" at ", 1)[1].strip()
        results: dict[str, httpx.Response] = {}
        running = threading.Thread(target=lambda: results.update(a=_post(url, "abc", 60, stream=True)))
        running.start()
        wait_until(lambda: httpx.get(f"{url}/health").json()["busy"])
        queued = threading.Thread(target=lambda: results.update(b=_post(url, "abd", 5)))
        queued.start()
        wait_until(lambda: httpx.get(f"{url}/health").json()["queue_depth"] == 1)
        proc.send_signal(signal.SIGTERM)
        running.join(30)
        queued.join(30)
        assert proc.wait(30) == 0
        events = sse_events(results["a"].text)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert "".join(e["choices"][0]["text"] for e in events[:-1]).__len__() == 60  # complete
        assert results["b"].status_code == 503
        assert results["b"].json()["error"]["code"] == "shutting_down"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def _start_server_process() -> tuple[subprocess.Popen, str]:
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent / "src"), str(tests)])}
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT], env=env, stderr=subprocess.PIPE,
                            text=True)
    assert "listening at http://" in proc.stderr.readline()  # while the model loads
    line = proc.stderr.readline()
    assert "nsd serve: mock at http://" in line, line
    return proc, line.split(" at ", 1)[1].strip()


def test_during_the_shutdown_grace_the_server_listens_and_answers_503_retry_after() -> None:
    """Between SIGTERM and exit new requests and /health get 503 with Retry-After (what a
    load balancer reads), not a refused connection; the running stream completes."""
    proc, url = _start_server_process()
    try:
        results: dict[str, httpx.Response] = {}
        running = threading.Thread(target=lambda: results.update(a=_post(url, "abc", 150, stream=True)))
        running.start()  # ~3 s of tokens
        wait_until(lambda: httpx.get(f"{url}/health").json()["busy"])
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 503)
        health = httpx.get(f"{url}/health")
        assert health.json()["status"] == "shutting_down" and int(health.headers["retry-after"]) >= 1
        for r in (_post(url, "abd", 5), _post(url, "abd", 5, stream=True),
                  httpx.get(f"{url}/v1/models")):
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "shutting_down" and int(r.headers["retry-after"]) >= 1
        assert running.is_alive()  # all that while the stream was still running
        running.join(30)
        assert proc.wait(30) == 0
        events = sse_events(results["a"].text)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        with pytest.raises(httpx.ConnectError):  # gone once it has exited
            httpx.get(f"{url}/health")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_follow_up_sent_as_the_client_drops_its_stream_reuses_its_prompt() -> None:
    """A chat UI's "stop" and an immediate retry: stream a turn, read its first content
    chunk, close the connection, and at once send the next turn (the same user message, the
    assistant's answer, a new user message). The dropped stream's slot is busy until its
    next block notices the cancellation; the follow-up waits for it rather than prefilling
    the whole conversation in an empty slot. The cancelled turn's TTFT and prefix-cache
    outcome (a miss) are in /metrics beside the follow-up's (a hit)."""
    config = ServerConfig(model_name="mock", defaults=GenerationConfig(method="ar"), parallel=4)
    code = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(60))  # ~1,500 tokens
    first = [{"role": "user", "content": code}]
    follow_up = first + [{"role": "assistant", "content": "Sure."},
                         {"role": "user", "content": "Shorter please."}]
    first_tokens = len(MockTokenizer().apply_chat_template(first))
    engine = mock_engine(delay=0.002)
    with running_server(engine, config) as (url, app), httpx.Client(timeout=60) as retry:
        engine.target.delay = 0.5  # now that the slots' costs are measured: a real model's pace
        body = {"model": "mock", "messages": first, "max_tokens": 8, "temperature": 0.0,
                "stream": True}
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and \
                            json.loads(line[6:])["choices"][0]["delta"].get("content"):
                        break  # the first content chunk: stop reading
        # The connection is closed; the follow-up goes out at once (its client is ready).
        r = retry.post(f"{url}/v1/chat/completions",
                       json={"model": "mock", "messages": follow_up, "max_tokens": 4,
                             "temperature": 0.0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= first_tokens - 1
        wait_until(lambda: not app.state.worker.busy)
        assert _metric(url, 'nsd_cancellations_total{reason="disconnect"}') == 1
        assert _metric(url, "nsd_time_to_first_token_seconds_count") == 2
        assert _metric(url, "nsd_prefix_cache_misses_total") == 1  # the cancelled first turn
        assert _metric(url, "nsd_prefix_cache_hits_total") == 1  # the follow-up
