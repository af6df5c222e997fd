"""Pure functions that turn per-prompt records into benchmark numbers.

The figures ``nsd compare`` shares (medians, speedups, tau, deviation per token) are in
:mod:`nsd.aggregate`; these are the benchmark's own: paired ratios and differences,
acceptance by draft position, agreement with a reference, pass@k and its interval,
likelihoods.
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from nsd.aggregate import median

# Bootstrap resamples per interval, and a fixed seed so that a reading reprints the same interval.
RESAMPLES = 4000
SEED = 0


def _ratios(rates: Mapping[str, Mapping[str, float]], method: str, reference: str) -> list[float]:
    ratios = (r[method] / r[reference] for r in rates.values() if method in r and r.get(reference, 0) > 0)
    return [v for v in ratios if not math.isnan(v)]


def paired_ratio(rates: Mapping[str, Mapping[str, float]], method: str, reference: str) -> float:
    """Median over prompts of rate(method) / rate(reference), from ``rates[prompt][method]``:
    each prompt against itself, so its length and prefill cancel."""
    return median(_ratios(rates, method, reference))


def bootstrap_median(values: Sequence[float], resamples: int = RESAMPLES, seed: int = SEED
                     ) -> tuple[float, float]:
    """Percentile bootstrap 95 % interval of the median of ``values`` (resampling them
    with replacement, a fixed seed so a reading reprints the same interval); NaNs when
    there are fewer than two values."""
    if len(values) < 2:
        return math.nan, math.nan
    data = np.asarray(values, dtype=float)
    picks = np.random.default_rng(seed).integers(0, len(data), size=(resamples, len(data)))
    medians = np.median(data[picks], axis=1)
    return float(np.quantile(medians, 0.025)), float(np.quantile(medians, 0.975))


def paired_interval(rates: Mapping[str, Mapping[str, float]], method: str, reference: str
                    ) -> tuple[float, float, float, int]:
    """:func:`paired_ratio` with its bootstrap 95 % interval over prompts, and the number
    of prompts paired: (median, low, high, n)."""
    ratios = _ratios(rates, method, reference)
    return (median(ratios), *bootstrap_median(ratios), len(ratios))


def acceptance_by_position(attempts: Iterable[Sequence[int]], accepts: Iterable[Sequence[int]]
                           ) -> list[float]:
    """Pooled P(draft position i accepted | the block reached position i), over records
    whose per-position count lists may differ in length."""
    return per_position(attempts, accepts)


def per_position(attempts: Iterable[Sequence[int]], amounts: Iterable[Sequence[float]]) -> list[float]:
    """Pooled per-position mean: Σ amounts[i] / Σ attempts[i] over records (accepts give the
    acceptance rate, relaxed accepts the relaxed rate, charged deviations the mean E_t per
    block reaching position i); the lists may differ in length, and a record without
    amounts for a position counts 0 there."""
    total_attempts: list[int] = []
    total: list[float] = []
    for att, amount in zip(attempts, amounts):
        for i, n in enumerate(att):
            if i >= len(total_attempts):
                total_attempts.append(0)
                total.append(0)
            total_attempts[i] += n
            total[i] += amount[i] if i < len(amount) else 0
    return [a / n if n else math.nan for a, n in zip(total, total_attempts)]


def token_agreement(tokens: Sequence[int], reference: Sequence[int]) -> float:
    """Fraction of positions where two token sequences agree, over the longer length
    (a method that stops early or runs on disagrees on the extra positions)."""
    longest = max(len(tokens), len(reference))
    if longest == 0:
        return 1.0
    same = sum(1 for a, b in zip(tokens, reference) if a == b)
    return same / longest


def common_prefix_fraction(tokens: Sequence[int], reference: Sequence[int]) -> float:
    """How far into the reference the sequence follows it exactly (first divergence)."""
    if not reference:
        return 1.0 if not tokens else 0.0
    n = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        n += 1
    return n / len(reference)


def exact_match(text: str, reference: str) -> bool:
    return text == reference


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct (Chen et al., 2021)."""
    if n < k:
        raise ValueError(f"need at least k={k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_1(passed: Iterable[bool | None]) -> float:
    """Fraction of problems solved, one greedy sample each; ``None`` = not executed."""
    results = [bool(p) for p in passed if p is not None]
    return sum(results) / len(results) if results else math.nan


Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval of a proportion: unlike mean ± z·se it stays inside
    [0, 1] and keeps its coverage near 0 and 1 (pass@1 of a strong model is near 1)."""
    if n <= 0:
        return math.nan, math.nan
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(values: Sequence[float], reference: Sequence[float], z: float = Z95
                      ) -> tuple[float, float, float]:
    """Mean of ``values − reference`` over pairs (same prompt, same run) with a 95% normal
    interval: mean ± z·sd/√n. Pairing removes the between-problem spread, which dwarfs the
    method effect (most problems are solved by every method or by none)."""
    diffs = [a - b for a, b in zip(values, reference)
             if a is not None and b is not None and not math.isnan(a) and not math.isnan(b)]
    if not diffs:
        return math.nan, math.nan, math.nan
    centre = statistics.fmean(diffs)
    if len(diffs) < 2:
        return centre, math.nan, math.nan
    half = z * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return centre, centre - half, centre + half


def accepted_length_histogram(accepted_per_pass: Iterable[Sequence[int]]) -> list[int]:
    """Counts of target passes that accepted 0, 1, 2, ... draft tokens."""
    counts: list[int] = []
    for passes in accepted_per_pass:
        for n in passes:
            if n >= len(counts):
                counts.extend([0] * (n + 1 - len(counts)))
            counts[n] += 1
    return counts


@torch.inference_mode()
def mean_log_likelihood(target, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float:
    """Mean log p_target(completion token | everything before it), in nats, from one
    forward over prompt + completion. Raw logits (temperature 1): it scores the text under
    the target model itself, whichever sampling settings produced it."""
    if not completion_ids or not prompt_ids:
        return math.nan
    ids = list(prompt_ids) + list(completion_ids)
    target.reset()
    logits = target.forward(ids[:-1], all_logits=True).float()
    target.reset()
    # Row i predicts ids[i + 1]; completion tokens start at position len(prompt_ids).
    rows = logits[len(prompt_ids) - 1:]
    logp = torch.log_softmax(rows, dim=-1)
    picked = logp.gather(1, torch.tensor(list(completion_ids), dtype=torch.long).unsqueeze(1))
    return float(picked.mean())
