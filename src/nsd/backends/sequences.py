"""Several sequences of one model, each decoded by its own thread, their forwards run together.

A server decoding several requests at once gives each request a thread that runs the
ordinary single-sequence decoding loop (:func:`nsd.decode.decode`) over a
:class:`SequenceView`: a :class:`~nsd.backends.base.ModelBackend` bound to one sequence of
a backend that holds several (``set_sequences``, ``forward_many``). The view's
:meth:`~SequenceView.forward` does not run the model itself: it hands its tokens to the
:class:`StepBatcher` and waits. When every member thread is waiting on a forward, the
batcher runs all of them at once: one ``forward_many`` per model (the target's
verification blocks and plain steps together, the draft's steps together), then wakes
them with their logits.

Why threads meeting at a barrier rather than a scheduler that steps every request: the
decoding loop, the proposers and the cost-model policy stay exactly as they are for one
request (its seed, rule, budget, draft length and statistics are its own), and a request
that is drafting while another verifies simply lands in the other model's batch. A
request's host work (sampling, verification) runs on its own thread while the others'
does too; the models' forwards, which release Python's lock, run one at a time.

The backends themselves are not thread-safe: every call into them (forwards, rewinds,
snapshots) holds :attr:`StepBatcher.lock`. The forwards all run on one thread of the
batcher's own: llama.cpp built with OpenMP keeps a team of worker threads per calling
thread, and forwards called from whichever member completed the set left the other
members' idle teams spinning on the cores (a suspicion, not a measurement: the slow
batches measured then came mostly from llama.cpp's batch splitting, see
the comment on the KV cache in :mod:`nsd.backends.llama_cpp`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence

import torch


class MultiSequenceBackend(Protocol):
    """A backend holding several sequences, each with its own rewindable cache."""

    @property
    def vocab_size(self) -> int: ...

    def set_sequences(self, n_seq: int) -> None: ...

    def forward_many(self, items: Sequence[tuple[int, Sequence[int], bool]]) -> list[torch.Tensor]:
        """``(seq, tokens, all_logits)`` per sequence, at most one item per sequence."""
        ...

    def rewind(self, num_tokens: int, seq: int = 0) -> None: ...

    def reset(self, seq: int | None = None) -> None: ...

    def seq_num_cached(self, seq: int) -> int: ...

    def seq_cached_tokens(self, seq: int) -> list[int]: ...


@dataclass(eq=False)
class _Call:
    backend: Any
    seq: int
    tokens: list[int]
    all_logits: bool
    result: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class BatchStats:
    """What the batcher ran: forwards (one ``forward_many`` each), the sequences and tokens
    they carried. ``sequences / forwards`` is the mean batch size."""

    forwards: int = 0
    sequences: int = 0
    tokens: int = 0
    largest: int = 0  # most sequences in one forward
    seconds: float = 0.0  # wall time of the batches (both models' forwards)
    by_size: dict[int, int] = field(default_factory=dict)  # sequences per forward -> forwards


class StepBatcher:
    """The meeting point of the member threads' forwards (see the module's docstring).

    A thread is a member while it runs inside :meth:`member`; forwards of non-members
    are not waited for. Whichever member completes the set runs the batch itself.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._members = 0
        self._calls: list[_Call] = []
        self.lock = threading.RLock()  # held for every call into the backends
        self.stats = BatchStats()
        self.rounds = 0  # batches run: a member's next forward runs in round rounds + 1
        self.plan: Any = None  # the members' joint draft-length plan, if any (for /metrics)
        # (id(backend), seq) -> tokens the other sequences carried in that sequence's last
        # forward of that backend: what the cost model prices a block against.
        self._others: dict[tuple[int, int], int] = {}
        self._batches: queue.SimpleQueue[list[_Call]] = queue.SimpleQueue()
        self._runner: threading.Thread | None = None  # runs every batch (started on demand)

    @contextlib.contextmanager
    def member(self) -> Iterator[None]:
        with self._cond:
            self._members += 1
        try:
            yield
        finally:
            with self._cond:
                self._members -= 1
                batch = self._take_ready()
            if batch:  # the others may have been waiting only for this one
                self._run(batch)

    @property
    def members(self) -> int:
        return self._members

    def forward(self, backend: Any, seq: int, tokens: Sequence[int], all_logits: bool) -> torch.Tensor:
        """Sequence ``seq``'s forward of ``tokens``, run with the other members' forwards."""
        call = _Call(backend, seq, list(tokens), all_logits)
        with self._cond:
            self._calls.append(call)
            batch = self._take_ready()
        if batch:
            self._run(batch)
        with self._cond:
            while not call.done:
                self._cond.wait()
        if call.error is not None:
            raise call.error
        assert call.result is not None
        return call.result

    def others(self, backend: Any, seq: int) -> int:
        """Tokens of other sequences in ``seq``'s last forward of ``backend`` (0 before any)."""
        return self._others.get((id(backend), seq), 0)

    def _take_ready(self) -> list[_Call]:
        """The waiting calls, taken, when every member has one (the condition is held)."""
        if self._calls and len(self._calls) >= self._members:
            batch, self._calls = self._calls, []
            return batch
        return []

    def _run(self, batch: list[_Call]) -> None:
        """Hand ``batch`` to the runner thread; its callers are woken when it is done."""
        with self._cond:
            if self._runner is None:
                self._runner = threading.Thread(target=self._runner_loop, name="nsd-forwards",
                                                daemon=True)
                self._runner.start()
        self._batches.put(batch)

    def _runner_loop(self) -> None:
        while True:
            batch = self._batches.get()
            groups: dict[int, list[_Call]] = {}
            for call in batch:
                groups.setdefault(id(call.backend), []).append(call)
            start = time.perf_counter()
            try:
                with self.lock:
                    for calls in groups.values():
                        self._run_group(calls)
            finally:
                self.stats.seconds += time.perf_counter() - start
                with self._cond:
                    self.rounds += 1
                    for call in batch:
                        call.done = True
                    self._cond.notify_all()

    def _run_group(self, calls: list[_Call]) -> None:
        backend = calls[0].backend
        try:
            results = backend.forward_many([(c.seq, c.tokens, c.all_logits) for c in calls])
        except BaseException as exc:  # noqa: BLE001 - handed to the callers
            if len(calls) == 1:
                calls[0].error = exc
                return
            # One request's bad forward (a full context) must not fail the others: nothing
            # was decoded, so run them one by one and let each fail or succeed alone.
            for call in calls:
                self._run_group([call])
            return
        total = sum(len(c.tokens) for c in calls)
        for call, logits in zip(calls, results):
            call.result = logits
            self._others[(id(backend), call.seq)] = total - len(call.tokens)
        stats = self.stats
        stats.forwards += 1
        stats.sequences += len(calls)
        stats.tokens += sum(len(c.tokens) for c in calls)
        stats.largest = max(stats.largest, len(calls))
        stats.by_size[len(calls)] = stats.by_size.get(len(calls), 0) + 1


