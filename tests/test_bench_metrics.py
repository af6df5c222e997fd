"""Benchmark arithmetic: τ, ratio-of-medians speedups, per-position acceptance, agreement,
pass@k and the target log-likelihood of a completion."""

from __future__ import annotations

import math

import pytest
import torch

from mock import MockLM
from nsd import aggregate
from nsd.bench import metrics


def test_tau_is_pooled_tokens_over_passes() -> None:
    assert aggregate.tau([10, 30], [10, 10]) == pytest.approx(2.0)  # not the mean of 1.0 and 3.0
    assert math.isnan(aggregate.tau([], []))


def test_speedup_is_the_median_of_per_prompt_ratios() -> None:
    ar = [10.0, 20.0, 1000.0]  # one outlier prompt barely moves the median
    nsd = [25.0, 40.0, 30.0]
    assert aggregate.speedup(nsd, ar) == pytest.approx(2.0)  # ratios 2.5, 2.0, 0.03
    # Paired, not a ratio of medians: ratios 1, 10 and 0.1 have the median 1.0, where the
    # medians 10 and 1 would say 10x.
    assert aggregate.speedup([1.0, 10.0, 100.0], [1.0, 1.0, 1000.0]) == pytest.approx(1.0)
    assert aggregate.speedup([1.0, 3.0], [1.0, 1.0]) == pytest.approx(2.0)  # even count: middle mean
    assert math.isnan(aggregate.speedup([], []))
    assert math.isnan(aggregate.speedup([1.0], [0.0]))
    with pytest.raises(ValueError, match="one per prompt"):
        aggregate.speedup([1.0], [])


def test_acceptance_by_position_pools_ragged_counts() -> None:
    attempts = [[4, 3, 1], [2], [2, 2]]
    accepts = [[3, 1, 0], [1], [2, 1]]
    assert metrics.acceptance_by_position(attempts, accepts) == pytest.approx([6 / 8, 2 / 5, 0.0])
    assert metrics.acceptance_by_position([], []) == []


def test_deviation_per_token() -> None:
    assert aggregate.deviation_per_token([0.5, 1.5], [10, 30]) == pytest.approx(0.05)


def test_token_agreement_and_prefix() -> None:
    ref = [1, 2, 3, 4]
    assert metrics.token_agreement(ref, ref) == 1.0
    assert metrics.token_agreement([1, 9, 3, 4], ref) == pytest.approx(0.75)
    assert metrics.token_agreement([1, 2], ref) == pytest.approx(0.5)  # stopping early disagrees
    assert metrics.token_agreement([1, 2, 3, 4, 5, 6], ref) == pytest.approx(4 / 6)
    assert metrics.common_prefix_fraction([1, 2, 9, 4], ref) == pytest.approx(0.5)
    assert metrics.common_prefix_fraction(ref + [7], ref) == 1.0
    assert metrics.exact_match("a b", "a b") and not metrics.exact_match("a", "a b")


def test_pass_at_k() -> None:
    assert metrics.pass_at_k(1, 1, 1) == 1.0
    assert metrics.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert metrics.pass_at_k(5, 0, 2) == 0.0
    assert metrics.pass_at_k(5, 4, 2) == 1.0
    assert metrics.pass_at_k(4, 2, 2) == pytest.approx(1 - (2 * 1) / (4 * 3))
    assert metrics.pass_at_1([True, False, None, True]) == pytest.approx(2 / 3)
    assert math.isnan(metrics.pass_at_1([None]))


def test_accepted_length_histogram() -> None:
    assert metrics.accepted_length_histogram([[0, 2, 2], [4], []]) == [1, 0, 2, 0, 1]


def test_mean_log_likelihood_matches_step_by_step() -> None:
    lm = MockLM(vocab_size=12, seed=3)
    prompt, completion = [1, 2, 3], [4, 5, 6, 7]
    expected = []
    context = list(prompt)
    for tok in completion:
        logp = torch.log_softmax(lm.logits_after(context), dim=-1)
        expected.append(float(logp[tok]))
        context.append(tok)
    got = metrics.mean_log_likelihood(lm, prompt, completion)
    assert got == pytest.approx(sum(expected) / len(expected), rel=1e-5)
    assert lm.num_cached == 0  # leaves the cache empty for the next generation
    assert math.isnan(metrics.mean_log_likelihood(lm, prompt, []))


def test_wilson_interval_known_values() -> None:
    assert metrics.wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert metrics.wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert metrics.wilson_interval(10, 10)[1] == pytest.approx(1.0)
    assert all(math.isnan(v) for v in metrics.wilson_interval(0, 0))


def test_paired_difference_mean_and_interval() -> None:
    centre, lo, hi = metrics.paired_difference([1, 1, 0, 1], [1, 0, 0, 0])
    half = 1.959963984540054 * math.sqrt(1 / 3) / 2  # sd of (0, 1, 0, 1) is sqrt(1/3)
    assert centre == 0.5 and (lo, hi) == pytest.approx((0.5 - half, 0.5 + half))
    assert metrics.paired_difference([0.2, float("nan")], [0.1, 0.3])[0] == pytest.approx(0.1)
    assert metrics.paired_difference([1.0, 1.0], [1.0, 1.0]) == (0.0, 0.0, 0.0)


def test_bootstrap_median_interval_is_reproducible_and_covers_the_median() -> None:
    assert metrics.bootstrap_median([2.0] * 7) == (2.0, 2.0)
    assert all(math.isnan(v) for v in metrics.bootstrap_median([1.0]))
    values = [0.9, 1.1, 1.0, 1.3, 0.7, 1.05, 0.95, 1.2]
    low, high = metrics.bootstrap_median(values)
    assert low <= metrics.median(values) <= high and (low, high) == metrics.bootstrap_median(values)
    # Coverage: 200 samples of 40 from Exp(1), whose median is ln 2. A 95 % interval
    # should hold it about 190 times (binomial sd about 3); the percentile bootstrap of a
    # median runs a little under nominal at n = 40, so accept 176..199 (over 4 sd below).
    gen = torch.Generator().manual_seed(0)
    hits = 0
    for trial in range(200):
        sample = torch.empty(40).exponential_(generator=gen).tolist()
        low, high = metrics.bootstrap_median(sample, resamples=1000, seed=trial)
        hits += low <= math.log(2) <= high
    assert 176 <= hits <= 199


def test_paired_interval_pairs_prompts_having_both_methods() -> None:
    rates = {"a": {"ar": 10.0, "nsd": 12.0}, "b": {"ar": 10.0, "nsd": 9.0}, "c": {"ar": 10.0, "nsd": 15.0},
             "d": {"nsd": 30.0}, "e": {"ar": 0.0, "nsd": 5.0}}  # d unpaired, e no AR rate
    centre, low, high, n = metrics.paired_interval(rates, "nsd", "ar")
    assert (centre, n) == (pytest.approx(1.2), 3) and 0.9 <= low <= 1.2 <= high <= 1.5
    assert metrics.paired_ratio(rates, "nsd", "ar") == centre
    centre, low, high, n = metrics.paired_interval(rates, "sd", "ar")
    assert n == 0 and math.isnan(centre) and math.isnan(low)
