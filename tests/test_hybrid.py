"""Prompt lookup beside the draft model: the policy prices both, exactness holds."""

from __future__ import annotations

import math

import torch

from mock import MockLM
from nsd.draftlen.costmodel import AcceptanceTracker, CostModelK, StepCosts
from nsd.decode import DecodeConfig, decode, run_to_end
from nsd.proposers.draft_model import DraftModelProposer
from nsd.proposers.hybrid import FIXED_K_MIN_MATCH, HybridProposer
from nsd.proposers.ngram import NgramConfig, NgramProposer
from nsd.rules.sampling import SamplingConfig
from test_decode import _exact_sequence_probs, _reference_probs


def _policy(lookup_prior: float, seed: int = 0) -> CostModelK:
    costs = StepCosts((0.04, 0.05, 0.055, 0.06, 0.065), draft=0.015)
    return CostModelK(costs, AcceptanceTracker(4, prior=0.7), k_max=4, seed=seed,
                      lookup_tracker=AcceptanceTracker(4, prior=lookup_prior, weight=500.0))


def test_plan_takes_lookup_where_it_is_free_and_likely_accepted() -> None:
    confident = _policy(0.95)
    k, from_lookup = confident.plan(100, free=3)
    assert from_lookup and 1 <= k <= 3  # never more than lookup can copy
    assert confident.plan(100, free=0)[1] is False  # nothing to copy: the draft model
    doubtful = _policy(0.02)  # lookup blocks are nearly always rejected
    assert not any(doubtful.plan(100, free=4)[1] for _ in range(30))
    no_lookup = CostModelK(StepCosts((0.04, 0.05, 0.055, 0.06, 0.065), draft=0.015),
                           AcceptanceTracker(4), k_max=4)
    assert no_lookup.plan(100, free=4)[1] is False


def test_lookup_blocks_teach_their_own_tracker_and_leave_the_draft_behind() -> None:
    policy = _policy(0.6)
    policy.begin(10)
    k, from_lookup = policy.plan(100, free=4)
    before = list(policy.tracker.attempts)
    if from_lookup:
        policy.observe(k, k, k, 0.0, 0.05, 0.0)
        assert policy.tracker.attempts == before  # the draft's estimate is untouched
        assert sum(policy.lookup_trackers[1].attempts) > 0
        assert sum(policy.lookup_tracker.attempts) == 0  # the template stays the prior
        assert policy._behind == 10 + k + 1  # the draft saw none of the block


def test_each_match_length_learns_its_own_lookup_acceptance() -> None:
    """Copies after a single matched token that keep failing must not stop copies after a
    three-token match, which keep being accepted."""
    policy = CostModelK(StepCosts((0.04, 0.05, 0.055, 0.06, 0.065), draft=0.015),
                        AcceptanceTracker(4, prior=0.3), k_max=4, seed=3,
                        lookup_tracker=AcceptanceTracker(4, prior=0.8))
    for _ in range(40):
        for match, accepted in ((1, 0), (3, 4)):
            k, from_lookup = policy.plan(100, free=4, match=match)
            drafted = k if from_lookup else 0
            policy.observe(k, drafted, min(accepted, drafted), 0.0, 0.05, 0.0)
    assert policy.lookup_trackers[1].rates()[0] < 0.5  # tried, failed, then left alone
    assert policy.lookup_trackers[3].rates()[0] > 0.9
    assert policy.plan(100, free=4, match=3)[1] is True
    assert not any(policy.plan(100, free=4, match=1)[1] for _ in range(30))


def test_lookup_draws_never_choose_a_block_the_mean_rejects() -> None:
    """A wide lookup posterior whose mean says a plain step pays better: no draw may pick
    a lookup block (exploration is the scheduled probes' job)."""
    costs = StepCosts((0.04, 0.07, 0.08, 0.09, 0.10), draft=0.03)
    policy = CostModelK(costs, AcceptanceTracker(4, prior=0.2), k_max=4, seed=0,
                        lookup_tracker=AcceptanceTracker(4, prior=0.4, weight=0.5))
    assert policy._lookup_choice(4, 2) is None
    assert not any(policy.plan(100, free=4, match=2)[1] for _ in range(200))


def test_hybrid_proposer_copies_or_drafts() -> None:
    greedy = SamplingConfig()
    hybrid = HybridProposer(DraftModelProposer(MockLM(seed=1), greedy), NgramProposer(NgramConfig(max_ngram=2)))
    context = [5, 6, 7, 8, 9, 5, 6]
    assert hybrid.free_length(context, 4) == (4, 2)  # 7, 8, 9, 5 follow the earlier "5 6"
    copied = hybrid.propose(context, 2, torch.Generator(), lookup=True)
    assert copied.tokens.tolist() == [7, 8] and copied.probs is None
    drafted = hybrid.propose(context, 3, torch.Generator())
    assert len(drafted) == 3


