"""Measuring step costs on the machine at hand, once, and remembering them.

``c(n)`` — seconds for one forward over ``n`` new tokens with logits for each, after a
realistic context — is what the ``-k auto`` cost model and ``--weights auto`` decide
from. Its shape differs a lot between CPUs, weight formats and kernels (on one machine
verifying 5 tokens cost 1.4 steps, on another 2.7), so it is measured, never tabled.

A measurement takes a few seconds and is cached under ``calibration/`` in the nsd cache,
keyed by everything that changes it: CPU model and flags, the model file (path, size,
modification time), the backend and its version, thread count, and the context length.
Costs measured while other processes kept the cores busy are stored only provisionally:
on two cores a busy neighbour can make a step several times slower, and a table of such
numbers would mislead every later run, so each later run measures again until one is
taken on an idle machine; meanwhile the provisional costs serve, so that a seeded ``-k
auto`` generation chooses the same draft lengths from one run to the next.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from nsd.backends.base import ModelBackend, context_limit
from nsd.errors import NSDError
from nsd.draftlen.machine import cpu_description

CONTEXT_TOKENS = 256  # cached tokens before the measured forwards (a typical prompt)
REPEATS = 5
COMPARE_REPEATS = 9  # side-by-side c(1) of several files: the pick hinges on a few percent
MEASURE_ORDER = "c1-after-c1"  # part of the cache key: measure()'s timing order


def llama_library_files() -> list[Path]:
    """The shared libraries llama-cpp-python loaded (its own ``lib`` folder, or the one
    ``LLAMA_CPP_LIB_PATH`` names), symlinks left out."""
    from llama_cpp import llama_cpp as lib

    return [p for p in sorted(Path(lib._base_path).iterdir()) if p.is_file() and not p.is_symlink()]


@functools.lru_cache(maxsize=1)
def llama_build_id() -> str:
    """A digest of the llama.cpp shared libraries in use: the same llama-cpp-python version
    built with another patch or other CPU flags runs other kernels, so its step costs must
    not be read from a calibration measured with the old build."""
    digest = hashlib.sha256()
    for path in llama_library_files():
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# Environment variables read by nsd's llama.cpp patches (scripts/patches/) that change
# which kernels run.
_KERNEL_SWITCHES = ("GGML_NO_AMX", "GGML_AMX_SMALL_M", "GGML_VNNI_SMALL_M", "GGML_VNNI_SMALL_MIN",
                    "GGML_AVX2_SMALL_M", "GGML_AVX2_SMALL_MIN")


def kernel_switches() -> str:
    """The patches' kernel switches set in this process ("" where none is): they decide which
    kernels run, and whether a row's logits depend on its batch (GGML_AVX2_SMALL_MIN=2 and
    GGML_AVX2_SMALL_M=0 drop the AVX2 kernels' batch invariance), so reports name them."""
    return ",".join(f"{v}={os.environ[v]}" for v in _KERNEL_SWITCHES if v in os.environ)


def _backend_version(backend: ModelBackend) -> str:
    name = type(backend).__name__
    inner = getattr(backend, "model", None)
    if type(inner).__name__ == "LlamaCppBackend":
        # A wrapper (the reduced draft's embedding input) runs the wrapped model's kernels:
        # keyed by them, or costs measured with one build or switch were reused for another.
        return f"{name}[{_backend_version(inner)}]"
    if name == "LlamaCppBackend":
        import llama_cpp

        # The weight layouts llama.cpp chose (AMX, CPU_REPACK, ...) decide the kernels too:
        # the same build runs other ones with GGML_NO_AMX=1 or use_extra_bufts off.
        buffers = ",".join(getattr(backend, "weight_buffers", ()))
        # ... and so do the patches' switches, which a user may set (benchmarks do).
        switches = kernel_switches()
        return (f"{name}/{llama_cpp.__version__}/build={llama_build_id()}"
                f"/fa={getattr(backend, 'flash_attn', None)}/buffers={buffers}"
                + (f"/{switches}" if switches else ""))
    import torch

    return f"{name}/torch-{torch.__version__}/{getattr(backend, 'dtype', '')}"


@dataclass(frozen=True)
class Calibration:
    """``costs[n − 1]`` = median seconds of a forward over ``n`` tokens."""

    costs: tuple[float, ...]
    key: dict[str, Any]
    cached: bool

    def to_dict(self) -> dict[str, Any]:
        return {"costs": list(self.costs), "key": self.key, "cached": self.cached}


