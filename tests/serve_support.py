"""Helpers for the server tests: a mock engine (mock LM + letter tokenizer with a chat
template), a real uvicorn server on a free loopback port in a thread, and an SSE parser."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any, Iterator

import uvicorn

from mock import CachingLM
from nsd.api import Engine
from nsd.serve import ServerConfig, create_app
from nsd.serve.server import bind_socket


class MockTokenizer:
    """Characters to ids mod 16 and ids back to letters; a visible chat template."""

    chat_template = "mock"
    eos_token_id = None

    def encode(self, text: str, **_: Any) -> list[int]:
        return [ord(c) % 16 for c in text]

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(chr(97 + i) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class SlowLM(CachingLM):
    """A mock LM whose every forward takes ``delay`` seconds, like a real model would."""

    def __init__(self, delay: float = 0.0, n_ctx: int | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.delay = delay
        if n_ctx is not None:
            self.n_ctx = n_ctx

    def forward(self, tokens, all_logits: bool = True):
        if self.delay:
            time.sleep(self.delay)
        return super().forward(tokens, all_logits)

    def forward_many(self, items):
        # One delay for the whole batch, as a memory-bound step of a real model nearly costs.
        delay, self.delay = self.delay, 0.0
        try:
            time.sleep(delay)
            return super().forward_many(items)
        finally:
            self.delay = delay


def mock_engine(delay: float = 0.0, n_ctx: int | None = None) -> Engine:
    """An engine over the slow mock LM (n-gram proposer) and the letter tokenizer."""
    target = SlowLM(delay=delay, n_ctx=n_ctx, vocab_size=16, seed=2)
    return Engine.from_backends(target, MockTokenizer(), proposer="ngram", eos_token_ids=())


@contextlib.contextmanager
def running_server(engine: Engine | None, config: ServerConfig, startup_s: float = 10,
                   **app_options: Any) -> Iterator[tuple[str, Any]]:
    """Serve ``create_app(engine, config, **app_options)`` on 127.0.0.1 (free port); yield
    (base URL, app). ``startup_s``: how long the start (slots' cost measurement) may take."""
    app = create_app(engine, config, **app_options)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_s
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def sse_events(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded except the final ``[DONE]``."""
    blocks = [b for b in text.split("\n\n") if b.strip()]
    out = []
    for block in blocks:
        assert block.startswith("data: "), f"not an SSE data line: {block!r}"
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)
