"""Figures of a set of generations, defined once for ``nsd compare`` and ``nsd bench``.

Speedups are ratios of *medians of per-prompt tokens/s* measured in the same run: the
median shrugs off a prompt hit by a burst of machine load, and per-prompt rates weight
every prompt alike whatever its length. Missing (None) and undefined (NaN) values are
left out of medians and means.
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Sequence


def defined(value) -> bool:
    """A figure that can be shown: neither missing (None) nor undefined (NaN)."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def median(values: Iterable[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def mean(values: Iterable[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(values) if values else math.nan


def tau(new_tokens: Sequence[int], target_passes: Sequence[int]) -> float:
    """Pooled mean accepted length: all new tokens over all target passes."""
    passes = sum(target_passes)
    return sum(new_tokens) / passes if passes else math.nan


def speedup(rates: Sequence[float], baseline_rates: Sequence[float]) -> float:
    """Ratio of the median per-prompt tokens/s of a method to that of its baseline."""
    base = median(baseline_rates)
    ours = median(rates)
    if math.isnan(base) or math.isnan(ours) or base <= 0:
        return math.nan
    return ours / base


def deviation_per_token(deviations: Sequence[float], new_tokens: Sequence[int]) -> float:
    """Pooled fidelity cost: summed deviation bound D over all generated tokens."""
    tokens = sum(new_tokens)
    return sum(deviations) / tokens if tokens else math.nan
