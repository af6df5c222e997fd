"""The server's answers to hostile or unusual requests: inputs that used to crash it (a huge
seed, a lone surrogate, deep nesting), an unexpected exception, tool calling, loading and
shutdown. Each error is an OpenAI error object, and the client's keep-alive connection
survives it; this is checked on a raw HTTP/1.1 connection, since httpx would silently
reconnect after a dropped one."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest

from nsd.api import Engine, GenerationConfig
from nsd.errors import NSDError
from nsd.serve import ServerConfig, run_server
from nsd.serve.server import bind_socket
from serve_support import MockTokenizer, SlowLM, mock_engine, running_server, sse_events, wait_until

DEFAULTS = GenerationConfig(method="nsd", max_new_tokens=8, k=3)
GOOD = {"model": "mock", "prompt": "abcabc", "max_tokens": 4}


class Utf8Tokenizer(MockTokenizer):
    """Encodes through UTF-8 as real tokenizers do (so a lone surrogate raises), and fails
    outright on the word "boom", standing in for any bug below the app."""

    def encode(self, text: str, **kw: Any) -> list[int]:
        if "boom" in text:
            raise RuntimeError("tokenizer exploded: secret internals")
        return super().encode(text.encode("utf-8").decode("utf-8"), **kw)


class RawConnection:
    """One HTTP/1.1 keep-alive connection, spoken with h11: a request after a response that
    dropped the connection, or announced it would, fails instead of reconnecting."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.conn = h11.Connection(our_role=h11.CLIENT)

    def request(self, path: str, body: bytes | dict) -> tuple[int, dict[str, str], bytes]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = [("Host", "test"), ("Content-Type", "application/json"),
                   ("Content-Length", str(len(raw)))]
        for event in (h11.Request(method="POST", target=path, headers=headers), h11.Data(data=raw),
                      h11.EndOfMessage()):
            self.sock.sendall(self.conn.send(event))
        status, response_headers, content = 0, {}, b""
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(self.sock.recv(1 << 16))
            elif isinstance(event, h11.Response):
                status = event.status_code
                response_headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                content += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                raise AssertionError(f"connection ended before the response did: {event!r}")
        # Raises if either side said the connection is over (e.g. "Connection: close").
        self.conn.start_next_cycle()
        return status, response_headers, content

    def close(self) -> None:
        self.sock.close()


def _utf8_engine() -> Engine:
    target = SlowLM(n_ctx=128, vocab_size=16, seed=2)
    return Engine.from_backends(target, Utf8Tokenizer(), proposer="ngram", eos_token_ids=())


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(model_name="mock", defaults=DEFAULTS)
    with running_server(_utf8_engine(), config) as (url, app):
        yield url, app


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _assert_error_object(content: bytes, type_: str) -> dict[str, Any]:
    assert b"Traceback" not in content
    error = json.loads(content)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == type_
    return error


NESTED = b'{"model": "mock", "prompt": "ab", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
SURROGATE = (b'{"model": "mock", "max_tokens": 4, '
             b'"messages": [{"role": "user", "content": "a\\ud800b"}]}')


@pytest.mark.parametrize("path, body, param, code, says", [
    ("/v1/completions", {**GOOD, "seed": 2**70}, "seed", "invalid_value", "2^63"),
    ("/v1/completions", {**GOOD, "seed": -(2**63) - 1}, "seed", "invalid_value", "2^63"),
    ("/v1/chat/completions", SURROGATE, "messages[0].content", "invalid_value", "surrogate"),
    ("/v1/completions", NESTED, None, "invalid_json", "deeply"),
], ids=["huge-seed", "negative-seed", "lone-surrogate", "deep-nesting"])
def test_crashing_inputs_are_400_and_keep_the_connection(server, path, body, param, code,
                                                         says) -> None:
    url, _ = server
    conn = RawConnection(url)
    try:
        status, headers, content = conn.request(path, body)
        assert status == 400, content
        error = _assert_error_object(content, "invalid_request_error")
        assert error["param"] == param and error["code"] == code and says in error["message"]
        assert headers.get("connection") != "close"
        status, _, content = conn.request("/v1/completions", GOOD)  # same connection
        assert status == 200 and json.loads(content)["usage"]["completion_tokens"] == 4
    finally:
        conn.close()


def test_seeds_at_the_ends_of_the_range_are_accepted(server) -> None:
    url, _ = server
    for seed in (-(2**63), 2**63 - 1):
        r = httpx.post(f"{url}/v1/completions", json={**GOOD, "seed": seed})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_unexpected_exception_is_a_500_object_and_keeps_the_connection(server, stream) -> None:
    url, _ = server
    conn = RawConnection(url)
    try:
        status, headers, content = conn.request("/v1/completions",
                                                {**GOOD, "prompt": "boom", "stream": stream})
        assert status == 500
        error = _assert_error_object(content, "server_error")
        assert error["message"] == "internal server error" and b"secret" not in content
        assert headers.get("connection") != "close"
        status, _, _ = conn.request("/v1/completions", GOOD)
        assert status == 200
    finally:
        conn.close()


