"""Decode threads, one per sequence slot, fed by a bounded FIFO queue.

With ``parallel`` = 1 requests are decoded one at a time, in arrival order, on a dedicated
thread. With ``parallel`` = n the engine is split into n slots (:meth:`Engine.batched`):
each has its own sequence in the models' caches and its own thread, and the slots'
forwards run together (:class:`nsd.backends.sequences.StepBatcher`), so up to n requests
are decoded at once, each with its own settings, random stream, rule, budget and
statistics. A waiting request goes to the free slot whose cache shares the longest prefix
with its prompt (the slot that served the conversation's last turn); if a slot whose
request was just cancelled holds a longer one, it waits the one block until that slot is
released (a chat UI's "stop" followed at once by the next turn). The event loop only
waits on events the threads hand over with ``loop.call_soon_threadsafe`` and is never
blocked by decoding: what each free slot's cache holds is noted by its thread when it
ends a job, so choosing a slot reads no cache (which would wait for the running batch).

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
from nsd.backends.base import cached_tokens, common_prefix_length
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
    """Runs up to ``parallel`` jobs at once on threads of its own; at most ``capacity``
    wait behind them."""

    def __init__(self, engine: StreamingEngine | None, capacity: int, parallel: int = 1,
                 prefill_chunk: int = 0) -> None:
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        self._engine = engine
        self._capacity = capacity
        self.parallel = parallel
        self.prefill_chunk = prefill_chunk
        self._pending: deque[Job] = deque()
        self._cond = threading.Condition()
        self._slots: list[Any] = []  # one engine per slot
        # The token ids each slot's target cache holds, noted by its thread after each job
        # (valid while the slot is free: nothing else touches its sequence meanwhile).
        self._held: list[list[int]] = []
        # Each slot's job, from leaving the queue (_assign) to its end: the running jobs.
        self._assigned: list[Job | None] = []
        self.batcher: Any = None  # the slots' StepBatcher (parallel > 1)
        self._closing = False
        self._mean_job_s = 1.0  # running mean of job time, for Retry-After
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ loop-side API
    def start(self, engine: StreamingEngine | None = None) -> None:
        """Start decoding; ``engine`` is given here when it was loaded after construction."""
        if engine is not None:
            self._engine = engine
        if self._engine is None:
            raise RuntimeError("the worker has no engine to run")
        if self.parallel > 1 and hasattr(self._engine, "batched"):
            self._slots, self.batcher = self._engine.batched(self.parallel, self.prefill_chunk)
        else:
            self._slots = [self._engine]
        self._assigned = [None] * len(self._slots)
        self._held = [self._cached(i) for i in range(len(self._slots))]
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"nsd-decode-{i}", daemon=True)
                         for i in range(len(self._slots))]
        for thread in self._threads:
            thread.start()

    def check(self, config: GenerationConfig) -> None:
        """Raise the :class:`NSDError` a generation with ``config`` would meet at its start,
        where the slots can tell before it is queued (``-k auto`` past the ``k_max`` they
        measured), so that the client gets a 400 naming the field, not an error mid-stream."""
        slot = self._slots[0] if self._slots else None
        if config.method != "ar" and config.auto_k and hasattr(slot, "check_auto_k"):
            slot.check_auto_k(config.k_max)

    @property
    def depth(self) -> int:
        """Requests waiting (not counting those being decoded)."""
        return len(self._pending)

    @property
    def running(self) -> int:
        """Requests being decoded now."""
        return sum(job is not None for job in self._assigned)

    @property
    def busy(self) -> bool:
        return self.running > 0

    @property
    def closing(self) -> bool:
        return self._closing

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closing:
                raise ShuttingDown()
            if len(self._pending) >= self._capacity:
                # The wait ahead: the queued requests and the running ones, `parallel` at once.
                wait = (len(self._pending) + 1) * self._mean_job_s / self.parallel
                raise QueueFull(max(1, math.ceil(wait)))
            self._pending.append(job)
            self._assign()

    def withdraw(self, job: Job) -> bool:
        """Remove a job that has not started; False if it already started or finished."""
        with self._cond:
            try:
                self._pending.remove(job)
                return True
            except ValueError:
                return False

    def begin_shutdown(self) -> None:
        """Refuse new jobs and cancel the waiting ones; the running ones go on."""
        with self._cond:
            self._closing = True
            dropped = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        for job in dropped:
            job.cancel("shutdown")
            job.emit("cancelled", "shutdown")

    def cancel_running(self, reason: str) -> None:
        """Cancel the jobs being decoded (each at its next block)."""
        for job in list(self._assigned):
            if job is not None:
                job.cancel(reason)

    def stop(self, timeout_s: float) -> None:
        """Shut down, cancel the running jobs at their next block, and join the threads."""
        self.begin_shutdown()
        self.cancel_running("shutdown")
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:  # none when the model did not load
            thread.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ thread side
    def _assign(self) -> None:
        """Hand waiting jobs, oldest first, to free slots (the condition is held): each to
        the free slot whose cache shares the longest prefix with its prompt. A job for
        which a *releasing* slot (its job cancelled, to end at its next block) would share
        more waits for it, while the jobs behind it take the free slots: the follow-up
        sent as a client drops its stream reuses that stream's cache instead of
        prefilling its whole prompt in an empty slot."""
        free = [i for i, job in enumerate(self._assigned) if job is None]
        # A releasing slot will hold (at least the prompt of) its cancelled job.
        releasing = [job.prompt_ids for job in self._assigned if job is not None and job.cancelled]
        for job in list(self._pending):
            if not free:
                return
            best = max(free, key=lambda i: common_prefix_length(self._held[i], job.prompt_ids))
            shared = common_prefix_length(self._held[best], job.prompt_ids)
            if any(common_prefix_length(held, job.prompt_ids) > shared for held in releasing):
                continue  # assigned when that slot is released (its _run calls _assign)
            self._pending.remove(job)
            self._assigned[best] = job
            free.remove(best)
            self._cond.notify_all()

    def _cached(self, slot: int) -> list[int]:
        """What ``slot``'s target cache holds (waits for a running batch: slot threads only)."""
        return cached_tokens(getattr(self._slots[slot], "target", None)) or []

    def _run(self, slot: int) -> None:
        while True:
            with self._cond:
                while self._assigned[slot] is None and not self._closing:
                    self._cond.wait()
                job = self._assigned[slot]
                if job is None:
                    return
            started = time.perf_counter()
            last: tuple[str, Any] | None = None
            try:
                if self.batcher is not None:
                    with self.batcher.member():
                        last = self._execute(job, self._slots[slot])
                else:
                    last = self._execute(job, self._slots[slot])
            finally:
                held = self._cached(slot)
                with self._cond:
                    self._held[slot] = held
                    self._assigned[slot] = None
                    self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * (time.perf_counter() - started)
                    self._assign()
            # The slot is free before the client hears of the end: a chat's next turn, sent
            # the moment this one ends, finds it free and goes to the cache holding its
            # conversation, instead of racing the release to an empty slot.
            if last is not None:
                job.emit(*last)

    def _execute(self, job: Job, engine: StreamingEngine) -> tuple[str, Any]:
        """Run ``job`` on ``engine``, emitting its start and chunks; returns its last event
        (done, error or cancelled), which the caller emits once the slot is free."""
        if job.cancelled:
            return "cancelled", job.cancel_reason
        job.emit("start")
        try:
            stream = engine.stream(job.prompt_ids, job.config)
            while True:
                if job.cancelled:
                    stream.close()  # frees the decode generator; the next job resets the cache
                    return "cancelled", job.cancel_reason
                try:
                    chunk = next(stream)
                except StopIteration as done:
                    result: GenerationResult = done.value
                    return "done", result
                job.emit("chunk", chunk)
        except NSDError as exc:  # a problem with this request (e.g. context exceeded)
            return "error", exc
        except Exception as exc:  # keep the worker alive whatever one request does
            log.exception("generation failed")
            return "error", exc