class SequenceView:
    """Sequence ``seq`` of ``backend`` as a single-sequence
    :class:`~nsd.backends.base.ModelBackend`, its forwards run by ``batcher``.

    Any other attribute (``n_ctx``, ``eos_token_ids``, ...) is the backend's; snapshots
    (``save_state``/``load_state``, for the prefix cache) exist when the backend has them.
    """

    # Tokens per round of a long forward beside other requests (0: in one round; the
    # server's --prefill-chunk).
    prefill_chunk: int = 0

    def __init__(self, backend: Any, seq: int, batcher: StepBatcher) -> None:
        self.backend, self.seq, self.batcher = backend, seq, batcher

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    # Reads take the lock like the writes below: a backend may switch its per-sequence
    # state while it runs a batch on the forward thread (the tests' mock does), and a read
    # of one sequence in the middle of that switch would see another's tokens.
    @property
    def num_cached(self) -> int:
        with self.batcher.lock:
            return self.backend.seq_num_cached(self.seq)

    @property
    def cached_tokens(self) -> list[int]:
        with self.batcher.lock:
            return self.backend.seq_cached_tokens(self.seq)

    def forward(self, tokens: Sequence[int], all_logits: bool = True) -> torch.Tensor:
        if len(tokens) == 0:
            raise ValueError("forward needs at least one token")
        chunk = self.prefill_chunk
        if not chunk or len(tokens) <= chunk or self.batcher.members <= 1:
            return self.batcher.forward(self.backend, self.seq, tokens, all_logits)
        # A long forward (a prompt's prefill, a draft catching up) beside other requests
        # runs in chunks, one per round: the others' steps go on between them instead of
        # waiting for the whole prompt (an 800-token prefill is seconds on a CPU).
        rows = []
        for start in range(0, len(tokens), chunk):
            part = tokens[start:start + chunk]
            last = start + chunk >= len(tokens)
            out = self.batcher.forward(self.backend, self.seq, part, all_logits)
            if all_logits or last:
                rows.append(out)
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    def batch_others(self) -> int:
        """Tokens the other sequences carried in this sequence's last forward: how full the
        forwards this sequence's next block joins are likely to be."""
        return self.batcher.others(self.backend, self.seq)

    def rewind(self, num_tokens: int) -> None:
        with self.batcher.lock:
            self.backend.rewind(num_tokens, seq=self.seq)

    def reset(self) -> None:
        with self.batcher.lock:
            self.backend.reset(seq=self.seq)

    def _save_state(self) -> Any:
        with self.batcher.lock:
            return self.backend.save_state(seq=self.seq)

    def _load_state(self, tokens: Sequence[int], state: Any) -> None:
        with self.batcher.lock:
            self.backend.load_state(tokens, state, seq=self.seq)

    def __getattr__(self, name: str) -> Any:
        if name in ("backend", "seq", "batcher"):
            raise AttributeError(name)
        if name in ("save_state", "load_state"):
            if not hasattr(self.backend, name):
                raise AttributeError(name)
            return self._save_state if name == "save_state" else self._load_state
        return getattr(self.backend, name)


def sequence_views(backends: Sequence[Any], n_seq: int, batcher: StepBatcher) -> list[list[SequenceView]]:
    """Give every backend ``n_seq`` sequences; returns, per sequence, its view of each
    backend (same order as ``backends``)."""
    for backend in backends:
        backend.set_sequences(n_seq)
    return [[SequenceView(backend, seq, batcher) for backend in backends] for seq in range(n_seq)]