def _repetitive_run(target, config, policy_seed, seed_ctx=(1, 2, 3, 1, 2, 3, 1, 2), tally=None):
    hybrid = HybridProposer(DraftModelProposer(MockLM(vocab_size=target.vocab_size, seed=31),
                                               config.sampling), NgramProposer())
    if tally is not None:  # count what each proposer drafts, as the proposer sees it
        propose = hybrid.propose

        def counted(context, k, generator, lookup=False):
            proposal = propose(context, k, generator, lookup=lookup)
            tally["lookup" if lookup else "draft"] += len(proposal.tokens)
            return proposal

        hybrid.propose = counted
    costs = StepCosts(tuple(0.04 * (1 + 0.05 * n) for n in range(7)), draft=0.01)
    policy = CostModelK(costs, AcceptanceTracker(6), k_max=6, seed=policy_seed,
                        lookup_tracker=AcceptanceTracker(6, prior=0.9))
    return run_to_end(decode(target, list(seed_ctx), config, hybrid, k_policy=policy))


def test_greedy_sd_with_hybrid_blocks_equals_ar() -> None:
    target = MockLM(seed=30, sharpness=4.0)
    greedy = SamplingConfig()
    ar, _ = run_to_end(decode(target, [1, 2, 3, 1, 2, 3, 1, 2],
                              DecodeConfig(speculative=False, sampling=greedy, max_new_tokens=40)))
    config = DecodeConfig(sampling=greedy, auto_k=True, k_max=6, max_new_tokens=40)
    tally = {"lookup": 0, "draft": 0}
    tokens, stats = _repetitive_run(target, config, policy_seed=0, tally=tally)
    assert tokens == ar
    assert stats.lookup_blocks > 0 and stats.lookup_blocks < stats.target_passes
    # Each proposer's share of the drafts is counted apart (no EOS here: nothing is cut),
    # and of the accepts no more than it drafted.
    assert stats.lookup_drafted == tally["lookup"] > 0
    assert stats.drafted_tokens - stats.lookup_drafted == tally["draft"] > 0
    assert 0 < stats.lookup_accepted <= min(stats.lookup_drafted, stats.accepted_tokens)


def test_sampled_sd_with_hybrid_blocks_keeps_the_target_law() -> None:
    """Whichever proposer drafts a block (chosen from the context only), exact SD samples
    the target's sequence law: chi-square against the law computed without nsd."""
    v, length, n = 6, 3, 2500
    knobs = dict(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0)
    sampling = SamplingConfig(**knobs)
    target = MockLM(vocab_size=v, seed=20, sharpness=1.2)
    prompt = (1, 2, 1, 2)  # "1 2" repeats: lookup can propose "1 2 ..."
    exact = _exact_sequence_probs(target, list(prompt), length, v,
                                  lambda logits: _reference_probs(logits, **knobs))
    counts: dict[tuple, int] = {}
    lookups = 0
    for seed in range(n):
        config = DecodeConfig(sampling=sampling, auto_k=True, k_max=3, max_new_tokens=length, seed=seed)
        tokens, stats = _repetitive_run(target, config, policy_seed=seed, seed_ctx=prompt)
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
        lookups += stats.lookup_blocks
    assert lookups > n // 4  # lookup really drafted a share of the blocks
    assert set(counts) <= set(exact)
    big = [s for s, p in exact.items() if n * p >= 5]
    cells = [(counts.get(s, 0), n * exact[s]) for s in big]
    rest = sum(p for s, p in exact.items() if n * p < 5)
    if rest > 0:
        cells.append((n - sum(o for o, _ in cells), n * rest))
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    assert dof >= 10, dof
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)


def test_acceptance_counts_split_by_source_agree_with_the_totals() -> None:
    """The per-source counts the stored priors are made from: lookup blocks by match length
    and draft-model blocks, each test a position reached, summing to the per-position totals
    and to each proposer's accepts."""
    target = MockLM(seed=30, sharpness=4.0)
    config = DecodeConfig(sampling=SamplingConfig(), auto_k=True, k_max=6, max_new_tokens=40)
    _, stats = _repetitive_run(target, config, policy_seed=0)
    counts = stats.acceptance_counts
    assert "draft" in counts and any(key.startswith("lookup:") for key in counts)
    assert set(counts) <= {"draft"} | {f"lookup:{m}" for m in range(1, 4)}  # max_ngram 3
    assert sum(c[0] for c in counts.values()) == sum(stats.position_attempts)
    assert sum(c[1] for c in counts.values()) == stats.accepted_tokens
    assert sum(c[1] for key, c in counts.items() if key != "draft") == stats.lookup_accepted
    assert all(0 <= accepts <= tests for tests, accepts in counts.values())


