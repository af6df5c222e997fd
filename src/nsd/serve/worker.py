"""One decode thread per engine, fed by a bounded FIFO queue.

The engine is single-sequence (one KV cache, batch size 1), so requests are decoded one at
a time, in arrival order, on a dedicated thread; the event loop only waits on events the
thread hands over with ``loop.call_soon_threadsafe`` and is never blocked by decoding.

Cancellation is cooperative: :meth:`Job.cancel` sets a flag that the thread checks before
pulling each chunk out of :meth:`Engine.stream`, i.e. once per decoding block. A job still
waiting in the queue is withdrawn at once, freeing its place.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from nsd.api import GenerationConfig, GenerationResult
from nsd.errors import NSDError

log = logging.getLogger("nsd.serve")


class StreamingEngine(Protocol):
    """What the worker needs of :class:`nsd.api.Engine`."""

    def stream(self, prompt_ids: Sequence[int], config: GenerationConfig) -> Any: ...


class QueueFull(Exception):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"the queue is full; retry in {retry_after_s}s")
        self.retry_after_s = retry_after_s


class ShuttingDown(Exception):
    pass


@dataclass(eq=False)
class Job:
    """One request's generation. Events go to ``events`` as ``(kind, payload)``:
    ``start`` (left the queue), ``chunk`` (text), ``done`` (:class:`GenerationResult`),
    ``error`` (exception), ``cancelled`` (reason)."""

    prompt_ids: list[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel_reason: str | None = None
    _cancel: threading.Event = field(default_factory=threading.Event)

    def cancel(self, reason: str) -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def emit(self, kind: str, payload: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class DecodeWorker:
    """Runs jobs one at a time on its own thread; at most ``capacity`` wait behind it."""

    def __init__(self, engine: StreamingEngine | None, capacity: int) -> None:
        self._engine = engine
        self._capacity = capacity
        self._pending: deque[Job] = deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._closing = False
        self._mean_job_s = 1.0  # running mean of job time, for Retry-After
        self._thread = threading.Thread(target=self._run, name="nsd-decode", daemon=True)

    # ------------------------------------------------------------------ loop-side API
    def start(self, engine: StreamingEngine | None = None) -> None:
        """Start decoding; ``engine`` is given here when it was loaded after construction."""
        if engine is not None:
            self._engine = engine
        if self._engine is None:
            raise RuntimeError("the worker has no engine to run")
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting (not counting the one being decoded)."""
        return len(self._pending)

    @property
    def busy(self) -> bool:
        return self._running is not None

    @property
    def closing(self) -> bool:
        return self._closing

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closing:
                raise ShuttingDown()
            if len(self._pending) >= self._capacity:
                # The wait ahead is about one mean job per queued request plus the running one.
                wait = (len(self._pending) + 1) * self._mean_job_s
                raise QueueFull(max(1, math.ceil(wait)))
            self._pending.append(job)
            self._cond.notify()

    def withdraw(self, job: Job) -> bool:
        """Remove a job that has not started; False if it already started or finished."""
        with self._cond:
            try:
                self._pending.remove(job)
                return True
            except ValueError:
                return False

    def begin_shutdown(self) -> None:
        """Refuse new jobs and cancel the waiting ones; the running one goes on."""
        with self._cond:
            self._closing = True
            dropped = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        for job in dropped:
            job.cancel("shutdown")
            job.emit("cancelled", "shutdown")

    def cancel_running(self, reason: str) -> None:
        """Cancel the job being decoded (at its next block), if any."""
        running = self._running
        if running is not None:
            running.cancel(reason)

    def stop(self, timeout_s: float) -> None:
        """Shut down, cancel the running job at its next block, and join the thread."""
        self.begin_shutdown()
        self.cancel_running("shutdown")
        if self._thread.ident is not None:  # never started when the model did not load
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ thread side
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                job = self._running = self._pending.popleft()
            started = time.perf_counter()
            try:
                self._execute(job)
            finally:
                self._running = None
            self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * (time.perf_counter() - started)

    def _execute(self, job: Job) -> None:
        if job.cancelled:
            job.emit("cancelled", job.cancel_reason)
            return
        job.emit("start")
        assert self._engine is not None  # start() saw to it
        try:
            stream = self._engine.stream(job.prompt_ids, job.config)
            while True:
                if job.cancelled:
                    stream.close()  # frees the decode generator; the next job resets the cache
                    job.emit("cancelled", job.cancel_reason)
                    return
                try:
                    chunk = next(stream)
                except StopIteration as done:
                    result: GenerationResult = done.value
                    job.emit("done", result)
                    return
                job.emit("chunk", chunk)
        except NSDError as exc:  # a problem with this request (e.g. context exceeded)
            job.emit("error", exc)
        except Exception as exc:  # keep the worker alive whatever one request does
            log.exception("generation failed")
            job.emit("error", exc)
