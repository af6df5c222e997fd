"""Figures of a set of generations, defined once for ``nsd compare`` and ``nsd bench``.

Speedups are *medians of per-prompt tokens/s ratios* measured in the same run (paired):
each prompt is compared with itself, so its length and prefill cancel, and the median
shrugs off a prompt hit by a burst of machine load. Missing (None) and undefined (NaN)
values are left out of medians and means.
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
    """Median over prompts of each prompt's own tokens/s ratio, method over baseline (the
    sequences aligned by prompt): a paired comparison, in which each prompt's length and
    prefill cancel. (A ratio of the two medians, used before, compares different prompts
    when the methods' medians fall on different ones: on Spec-Bench on a Zen 4 it put SD
    at 0.93x AR where the per-prompt ratios had a median of 1.00x.)"""
    if len(rates) != len(baseline_rates):
        raise ValueError(f"paired rates need one per prompt each: {len(rates)} against "
                         f"{len(baseline_rates)}")
    return median([r / b for r, b in zip(rates, baseline_rates) if b > 0])


def deviation_per_token(deviations: Sequence[float], new_tokens: Sequence[int]) -> float:
    """Pooled fidelity cost: summed deviation bound D over all generated tokens."""
    tokens = sum(new_tokens)
    return sum(deviations) / tokens if tokens else math.nan