def test_each_match_length_starts_from_its_own_prior() -> None:
    policy = CostModelK(StepCosts((0.04, 0.05, 0.055, 0.06, 0.065), draft=0.015),
                        AcceptanceTracker(4, prior=0.9), k_max=4, seed=0,
                        lookup_tracker=AcceptanceTracker(4, prior=0.5),
                        lookup_prior=lambda m: (0.1, 0.4, 0.8)[min(m, 3) - 1])
    assert [policy._lookup(m).prior for m in (1, 2, 3, 5)] == [0.1, 0.4, 0.8, 0.8]
    assert policy.lookup_tracker.prior == 0.5  # the template is untouched
    # A copy after a one-token match starts at 0.1 against the draft model's 0.9: the draft
    # model keeps the block; after a three-token match the free copy wins.
    assert not any(policy.plan(100, free=4, match=1)[1] for _ in range(20))
    assert policy.plan(100, free=4, match=3)[1] is True


def test_with_a_fixed_k_lookup_drafts_only_after_a_long_match() -> None:
    """No policy prices the two proposers at a fixed k, so a copy after a short match
    (accepted far less often than the draft model's block) is not taken; after a match of
    FIXED_K_MIN_MATCH tokens that covers the block it is, and greedy SD still equals AR."""
    hybrid = HybridProposer(DraftModelProposer(MockLM(seed=1), SamplingConfig()), NgramProposer())
    assert hybrid.fixed_k_lookup(free=4, k=4, match=FIXED_K_MIN_MATCH)
    assert not hybrid.fixed_k_lookup(free=4, k=4, match=FIXED_K_MIN_MATCH - 1)
    assert not hybrid.fixed_k_lookup(free=3, k=4, match=FIXED_K_MIN_MATCH)  # does not cover it
    short = HybridProposer(DraftModelProposer(MockLM(seed=1), SamplingConfig()),
                           NgramProposer(NgramConfig(max_ngram=2)))
    assert short.fixed_k_lookup(free=4, k=4, match=2)  # its longest n-gram is the long match

    target = MockLM(seed=30, sharpness=4.0)
    greedy = SamplingConfig()
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    ar, _ = run_to_end(decode(target, prompt, DecodeConfig(speculative=False, sampling=greedy,
                                                           max_new_tokens=30)))
    fixed = HybridProposer(DraftModelProposer(MockLM(vocab_size=target.vocab_size, seed=31), greedy),
                           NgramProposer())
    matches: list[int] = []
    free_length = fixed.free_length

    def recorded(context, n):
        free, match = free_length(context, n)
        matches.append(match)
        return free, match

    fixed.free_length = recorded
    tokens, stats = run_to_end(decode(target, prompt, DecodeConfig(sampling=greedy, k=2, max_new_tokens=30),
                                      fixed))
    assert tokens == ar
    assert stats.lookup_blocks > 0  # the prompt's repeats give 3-token matches
    assert stats.lookup_blocks <= sum(m >= FIXED_K_MIN_MATCH for m in matches)
    assert stats.lookup_blocks < stats.target_passes


def test_a_fixed_k_longer_than_k_max_still_lets_lookup_draft() -> None:
    """k_max bounds -k auto and adaptive k; a fixed k is its own bound. Lookup offered at
    most k_max tokens, so a fixed k above k_max never got a lookup block (and a larger
    k_max, which the CLI and the server call unused beside a fixed k, changed that)."""
    target = MockLM(seed=1, sharpness=8.0)
    greedy = SamplingConfig()
    base = [1, 2, 3]
    first, _ = run_to_end(decode(target, base, DecodeConfig(speculative=False, sampling=greedy,
                                                            max_new_tokens=40)))
    prompt = base + first + base  # the target's own continuation repeats: long matches
    runs = []
    for k_max in (4, 16):
        hybrid = HybridProposer(DraftModelProposer(MockLM(seed=2), greedy), NgramProposer())
        tokens, stats = run_to_end(decode(target, prompt, DecodeConfig(
            sampling=greedy, k=6, k_max=k_max, max_new_tokens=30), hybrid))
        runs.append((tokens, stats.lookup_blocks, stats.target_passes))
    assert runs[0] == runs[1] and runs[0][1] > 0
