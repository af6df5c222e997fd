"""The order of a benchmark grid, shared by ``nsd bench`` and ``benchmarks/vllm_bench.py``.

Every method runs on a prompt before the next prompt starts (interleaved), and which
method goes first rotates by one per prompt, so slow drift in machine load and first-call
effects do not always hit the same method. A run resumes from its journal: calls already
recorded are skipped.
"""

from __future__ import annotations

from typing import Container, Hashable, Iterable, Sequence, TypeVar

T = TypeVar("T")


def method_order(methods: Sequence[T], index: int) -> list[T]:
    """The methods in prompt ``index``'s order: rotated left by ``index``."""
    shift = index % len(methods)
    return list(methods[shift:]) + list(methods[:shift])


def missing(keys: Iterable[Hashable], done: Container) -> int:
    """How many of ``keys`` (one per call of the grid) ``done`` (a journal, or its
    records) still lacks."""
    return sum(key not in done for key in keys)