def _filler(vocab: int, n: int) -> list[int]:
    # Token content does not change the cost; spread the ids over ordinary tokens.
    return [(100 + 7919 * i) % min(vocab, 20000) for i in range(n)]


def fitting_context(backends: Sequence[Any], want: int, extra: int) -> int:
    """Cached tokens to measure after: ``want``, or fewer where a backend's context (llama.cpp's
    ``n_ctx``, transformers' ``max_positions``) leaves no room for ``extra`` more. A small
    ``--n-ctx`` then measures a short context instead of failing on a sequence the user
    never asked for. Raises :class:`NSDError` where not even one cached token fits."""
    room = context_limit(backends)
    if room is None or room - extra >= want:
        return want
    if room - extra < 1:
        raise NSDError(f"a context of {room} tokens leaves no room to measure forwards of "
                       f"{extra} tokens for -k auto: give a fixed -k, a smaller --k-max, or a "
                       "larger --n-ctx")
    return room - extra


def _prime(backend: ModelBackend, ids: list[int], context: int) -> None:
    """Cache ``ids[:context]`` and run one untimed step after it (lazy allocations, caches)."""
    backend.reset()
    backend.forward(ids[:context], all_logits=False)
    backend.forward(ids[context:context + 1])
    backend.rewind(context)


def measure(backend: ModelBackend, n_max: int, context: int = CONTEXT_TOKENS,
            repeats: int = REPEATS) -> tuple[float, ...]:
    """Median seconds of one forward over ``n = 1..n_max`` tokens after ``context`` cached
    tokens. The sizes are interleaved within each repeat, so drift hits them alike.

    Each size is timed in the order decoding meets it. A one-token step is timed right
    after another one, as plain decoding runs them; every larger forward follows one of
    another size, as a verification follows a plain step or a block of another length
    (two blocks of the same length in a row reuse the graph, so c(n) is then a few ms
    pessimistic: a bias towards shorter blocks, not away from drafting). The order matters:
    llama.cpp reuses its compute graph only between forwards of the same shape, and on a
    Zen 4 a one-token step timed after a 9-token forward cost 39 ms against 35 ms after
    another one-token step. Timed after ``n_max`` tokens, c(1) overstated plain decoding
    by ~10 % (AR ran at 0.92 of it), which made every verification look cheap beside it.
    """
    ids = _filler(backend.vocab_size, context + n_max)
    _prime(backend, ids, context)
    samples: list[list[float]] = [[] for _ in range(n_max)]
    for _ in range(repeats):
        backend.forward(ids[context:context + 1])  # untimed: the step before the timed one
        backend.rewind(context)
        for n in range(1, n_max + 1):
            start = time.perf_counter()
            backend.forward(ids[context:context + n])
            samples[n - 1].append(time.perf_counter() - start)
            backend.rewind(context)
    backend.reset()
    return tuple(statistics.median(s) for s in samples)


def measure_side_by_side(backends: Sequence[ModelBackend], context: int = CONTEXT_TOKENS,
                         repeats: int = COMPARE_REPEATS, n_tokens: int = 1) -> tuple[float, ...]:
    """Median c(n_tokens) of each backend, measured round-robin with a rotating order.

    Measuring one file after another biased the pick: the first one measured paid for a
    cold process (page faults in freshly mapped weights, clocks ramping), and on one
    machine that made the original file look 23% slower than it was. Round-robin visits
    put drift and warm-up on every candidate alike."""
    ids = [_filler(b.vocab_size, context + n_tokens) for b in backends]
    for backend, seq in zip(backends, ids):
        _prime(backend, seq, context)
    samples: list[list[float]] = [[] for _ in backends]
    order = list(range(len(backends)))
    for r in range(repeats):
        for i in order[r % len(order):] + order[:r % len(order)]:
            start = time.perf_counter()
            backends[i].forward(ids[i][context:])
            samples[i].append(time.perf_counter() - start)
            backends[i].rewind(context)
    for backend in backends:
        backend.reset()
    return tuple(statistics.median(s) for s in samples)


