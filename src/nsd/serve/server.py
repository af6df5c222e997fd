"""Running the app under uvicorn: bind first, then load the model, then serve until a signal.

Shutdown on SIGINT/SIGTERM: the worker at once stops admitting requests and answers the
queued ones 503; the request being decoded runs to completion while uvicorn waits up to
``shutdown_timeout_s`` for open connections; past that uvicorn cancels the remaining
response tasks, which cancels the running generation at its next block. Streams always end
with an error event or ``data: [DONE]``, never mid-object. A second SIGINT forces exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterator

import uvicorn

from nsd.errors import NSDError
from nsd.serve.app import create_app
from nsd.serve.config import ServerConfig
from nsd.serve.worker import DecodeWorker


def default_model_name(target: str) -> str:
    """The id clients put in ``model``: a registry name as given, else the file or folder name."""
    path = Path(target)
    return path.stem if path.suffix == ".gguf" else (path.name or target)


def bind_socket(host: str, port: int) -> socket.socket:
    """Listen before the (slow) model load, so a taken port fails in a second, not a minute."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise NSDError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, telling the worker about the first exit signal right away (uvicorn
    alone would only stop the app after every open connection has finished)."""

    def __init__(self, config: uvicorn.Config, worker: DecodeWorker) -> None:
        super().__init__(config)
        self._worker = worker
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the signal after its graceful shutdown, so the process would die
        # of it; a clean shutdown is a normal end here, and `nsd serve` then exits 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler: hand the work to the loop instead of taking locks here.
        if self._loop is not None and not self.should_exit:
            self._loop.call_soon_threadsafe(self._worker.begin_shutdown)
        super().handle_exit(sig, frame)


def run_server(config: ServerConfig, load_engine: Callable[[], Any], log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM. ``load_engine`` is called once, after the port is bound."""
    sock = bind_socket(config.host, config.port)
    try:
        engine = load_engine()
        app = create_app(engine, config)
        logging.getLogger("nsd.serve").setLevel(log_level.upper())
        uv_config = uvicorn.Config(app, log_level=log_level, lifespan="on",
                                   timeout_graceful_shutdown=math.ceil(config.shutdown_timeout_s))
        server = _Server(uv_config, app.state.worker)
        host, port = sock.getsockname()[:2]
        print(f"nsd serve: {config.model_name} at http://{host}:{port}", file=sys.stderr, flush=True)
        server.run(sockets=[sock])
    finally:
        sock.close()
