"""The event-loop side of one admitted request: the events its decode thread hands back,
its deadline and metrics, and their relay to the client as one body or as server-sent
events."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from starlette.requests import Request

from nsd.api import GenerationResult
from nsd.errors import NSDError
from nsd.serve.metrics import ServeMetrics
from nsd.serve.middleware import shutting_down_error
from nsd.serve.protocol import ApiError, ResponseBuilder, finish_reason, sse
from nsd.serve.worker import DecodeWorker, Job

log = logging.getLogger("nsd.serve")


class Run:
    """The loop-side view of one admitted job: its deadline, timings and bookkeeping."""

    def __init__(self, job: Job, worker: DecodeWorker, metrics: ServeMetrics, arrived: float,
                 deadline: float) -> None:
        self.job, self.worker, self.metrics = job, worker, metrics
        self.arrived, self.deadline = arrived, deadline
        self.started: float | None = None
        self.first_text: float | None = None
        self.closed = False
        metrics.in_progress.inc()

    async def next_event(self) -> tuple[str, Any]:
        """The worker's next event; raises :class:`ApiError` (504) past the deadline."""
        remaining = self.deadline - time.perf_counter()
        try:
            if remaining <= 0:
                raise asyncio.TimeoutError
            kind, payload = await asyncio.wait_for(self.job.events.get(), remaining)
        except asyncio.TimeoutError:
            self.abandon("timeout")
            raise ApiError(504, "the request timed out", code="timeout", type_="server_error") from None
        now = time.perf_counter()
        if kind == "start":
            self.started = now
        elif kind == "chunk" and self.first_text is None:
            self.first_text = now
        elif kind == "done":
            self._finish(payload, now)
        elif kind == "error":
            self._close()
            if isinstance(payload, NSDError):
                raise ApiError(400, str(payload), code="invalid_value")
            self.metrics.errors.inc()
            raise ApiError(500, "generation failed", type_="server_error")
        elif kind == "cancelled":
            self._cancelled(payload or "unknown")
            raise shutting_down_error()
        return kind, payload

    async def result(self) -> GenerationResult:
        while True:
            kind, payload = await self.next_event()
            if kind == "done":
                return payload

    def abandon(self, reason: str) -> None:
        """Stop the job (at its next block, or now if it has not started)."""
        if self.closed:
            return
        self.job.cancel(reason)
        self.worker.withdraw(self.job)
        self._cancelled(reason)

    def _cancelled(self, reason: str) -> None:
        self.metrics.cancellations.labels(reason).inc()
        if self.first_text is not None:  # its first token came: a TTFT like any other
            self.metrics.ttft.observe(self.first_text - self.arrived)
        self._close()

    def _finish(self, result: GenerationResult, now: float) -> None:
        started = self.started if self.started is not None else now
        ttft = None if self.first_text is None else self.first_text - self.arrived
        self.metrics.observe(result, self.job.config.method, ttft, started - self.arrived,
                             now - self.arrived)
        self._close()

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            self.metrics.in_progress.dec()


async def stream_events(run: Run, builder: ResponseBuilder, include_usage: bool) -> AsyncIterator[bytes]:
    try:
        if builder.chat:
            yield sse(builder.chunk(role=True))
        while True:
            try:
                kind, payload = await run.next_event()
            except ApiError as exc:  # headers are gone: report in-band, then end the stream
                yield sse(exc.body())
                break
            except Exception:  # the same for a bug, so the stream still ends well-formed
                log.exception("unexpected error in a stream")
                yield sse(ApiError(500, "internal server error", type_="server_error").body())
                break
            if kind == "chunk":
                yield sse(builder.chunk(text=payload))
            elif kind == "done":
                yield sse(builder.chunk(finish=finish_reason(payload)))
                if include_usage:
                    yield sse(builder.chunk(usage_body=builder.usage(payload)))
                break
        yield sse("[DONE]")
    finally:
        # Reached with the run still open only when the client went away mid-stream
        # (the response task is cancelled); stop its generation.
        run.abandon("disconnect")


async def client_gone(request: Request) -> None:
    """Return when the client disconnects (the body has been read, so only that is left)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
