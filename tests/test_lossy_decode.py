"""The engines' lossy rules (topk_delta, threshold, fly) through the one decoding loop.

Each rule runs a seeded mock decode; a recorder around the loop's verification call
recomputes every block's per-position ``E`` from the rule functions of
:mod:`nsd.rules.lossy` on the very tensors the loop verified, and the run's ``D`` must
equal their sum over the emitted positions (added in the loop's order, so exactly).
"""

from __future__ import annotations

import math

import pytest
import torch

from mock import MockLM
import nsd.decode as decode_mod
from nsd.decode import DecodeConfig, decode
from nsd.errors import NSDError
from nsd.rules.lossy import fly_deferrals, threshold_weights, topk_delta_mask
from nsd.proposers.draft_model import DraftModelProposer
from nsd.proposers.ngram import NgramProposer
from nsd.rules.sampling import SamplingConfig
from nsd.rules.verify import RuleConfig, charge

GREEDY = SamplingConfig()
SAMPLE = SamplingConfig(temperature=1.0)


def _expected_excess(rule: RuleConfig, args: tuple, kw: dict) -> torch.Tensor:
    """``E_t`` ``[1, k]`` of one block from the rule functions, no budget (λ = 1)."""
    _, target_probs, plaus, tokens, draft_probs, accept_u, _, spent = args
    k = tokens.shape[-1]
    tok = tokens.unsqueeze(-1)
    p_x = target_probs[:, :k].gather(-1, tok).squeeze(-1).double()
    if rule.kind == "threshold":
        return threshold_weights(p_x, rule.threshold_single, rule.threshold_acc) * (1.0 - p_x)
    if rule.kind == "topk_delta":
        greedy = kw["greedy"]
        ranked = plaus if greedy else kw["relaxed_probs"]
        in_set = topk_delta_mask(ranked, rule.relaxed_topk, rule.relaxed_delta).gather(-1, tok).squeeze(-1)
        if greedy:
            return torch.where(in_set, 1.0 - p_x, torch.zeros_like(p_x))
        top = ranked.argmax(dim=-1, keepdim=True)
        p_top = target_probs[:, :k].gather(-1, top).squeeze(-1).double()
        return torch.where(in_set, 1.0 - p_x, 1.0 - p_top)
    opened, cost = fly_deferrals(rule, target_probs, plaus, tokens, draft_probs, accept_u, spent)
    return torch.where(opened, cost, torch.zeros_like(cost))


def _run_recorded(monkeypatch, rule: RuleConfig, sampling: SamplingConfig, proposer, seed: int = 0):
    """Decode 60 tokens; return (stats, D recomputed from the rule functions)."""
    blocks: list[tuple[torch.Tensor, torch.Tensor]] = []
    real_verify = decode_mod.verify

    def recording(*args, **kw):
        result = real_verify(*args, **kw)
        blocks.append((_expected_excess(rule, args, kw), result.num_accepted))
        return result

    monkeypatch.setattr(decode_mod, "verify", recording)
    target = MockLM(vocab_size=24, seed=31, sharpness=1.2)
    config = DecodeConfig(rule=rule, sampling=sampling, k=4, max_new_tokens=60, seed=seed)
    gen = decode(target, [1, 2, 3, 1, 2], config, proposer)
    expected = torch.zeros(1, dtype=torch.float64)
    seen = 0
    while True:
        try:
            new = next(gen)
        except StopIteration as stop:
            stats = stop.value
            break
        if len(blocks) > seen:  # this pass verified a block; len(new) tokens were emitted
            seen = len(blocks)
            excess, _ = blocks[-1]
            expected = charge(expected, excess[:, :min(len(new), excess.shape[-1])])
    return stats, float(expected[0]), len(blocks)


def _draft(sampling: SamplingConfig, argmax: bool) -> DraftModelProposer:
    return DraftModelProposer(MockLM(vocab_size=24, seed=32, sharpness=1.2), sampling, 24, argmax=argmax)


def test_smooth_does_not_soften_flys_hard_budget(monkeypatch) -> None:
    # --smooth does not act on fly (the front ends say so); the budget stays all or nothing.
    knobs = dict(fly_window_size=1, fly_entropy_threshold=0.5, budget=1.3)
    runs = [_run_recorded(monkeypatch, RuleConfig("fly", smooth=smooth, **knobs), SAMPLE,
                          _draft(SAMPLE, False), seed=1) for smooth in (False, True)]
    assert runs[0][0].deviation == runs[1][0].deviation <= 1.3


CASES = [
    ("topk_delta", GREEDY, dict(relaxed_topk=4, relaxed_delta=0.6)),
    ("topk_delta", SAMPLE, dict(relaxed_topk=4, relaxed_delta=0.6)),
    ("threshold", SAMPLE, dict(threshold_single=0.3, threshold_acc=0.6)),
    ("fly", GREEDY, dict(fly_window_size=1, fly_entropy_threshold=0.5)),
    ("fly", SAMPLE, dict(fly_window_size=1, fly_entropy_threshold=0.5)),
]