def test_a_500_is_counted_as_500_and_a_disconnect_as_499() -> None:
    config = ServerConfig(model_name="mock", defaults=DEFAULTS)
    with running_server(_utf8_engine(), config) as (url, _):
        r = httpx.post(f"{url}/v1/completions", json={**GOOD, "prompt": "boom"})
        assert r.status_code == 500
        counted = 'nsd_requests_total{endpoint="/v1/completions",status='
        assert _metric(url, counted + '"500"}') == 1
        assert _metric(url, counted + '"499"}') == 0
    slow = ServerConfig(model_name="mock", defaults=GenerationConfig(method="ar"))
    with running_server(mock_engine(delay=0.02), slow) as (url, app):
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"model": "mock", "prompt": "abc", "max_tokens": 2000})
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                          f"{len(body)}\r\n\r\n{body}").encode())
            wait_until(lambda: app.state.worker.busy)
        wait_until(lambda: _metric(url, counted + '"499"}') == 1)
        assert _metric(url, counted + '"500"}') == 0


# ----------------------------------------------------------------------------- tool calling

def _chat(url: str, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions",
                      json={"model": "mock", "messages": messages, "max_tokens": 4, **extra})


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("messages, extra, param, says", [
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
      {"role": "tool", "content": "42", "tool_call_id": "call_1"}], {}, "messages[2].role",
     "role 'tool' is not supported"),
    ([{"role": "function", "name": "f", "content": "42"}], {}, "messages[0].role",
     "role 'function' is not supported"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                          "tool_calls": [CALL]}], {}, "messages[1].tool_calls",
     "tool calls are not supported"),
    ([{"role": "user", "content": "hi"}], {"tools": [TOOL]}, "tools", "tools are not supported"),
    ([{"role": "user", "content": None}], {}, "messages[0].content", "required"),
], ids=["tool-role", "function-role", "tool-calls", "tools", "user-null"])
def test_tool_calling_is_refused_by_name(server, messages, extra, param, says) -> None:
    url, _ = server
    r = _chat(url, messages, **extra)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"]
    assert "must be a string" not in error["message"]
    if "tool" in says:
        assert "does not implement tool calling" in error["message"]


def test_assistant_content_null_without_tool_calls_is_an_empty_turn(server) -> None:
    url, _ = server
    for assistant in ({"role": "assistant", "content": None}, {"role": "assistant"}):
        r = _chat(url, [{"role": "user", "content": "hi"}, assistant,
                        {"role": "user", "content": "again"}], tools=[])
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"


# ----------------------------------------------------------------------------- loading

def test_serves_503_while_the_model_loads() -> None:
    gate = threading.Event()

    def load() -> Engine:
        assert gate.wait(30), "the test never released the load"
        return mock_engine()

    config = ServerConfig(model_name="mock", defaults=DEFAULTS)
    with running_server(None, config, load_engine=load) as (url, _):
        with httpx.Client(base_url=url, timeout=10) as client:
            r = client.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "loading"
            for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                 ("GET", "/v1/models")):
                r = client.request(method, path, json={**GOOD} if method == "POST" else None)
                assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
                error = _assert_error_object(r.content, "server_error")
                assert error["code"] == "model_loading"
            assert client.get("/metrics").status_code == 200  # scrapes go on meanwhile
            gate.set()
            wait_until(lambda: client.get("/health").status_code == 200)
            assert client.get("/health").json()["status"] == "ok"
            assert client.post("/v1/completions", json=GOOD).status_code == 200


def test_run_server_listens_while_loading_and_raises_a_failed_load() -> None:
    with bind_socket("127.0.0.1", 0) as probe:
        port = probe.getsockname()[1]
    seen: list[httpx.Response] = []

    def load() -> Engine:
        # Runs while the server is up: a client must get an answer, not a refusal.
        deadline = time.monotonic() + 10
        while not seen:
            try:
                seen.append(httpx.get(f"http://127.0.0.1:{port}/health", timeout=5))
            except httpx.ConnectError:
                assert time.monotonic() < deadline, "connections refused during the load"
                time.sleep(0.05)
        raise NSDError("the model file is broken")

    with pytest.raises(NSDError, match="broken"):
        run_server(ServerConfig(model_name="mock", port=port), load, log_level="warning")
    assert seen[0].status_code == 503 and seen[0].json()["status"] == "loading"


# ----------------------------------------------------------------------------- shutdown

SHUTDOWN_SCRIPT = """
from nsd.api import GenerationConfig
from nsd.serve import ServerConfig, run_server
from serve_support import mock_engine
config = ServerConfig(model_name="mock", port=0, defaults=GenerationConfig(method="ar"),
                      shutdown_timeout_s=2)
run_server(config, lambda: mock_engine(delay=0.02), log_level="warning")
"""


def test_sigterm_past_the_shutdown_timeout_ends_streams_with_an_error_and_done() -> None:
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent / "src"), str(tests)])}
    proc = subprocess.Popen([sys.executable, "-c", SHUTDOWN_SCRIPT], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert "listening at http://" in proc.stderr.readline()
        line = proc.stderr.readline()  # printed once the model is loaded
        assert "nsd serve: mock at http://" in line, line
        url = line.split(" at ", 1)[1].strip()
        assert httpx.get(f"{url}/health").status_code == 200
        body = {"model": "mock", "prompt": "abc", "max_tokens": 2000, "stream": True}  # ~40 s
        received: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            received.append(next(lines))  # the first chunk: decoding is under way
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            received.extend(lines)
        ended = time.monotonic() - signalled
        assert proc.wait(30) == 0
        events = sse_events("\n\n".join(line for line in received if line))
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "shutting_down"
        assert all("choices" in e for e in events[:-2])
        assert 1.5 < ended < 8  # the timeout, not the 40 s the request would take
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
