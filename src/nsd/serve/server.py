"""Running the app under uvicorn: bind, listen while the model loads (``/health`` answers
503 ``loading``), then serve until a signal.

Shutdown on SIGINT/SIGTERM: the worker at once stops admitting requests and answers the
queued ones 503; the requests being decoded may run to completion within
``shutdown_timeout_s``; past that they are cancelled at their next block and answered like
any stopped request: a 503 error object, or in a stream an error event and
``data: [DONE]``. Streams thus end well-formed, never mid-body. Meanwhile the server keeps
listening: new requests and ``/health`` get 503 with ``Retry-After`` (what a load balancer
reads), not a refused connection. Only once the running requests have ended does uvicorn's
own shutdown begin (closing the socket); its grace (``BACKSTOP_S``) only cuts connections
a stuck generation never released. A second signal ends the wait at once (a second
SIGINT also skips uvicorn's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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

# uvicorn cancels whatever is still open this long after the shutdown timeout: enough for a
# cancelled generation to reach its next block and write its last event, even on a CPU.
BACKSTOP_S = 10


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
    """uvicorn's server, draining before it stops: on the first exit signal the worker
    stops admitting at once while the socket stays open (uvicorn alone would close it and
    then wait for the open connections); uvicorn's shutdown starts once the worker is idle."""

    def __init__(self, config: uvicorn.Config, worker: DecodeWorker, grace_s: float) -> None:
        super().__init__(config)
        self._worker, self._grace_s = worker, grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

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
        if self._loop is not None and not self._draining and not self.should_exit:
            self._draining = True
            self._loop.call_soon_threadsafe(self._begin_shutdown)
            return
        if self._draining and not self.should_exit:  # a second signal: stop waiting
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        super().handle_exit(sig, frame)

    def _begin_shutdown(self) -> None:
        self._worker.begin_shutdown()
        assert self._loop is not None
        self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        """Wait for the running requests (cancelled past the grace), then let uvicorn stop."""
        loop = asyncio.get_running_loop()

        async def idle_by(deadline: float) -> None:
            while self._worker.busy and not self.should_exit and loop.time() < deadline:
                await asyncio.sleep(0.05)

        await idle_by(loop.time() + self._grace_s)
        if self._worker.busy:
            # Cancelled rather than cut by uvicorn, the running requests get their error answer.
            self._worker.cancel_running("shutdown")
            await idle_by(loop.time() + BACKSTOP_S)
        self.should_exit = True


def run_server(config: ServerConfig, load_engine: Callable[[], Any], log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM. ``load_engine`` is called once, on a thread of its own
    after the server listens; what it raises ends the server and is raised here."""
    sock = bind_socket(config.host, config.port)
    host, port = sock.getsockname()[:2]
    server: _Server | None = None

    def loaded(error: BaseException | None) -> None:
        assert server is not None
        if error is not None:
            server.should_exit = True
            return
        # Printed once requests are served: scripts wait for this line and read the address.
        print(f"nsd serve: {config.model_name} at http://{host}:{port}", file=sys.stderr, flush=True)

    try:
        app = create_app(None, config, load_engine=load_engine, on_loaded=loaded)
        logging.getLogger("nsd.serve").setLevel(log_level.upper())
        # The grace for running requests is spent in _Server._drain, before uvicorn's
        # shutdown starts; uvicorn's own is the backstop.
        uv_config = uvicorn.Config(app, log_level=log_level, lifespan="on",
                                   timeout_graceful_shutdown=BACKSTOP_S)
        server = _Server(uv_config, app.state.worker, config.shutdown_timeout_s)
        print(f"nsd serve (loading {config.model_name}): listening at http://{host}:{port}, "
              "503 until the model is loaded", file=sys.stderr, flush=True)
        server.run(sockets=[sock])
    finally:
        sock.close()
    if app.state.model.error is not None:
        raise app.state.model.error