def compare_step_costs(candidates: Mapping[str, tuple[ModelBackend, str | os.PathLike[str]]],
                       refresh: bool = False, quiet: bool = False, n_tokens: int = 1) -> dict[str, float]:
    """c(n_tokens) seconds (default: one-token steps) of each named (backend, file),
    measured side by side and cached like :func:`calibrate` (keyed by every candidate's key;
    provisionally when the machine is busy)."""
    names = list(candidates)
    context = fitting_context([b for b, _ in candidates.values()], CONTEXT_TOKENS, n_tokens)
    key = {"compare": [dict(calibration_key(b, f, 1, context), name=n)
                       for n, (b, f) in candidates.items()],
           "repeats": COMPARE_REPEATS}
    if n_tokens != 1:  # one-token comparisons keep the key they were cached under
        key["n_tokens"] = n_tokens
    what = "step" if n_tokens == 1 else f"{n_tokens}-token forward"

    def read(cached: Any) -> dict[str, float] | None:
        return {n: float(cached[n]) for n in names} if set(cached) == set(names) else None

    def measure() -> dict[str, float]:
        measured = measure_side_by_side([candidates[n][0] for n in names], context,
                                        n_tokens=n_tokens)
        return dict(zip(names, measured))

    return measured_once(
        cache_path("compare", key), key, None if refresh else read, measure, None if quiet else
        f"nsd: comparing the {what} cost of {', '.join(names)} on this machine (once)",
        busy=f"the {what} costs")[0]


def measured_once(path: Path, key: dict[str, Any], read: Callable[[Any], Any] | None,
                   measure: Callable[[], Any], note: str | None,
                   busy: str = "these costs") -> tuple[Any, bool]:
    """``(costs, from_cache)``: the costs cached at ``path`` under ``key`` where ``read``
    accepts them (it returns None for a cache of another shape; no ``read``: measure
    anyway), else ``measure()``. ``note`` is printed before measuring.

    A measurement taken while other processes kept the cores busy is stored as
    *provisional*: every later call measures again, an idle measurement replaces it, and a
    busy one is discarded while the provisional costs serve. Used only for the run that
    measured them, busy costs would make a seeded ``-k auto`` generation choose other draft
    lengths on every run of a machine that never goes quiet; stored for good, they would
    misprice every later run. ``busy`` names the costs in the message saying so."""
    from nsd.draftlen.cpu_load import LoadMonitor  # psutil: only needed when measuring

    entry = _read_entry(path, key) if read is not None else None
    provisional = None
    if entry is not None:
        value = read(entry["costs"])
        if value is not None and not entry.get("provisional"):
            return value, True
        provisional = value
    if note:
        if provisional is not None:  # "(once)" would not be true: it is measured each run
            note = note.replace(" (once)", "") + " again (the stored costs were measured busy)"
        print(note, file=sys.stderr)
    with LoadMonitor().measure() as load:
        costs = measure()
    if not load.sample.flagged:
        _write_atomic(path, {"key": key, "costs": costs})
        if provisional is not None:  # draft lengths chosen from here on may differ
            print(f"nsd: the machine is idle: {busy} measured now replace those stored "
                  "provisionally from a busy run", file=sys.stderr)
        return costs, False
    busy_cores = f"the machine is busy ({100 * load.sample.other_cpu:.0f}% of the cores used by other processes)"
    if read is None:  # measured again on request: a busy run keeps what was stored
        print(f"nsd: {busy_cores}: {busy} measured now serve this run only", file=sys.stderr)
        return costs, False
    if provisional is not None:
        print(f"nsd: {busy_cores}: this measurement is discarded and {busy} stored from an "
              "earlier busy run serve until the machine is measured idle", file=sys.stderr)
        return provisional, True
    print(f"nsd: {busy_cores}: {busy} are stored provisionally and measured again on later "
          "runs until the machine is idle", file=sys.stderr)
    _write_atomic(path, {"key": key, "costs": costs, "provisional": True})
    return costs, False


def cache_path(stem: str, key: dict[str, Any]) -> Path:
    """Where the costs measured under ``key`` are stored: one JSON file per key, named
    ``stem`` and a digest of the key (read and written by :func:`measured_once`)."""
    from nsd.cache_dir import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "calibration" / f"{stem}-{digest}.json"