@pytest.mark.parametrize("kind,sampling,knobs", CASES)
def test_decode_deviation_is_the_sum_of_the_rule_functions_e(monkeypatch, kind, sampling, knobs) -> None:
    rule = RuleConfig(kind, **knobs)
    stats, expected, blocks = _run_recorded(monkeypatch, rule, sampling, _draft(sampling, rule.argmax_drafts))
    assert blocks > 5 and stats.new_tokens == 60
    assert stats.deviation == expected  # the same products, charged in the same order
    assert stats.deviation > 0 and stats.relaxed_accepts > 0  # the rule did relax here
    assert stats.method == kind


@pytest.mark.parametrize("kind,sampling,knobs", CASES)
def test_decode_budget_bounds_d_on_every_seed(monkeypatch, kind, sampling, knobs) -> None:
    for seed in range(2):
        rule = RuleConfig(kind, budget=1.5, **knobs)
        stats, expected, _ = _run_recorded(monkeypatch, rule, sampling,
                                           _draft(sampling, rule.argmax_drafts), seed=seed)
        assert stats.deviation <= 1.5
        # E from the rule functions with λ = 1 (FLy's own gate takes the budget): at most that.
        assert stats.deviation <= expected


def test_rules_at_their_exact_knob_values_reproduce_sd() -> None:
    target = MockLM(vocab_size=24, seed=31, sharpness=1.2)
    def run(rule: RuleConfig, sampling: SamplingConfig, argmax: bool):
        config = DecodeConfig(rule=rule, sampling=sampling, k=4, max_new_tokens=40, seed=5)
        gen = decode(target, [1, 2, 3], config, _draft(sampling, argmax))
        return decode_mod.run_to_end(gen)

    sd_greedy, _ = run(RuleConfig("exact"), GREEDY, False)
    assert run(RuleConfig("topk_delta", relaxed_topk=1), GREEDY, True)[0] == sd_greedy
    assert run(RuleConfig("fly", fly_entropy_threshold=math.inf), GREEDY, False)[0] == sd_greedy
    assert run(RuleConfig("fly", fly_entropy_threshold=math.inf), SAMPLE, False)[0] == \
        run(RuleConfig("exact"), SAMPLE, False)[0]
    # threshold 1/1 is SGLang's exact "target only" rule: the same as SD on argmax drafts.
    tokens, stats = run(RuleConfig("threshold"), SAMPLE, True)
    assert tokens == run(RuleConfig("exact"), SAMPLE, True)[0] and stats.deviation == 0.0
    assert stats.method == "sd"  # a rule that cannot relax is named for what it did


def test_topk_delta_with_no_budget_to_spend_is_sd_at_any_temperature() -> None:
    # Budget 0 or cap 0: the rule cannot relax, so it is the exact rule; at T > 0 it needs
    # no candidate set (Modular MAX's untempered softmax) and must not ask for one.
    target = MockLM(vocab_size=24, seed=31, sharpness=1.2)

    def run(rule: RuleConfig):
        config = DecodeConfig(rule=rule, sampling=SAMPLE, k=4, max_new_tokens=40, seed=5)
        return decode_mod.run_to_end(decode(target, [1, 2, 3], config, _draft(SAMPLE, True)))

    exact, _ = run(RuleConfig("exact"))
    for knobs in (dict(budget=0.0), dict(cap=0.0)):
        tokens, stats = run(RuleConfig("topk_delta", **knobs))
        assert tokens == exact and stats.deviation == 0.0 and stats.method == "sd"


def test_refusals_name_the_rule() -> None:
    target = MockLM(vocab_size=24, seed=31)
    with pytest.raises(NSDError, match="^threshold: .*temperature > 0"):
        DecodeConfig(rule=RuleConfig("threshold", threshold_acc=0.5), sampling=GREEDY)
    # A sampled draft (the proposer not in argmax mode) is refused by topk_delta/threshold.
    config = DecodeConfig(rule=RuleConfig("topk_delta"), sampling=SAMPLE, k=3, max_new_tokens=8)
    with pytest.raises(NSDError, match="^topk_delta: defined for argmax"):
        decode_mod.run_to_end(decode(target, [1, 2, 3], config, _draft(SAMPLE, argmax=False)))


def test_ngram_drafts_run_every_rule() -> None:
    target = MockLM(vocab_size=8, seed=13)
    for rule, sampling in ((RuleConfig("topk_delta"), SAMPLE), (RuleConfig("threshold", threshold_acc=0.5), SAMPLE),
                           (RuleConfig("fly", fly_window_size=1), GREEDY)):
        config = DecodeConfig(rule=rule, sampling=sampling, k=3, max_new_tokens=30)
        tokens, stats = decode_mod.run_to_end(decode(target, [1, 2, 3, 1, 2, 3, 1, 2], config, NgramProposer()))
        assert len(tokens) == 30 and stats.drafted_tokens > 0