def _read_entry(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The cache entry (``costs``, and ``provisional`` when measured on a busy machine)
    stored under exactly ``key``, or None (absent, another key, or unreadable: then it is
    measured again and overwritten)."""
    try:
        data = json.loads(path.read_text())
        return data if data.get("key") == key and "costs" in data else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _write_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


# Cached tokens per sequence before a measured batched forward: fewer than a typical
# prompt's (each of up to 16 sequences is prefilled first), but with 64 a verification of
# four 3-token blocks measured 59 ms where serving prompts of ~140 tokens ran it in 72.
BATCH_CONTEXT = 128


def measure_batched(backend: Any, seqs: Sequence[int], widths: Sequence[int],
                    context: int = BATCH_CONTEXT, repeats: int = 3
                    ) -> tuple[tuple[float, ...], ...]:
    """Median seconds of one ``forward_many`` of ``seqs[i]`` sequences carrying
    ``widths[j]`` tokens each (all logits), every sequence after ``context`` cached tokens:
    the forwards a server's batch runs. The backend must hold ``max(seqs)`` sequences
    (``set_sequences``); their caches are emptied afterwards.

    Why not the one-sequence table: several sequences cost more than one sequence of as
    many tokens (each attends over its own cells, and the unified cache's mask spans them
    all): on a Zen 4, four sequences of two tokens took 48 ms against 39 ms for one of
    eight, enough to turn a predicted gain into a loss."""
    ids = _filler(backend.vocab_size, context + max(widths) + max(seqs))
    n = max(seqs)
    backend.reset()
    backend.forward_many([(q, ids[q:q + context], False) for q in range(n)])
    samples = [[[] for _ in widths] for _ in seqs]
    for repeat in range(repeats + 1):  # the first pass is untimed (lazy allocations)
        for i, s in enumerate(seqs):
            for j, w in enumerate(widths):
                start = time.perf_counter()
                backend.forward_many([(q, ids[context + q:context + q + w], True) for q in range(s)])
                if repeat:
                    samples[i][j].append(time.perf_counter() - start)
                for q in range(s):
                    backend.rewind(context, seq=q)
    backend.reset()
    return tuple(tuple(statistics.median(c) for c in row) for row in samples)


def calibrate_batched(backend: Any, model_file: str | os.PathLike[str] | None,
                      seqs: Sequence[int], widths: Sequence[int], quiet: bool = False
                      ) -> tuple[tuple[float, ...], ...]:
    """:func:`measure_batched`, cached like :func:`calibrate` for a model from a file (and,
    like it, provisionally when other processes kept the cores busy)."""
    context = fitting_context([backend], BATCH_CONTEXT, max(widths))
    if model_file is None:
        return measure_batched(backend, seqs, widths, context)
    key = dict(calibration_key(backend, model_file, max(widths), context),
               seqs=list(seqs), widths=list(widths), order="batched")

    def read(cached: Any) -> tuple[tuple[float, ...], ...] | None:
        return tuple(tuple(float(c) for c in row) for row in cached) \
            if len(cached) == len(seqs) else None

    return measured_once(
        cache_path(Path(model_file).stem + "-batched", key), key, read,
        lambda: measure_batched(backend, seqs, widths, context), None if quiet else
        f"nsd: measuring batched forwards of {Path(model_file).name} on this machine (once)",
        busy="the batched forward costs")[0]


def calibration_key(backend: ModelBackend, model_file: str | os.PathLike[str], n_max: int,
                    context: int = CONTEXT_TOKENS) -> dict[str, Any]:
    path = Path(model_file)
    st = path.stat()
    return {
        "cpu": cpu_description(),
        "file": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
        "backend": _backend_version(backend),
        "threads": getattr(backend, "n_threads", None),
        "n_max": n_max, "context": context,
    }


def calibrate(backend: ModelBackend, model_file: str | os.PathLike[str], n_max: int,
              refresh: bool = False, quiet: bool = False) -> Calibration:
    """Step costs ``c(1..n_max)`` for ``backend`` (loaded from ``model_file``), from the
    cache when this machine has measured them before (see :func:`measured_once` for a
    busy machine)."""
    context = fitting_context([backend], CONTEXT_TOKENS, n_max)
    # "order": how the sizes are timed (see measure()); costs timed the old way are stale.
    key = dict(calibration_key(backend, model_file, n_max, context), order=MEASURE_ORDER)

    def read(cached: Any) -> tuple[float, ...] | None:
        return tuple(float(c) for c in cached) if len(cached) == n_max else None

    costs, from_cache = measured_once(
        cache_path(Path(model_file).stem, key), key, None if refresh else read,
        lambda: list(measure(backend, n_max, context)), None if quiet else
        f"nsd: measuring step costs of {Path(model_file).name} on this machine (once)",
        busy="the step costs")
    return Calibration(tuple(costs), key, cached=from_cache)
