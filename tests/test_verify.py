"""Statistical and exact checks of the verification rules on small random vocabularies.

Analytic identities (TV = E, α' = α + E) are checked exactly on the closed-form output
distribution; the sampler is then checked against that closed form empirically with
fixed seeds and a tolerance of several standard errors.
"""

from __future__ import annotations

import math

import pytest
import torch

from nsd.rules.verify import (
    RuleConfig,
    charge,
    nucleus_threshold,
    relaxation_weights,
    relaxed_set_mask,
    relaxed_set_stats,
    typical_threshold,
    verify_block,
)
from nsd.rules.entry import verify

V = 8


def _random_dist(gen: torch.Generator, n: int, v: int = V, sharp: float = 2.0) -> torch.Tensor:
    return torch.softmax(sharp * torch.randn(n, v, generator=gen, dtype=torch.float64), dim=-1)


def _closed_form(p: torch.Tensor, q: torch.Tensor, in_set: torch.Tensor, lam: float) -> torch.Tensor:
    """P'(x) = q(x)·a(x) + R·r(x) for one position (all 1-D float64 tensors)."""
    m = torch.clamp(p / q, max=1.0)
    a = m + lam * in_set * (1 - m)
    resid = (p - q).clamp_min(0)
    z = resid.sum()
    reject = 1 - (q * a).sum()
    return q * a + (reject * resid / z if z > 0 else 0)


def _sample_first_token(rule: RuleConfig, p: torch.Tensor, q: torch.Tensor, n: int, seed: int):
    """Draw n independent single-draft blocks; return emitted first tokens and acceptances."""
    gen = torch.Generator().manual_seed(seed)
    draft = torch.multinomial(q.float(), n, replacement=True, generator=gen).unsqueeze(-1)  # [n, 1]
    target = torch.stack([p, p]).float().unsqueeze(0).expand(n, 2, V)
    draft_probs = q.float().view(1, 1, V).expand(n, 1, V)
    res = verify(rule, target, target[:, :1], draft, draft_probs,
                 torch.rand(n, 1, generator=gen, dtype=torch.float64),
                 torch.rand(n, generator=gen, dtype=torch.float64))
    first = torch.where(res.num_accepted > 0, draft[:, 0], res.next_token)
    return first, res


@pytest.mark.parametrize("theta", [0.0, 0.5, 0.9, 1.0])
def test_closed_form_tv_equals_excess_and_acceptance_gain(theta: float) -> None:
    gen = torch.Generator().manual_seed(0)
    rule = RuleConfig(kind="nucleus", theta=theta)
    for _ in range(200):
        p, q = _random_dist(gen, 1)[0], _random_dist(gen, 1)[0]
        mask = relaxed_set_mask(p.unsqueeze(0), rule)[0]
        excess = ((q - p).clamp_min(0) * mask).sum()
        out = _closed_form(p, q, mask.double(), 1.0)
        assert out.sum().item() == pytest.approx(1.0, abs=1e-12)
        assert 0.5 * (out - p).abs().sum().item() == pytest.approx(excess.item(), abs=1e-12)
        alpha = torch.minimum(p, q).sum()
        m = torch.clamp(p / q, max=1.0)
        accept = (q * (m + mask * (1 - m))).sum()
        assert accept.item() == pytest.approx((alpha + excess).item(), abs=1e-12)


def test_exact_rule_reproduces_target_distribution() -> None:
    gen = torch.Generator().manual_seed(1)
    p, q = _random_dist(gen, 1)[0], _random_dist(gen, 1)[0]
    n = 200_000
    first, res = _sample_first_token(RuleConfig(kind="exact"), p, q, n, seed=2)
    freq = torch.bincount(first, minlength=V).double() / n
    se = torch.sqrt(p * (1 - p) / n)
    assert torch.all((freq - p).abs() <= 5 * se + 1e-4), (freq, p)
    alpha = torch.minimum(p, q).sum().item()
    assert res.num_accepted.double().mean().item() == pytest.approx(alpha, abs=5 * math.sqrt(0.25 / n))
    assert torch.all(res.deviation == 0)


@pytest.mark.parametrize("theta", [0.5, 0.9])
def test_nucleus_rule_matches_closed_form_tv_and_acceptance(theta: float) -> None:
    gen = torch.Generator().manual_seed(3)
    p, q = _random_dist(gen, 1)[0], _random_dist(gen, 1)[0]
    rule = RuleConfig(kind="nucleus", theta=theta)
    mask = relaxed_set_mask(p.float().unsqueeze(0), rule)[0]
    excess = ((q - p).clamp_min(0) * mask).sum().item()
    expected = _closed_form(p, q, mask.double(), 1.0)
    n = 200_000
    first, res = _sample_first_token(rule, p, q, n, seed=4)
    freq = torch.bincount(first, minlength=V).double() / n
    se = torch.sqrt(expected * (1 - expected) / n)
    assert torch.all((freq - expected).abs() <= 5 * se + 1e-4)
    # Empirical TV from p: unbiased up to the sampling noise of the histogram.
    tv = 0.5 * (freq - p).abs().sum().item()
    assert tv == pytest.approx(excess, abs=0.01)
    alpha = torch.minimum(p, q).sum().item()
    assert res.num_accepted.double().mean().item() == pytest.approx(alpha + excess, abs=0.005)
    # Every position charges exactly E (k = 1: the position is always emitted).
    assert torch.allclose(res.deviation[:, 0], torch.full((n,), excess, dtype=torch.float64), atol=1e-6)


def test_theta_zero_and_budget_zero_are_the_exact_rule_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(5)
    b, k = 512, 4
    target = _random_dist(gen, b * (k + 1)).float().view(b, k + 1, V)
    q = _random_dist(gen, b * k).float().view(b, k, V)
    draft = torch.multinomial(q.view(-1, V), 1, generator=gen).view(b, k)
    u_acc = torch.rand(b, k, generator=gen, dtype=torch.float64)
    u_smp = torch.rand(b, generator=gen, dtype=torch.float64)
    ref = verify(RuleConfig(kind="exact"), target, target[:, :k], draft, q, u_acc, u_smp)
    for rule in (RuleConfig(kind="nucleus", theta=0.0), RuleConfig(kind="nucleus", theta=0.9, budget=0.0),
                 RuleConfig(kind="nucleus", theta=0.9, budget=0.0, smooth=True)):
        out = verify(rule, target, target[:, :k], draft, q, u_acc, u_smp)
        assert torch.equal(out.num_accepted, ref.num_accepted)
        assert torch.equal(out.next_token, ref.next_token)
        assert torch.all(out.deviation == 0)
    # ... while a relaxing rule on the same inputs does accept more.
    nsd = verify(RuleConfig(kind="nucleus", theta=0.9), target, target[:, :k], draft, q, u_acc, u_smp)
    assert nsd.num_accepted.sum() > ref.num_accepted.sum()


@pytest.mark.parametrize("smooth", [False, True])
def test_budget_never_exceeded_on_any_path(smooth: bool) -> None:
    gen = torch.Generator().manual_seed(6)
    b, k, budget = 256, 6, 0.7
    rule = RuleConfig(kind="nucleus", theta=0.95, budget=budget, smooth=smooth)
    spent = torch.zeros(b, dtype=torch.float64)
    for _ in range(30):  # 30 blocks of a long generation, per sequence
        target = _random_dist(gen, b * (k + 1), sharp=1.0).float().view(b, k + 1, V)
        q = _random_dist(gen, b * k, sharp=1.0).float().view(b, k, V)
        draft = torch.multinomial(q.view(-1, V), 1, generator=gen).view(b, k)
        res = verify(rule, target, target[:, :k], draft, q,
                     torch.rand(b, k, generator=gen, dtype=torch.float64),
                     torch.rand(b, generator=gen, dtype=torch.float64), spent)
        assert torch.equal(res.spent, charge(spent, res.deviation))
        spent = res.spent
        assert torch.all(spent <= budget)
    if smooth:  # the smooth variant spends the budget down to the last remainder
        assert torch.all(spent >= budget - 1e-9)
    assert spent.mean() > 0.5 * budget


def test_smooth_weight_spends_exactly_the_remainder() -> None:
    rule = RuleConfig(kind="nucleus", theta=0.9, budget=1.0, smooth=True)
    excess = torch.tensor([[0.5, 0.4, 0.3, 0.2]], dtype=torch.float64)
    w = relaxation_weights(rule, excess, torch.zeros(1, dtype=torch.float64))
    assert torch.allclose(w, torch.tensor([[1.0, 1.0, 1 / 3, 0.0]], dtype=torch.float64))
    hard = relaxation_weights(RuleConfig(kind="nucleus", theta=0.9, budget=1.0), excess,
                              torch.zeros(1, dtype=torch.float64))
    assert torch.equal(hard, torch.tensor([[1.0, 1.0, 0.0, 0.0]], dtype=torch.float64))  # 0.2 > 0.1 left
    capped = relaxation_weights(RuleConfig(kind="nucleus", theta=0.9, cap=0.35), excess,
                                torch.zeros(1, dtype=torch.float64))
    assert torch.equal(capped, torch.tensor([[0.0, 0.0, 1.0, 1.0]], dtype=torch.float64))


def test_smooth_partial_relaxation_has_tv_lambda_times_excess() -> None:
    gen = torch.Generator().manual_seed(7)
    p, q = _random_dist(gen, 1)[0], _random_dist(gen, 1)[0]
    mask = relaxed_set_mask(p.unsqueeze(0), RuleConfig(kind="nucleus", theta=0.9))[0]
    excess = ((q - p).clamp_min(0) * mask).sum().item()
    for lam in (0.0, 0.25, 0.6, 1.0):
        out = _closed_form(p, q, mask.double(), lam)
        assert 0.5 * (out - p).abs().sum().item() == pytest.approx(lam * excess, abs=1e-12)


def test_greedy_rules() -> None:
    # Target logits favour token 0, token 1 close behind; draft proposes 1 (one-hot q).
    logits = torch.tensor([[3.0, 2.8, -5.0, -5.0]])
    plaus = torch.softmax(logits, -1)
    p = torch.zeros(1, 4)
    p[0, 0] = 1.0  # temperature 0: one-hot on the argmax
    target = torch.stack([p, p], dim=1)  # [1, 2, 4]
    draft = torch.tensor([[1]])
    u = torch.zeros(1, 1, dtype=torch.float64)
    s = torch.zeros(1, dtype=torch.float64)
    exact = verify(RuleConfig(kind="exact"), target, plaus.unsqueeze(1), draft, None, u, s)
    assert exact.num_accepted.item() == 0 and exact.next_token.item() == 0  # emit the argmax
    nsd = verify(RuleConfig(kind="nucleus", theta=0.9), target, plaus.unsqueeze(1), draft, None, u, s)
    assert nsd.num_accepted.item() == 1 and nsd.relaxed.all()
    assert nsd.deviation.item() == pytest.approx(1.0)  # TV between two one-hots
    tight = verify(RuleConfig(kind="nucleus", theta=0.3), target, plaus.unsqueeze(1), draft, None, u, s)
    assert tight.num_accepted.item() == 0  # nucleus {0} only
    agree = verify(RuleConfig(kind="nucleus", theta=0.9), target, plaus.unsqueeze(1), torch.tensor([[0]]),
                   None, u, s)
    assert agree.num_accepted.item() == 1 and agree.deviation.item() == 0.0
    assert agree.next_token.item() == 0  # bonus from p


def test_deterministic_proposal_accepts_with_p_and_charges_one_minus_p() -> None:
    gen = torch.Generator().manual_seed(8)
    p = _random_dist(gen, 1)[0].float()
    x = int(torch.argsort(p, descending=True)[1])  # second most likely: inside a 0.9 nucleus
    n = 100_000
    target = torch.stack([p, p]).unsqueeze(0).expand(n, 2, V)
    draft = torch.full((n, 1), x)
    u = torch.rand(n, 1, generator=gen, dtype=torch.float64)
    s = torch.rand(n, generator=gen, dtype=torch.float64)
    exact = verify(RuleConfig(kind="exact"), target, target[:, :1], draft, None, u, s)
    assert exact.num_accepted.double().mean().item() == pytest.approx(p[x].item(), abs=0.01)
    # Exact rule with a one-hot q still samples p exactly.
    first = torch.where(exact.num_accepted > 0, draft[:, 0], exact.next_token)
    freq = torch.bincount(first, minlength=V).double() / n
    assert torch.all((freq - p.double()).abs() < 0.01)
    nsd = verify(RuleConfig(kind="nucleus", theta=0.9), target, target[:, :1], draft, None, u, s)
    assert torch.all(nsd.num_accepted == 1)
    assert torch.allclose(nsd.deviation[:, 0], torch.full((n,), 1 - p[x].item(), dtype=torch.float64))


def test_one_hot_shortcut_matches_full_mask_path() -> None:
    gen = torch.Generator().manual_seed(9)
    b, k = 64, 3
    target = _random_dist(gen, b * k).float().view(b, k, V)
    draft = torch.randint(0, V, (b, k), generator=gen)
    one_hot = torch.nn.functional.one_hot(draft, V).float()
    for rule in (RuleConfig(kind="nucleus", theta=0.8), RuleConfig(kind="typical", typical_epsilon=0.2)):
        a_set, a_exc = relaxed_set_stats(rule, target, target, draft, None)
        b_set, b_exc = relaxed_set_stats(rule, target, target, draft, one_hot)
        assert torch.equal(a_set, b_set)
        assert torch.allclose(a_exc, b_exc, atol=1e-6)


def test_nucleus_threshold_definition_and_fallback() -> None:
    probs = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    t = nucleus_threshold(probs, 0.6)
    assert t.tolist() == pytest.approx([0.2, 0.25])  # ties at the crossing stay together
    mask = relaxed_set_mask(probs, RuleConfig(kind="nucleus", theta=0.6))
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert relaxed_set_mask(probs, RuleConfig(kind="nucleus", theta=1.0)).all()
    # A flat 1000-token row is larger than the top-k fast path: the full sort must agree.
    flat = torch.full((1, 1000), 1e-3)
    assert relaxed_set_mask(flat, RuleConfig(kind="nucleus", theta=0.9)).sum() == 1000  # all tied
    ramp = torch.softmax(torch.linspace(0, 1, 1000), -1).unsqueeze(0)
    mask = relaxed_set_mask(ramp, RuleConfig(kind="nucleus", theta=0.5))
    kept = ramp[mask].sum().item()
    assert kept >= 0.5 and kept - ramp[mask].min().item() < 0.5  # shortest prefix reaching θ
    assert not relaxed_set_mask(probs, RuleConfig(kind="nucleus", theta=0.0)).any()


def _nucleus_by_definition(probs: torch.Tensor, theta: float) -> torch.Tensor:
    """Reference membership, one row at a time: sort descending, keep the shortest prefix
    whose mass reaches θ × the row's total, plus every token tied with the crossing one."""
    mask = torch.zeros_like(probs, dtype=torch.bool)
    for r, row in enumerate(probs):
        values = row.sort(descending=True).values
        reached = values.double().cumsum(0) >= theta * row.double().sum()
        t = values[int(reached.to(torch.int8).argmax())]
        mask[r] = (row >= t) & (row > 0)
    return mask


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_nucleus_branches_agree_on_unnormalised_rows(device: str, monkeypatch) -> None:
    # Rows with nuclei larger than the top-256 look take the full-sort branch: the host-sync
    # one on CPU, the sync-free one on an accelerator. Both must measure θ against the row's
    # own total, so unnormalised rows (totals 0.5 and 3, float32 rounding) keep the same
    # nucleus whichever branch runs. Forced here on CPU tensors; natural on a GPU.
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import nsd.rules.verify as verify_module

    gen = torch.Generator().manual_seed(21)
    v = 1000
    flat = torch.softmax(0.3 * torch.randn(8, v, generator=gen), -1)  # nuclei of hundreds
    peaked = torch.softmax(6.0 * torch.randn(8, v, generator=gen), -1)  # nuclei of a few
    probs = torch.cat([flat, peaked])
    probs = probs * torch.tensor([0.5, 3.0, 1.0, 0.7] * 4).unsqueeze(-1)
    probs[::5, 600:] = 0.0  # zeros, as after top-k
    theta = 0.9
    expected = _nucleus_by_definition(probs, theta)
    assert (expected[:8].sum(-1) > 256).all() and (expected[8:].sum(-1) < 256).all()
    rule = RuleConfig(kind="nucleus", theta=theta)
    masks = {}
    original = verify_module._complete_short_rows
    for host_sync in (True, False):
        if device == "cpu":
            monkeypatch.setattr(verify_module, "_complete_short_rows",
                                lambda f, m, t, host_sync, forced=host_sync: original(f, m, t, forced))
        masks[host_sync] = relaxed_set_mask(probs.to(device), rule).cpu()
    assert torch.equal(masks[True], expected)
    assert torch.equal(masks[False], expected)


def test_typical_set() -> None:
    probs = torch.tensor([[0.7, 0.2, 0.09, 0.01]])
    rule = RuleConfig(kind="typical", typical_epsilon=0.3, typical_delta=0.09)
    entropy = -(probs * probs.log()).sum()
    thr = min(0.3, 0.09 * math.exp(-entropy.item()))
    assert relaxed_set_mask(probs, rule).tolist() == [[p > thr for p in probs[0].tolist()]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_typical_set_on_half_precision_inputs_is_the_float32_one(dtype: torch.dtype) -> None:
    # Half-precision target rows (as a half model's softmax gives them), with exact zeros
    # (top-k) and underflowed tails. The same values in float32 define the reference set.
    gen = torch.Generator().manual_seed(23)
    rows, v = 64, 500
    probs = torch.softmax(torch.cat([3.0 * torch.randn(rows // 2, v, generator=gen),
                                     0.5 * torch.randn(rows // 2, v, generator=gen)]), -1)
    probs[::4, 300:] = 0.0
    probs = probs / probs.sum(-1, keepdim=True)
    half = probs.to(dtype)
    reference = half.float()  # exactly the half values
    rule = RuleConfig(kind="typical")
    expected = relaxed_set_mask(reference, rule)
    assert expected.any(dim=-1).all()  # every row has a typical set (its top token at least)
    assert torch.equal(typical_threshold(half, rule.typical_epsilon, rule.typical_delta),
                       typical_threshold(reference, rule.typical_epsilon, rule.typical_delta))
    assert torch.equal(relaxed_set_mask(half, rule), expected)
    # The single-token test (one-hot q) sees the same set.
    draft = torch.multinomial(reference, 1, generator=gen)  # [rows, 1]
    in_set, _ = relaxed_set_stats(rule, half.unsqueeze(1), half.unsqueeze(1), draft, None)
    assert torch.equal(in_set, expected.gather(-1, draft))


def test_block_stops_at_first_rejection_and_charges_only_emitted_positions() -> None:
    b, k = 1, 4
    p = torch.full((b, k + 1, V), 1.0 / V)
    draft = torch.zeros(b, k, dtype=torch.long)
    q = torch.zeros(b, k, V)
    q[..., 0] = 1.0
    in_set = torch.tensor([[True, False, True, True]])
    excess = torch.full((b, k), 0.5, dtype=torch.float64)
    weights = torch.ones(b, k, dtype=torch.float64)
    u = torch.tensor([[0.9, 0.9, 0.0, 0.0]], dtype=torch.float64)  # pos 1 fails: not in set, m = 1/8
    res = verify_block(p, draft, q, in_set, excess, weights, u, torch.tensor([0.5], dtype=torch.float64))
    assert res.num_accepted.item() == 1
    assert res.relaxed.tolist() == [[True, False, False, False]]
    assert res.deviation.tolist() == [[0.5, 0.5, 0.0, 0.0]]
    assert res.next_token.item() != 0  # residual (p − q)₊ excludes the rejected token


def test_seeded_determinism() -> None:
    def run() -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(11)
        p, q = _random_dist(gen, 1)[0], _random_dist(gen, 1)[0]
        first, res = _sample_first_token(RuleConfig(kind="nucleus", theta=0.7), p, q, 1000, seed=12)
        return first, res.num_accepted
    a, b = run(), run()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_rule_config_rejects_bad_values() -> None:
    from nsd.errors import NSDError
    for kwargs in ({"theta": 1.5}, {"theta": -0.1}, {"budget": -1.0}, {"kind": "fast"}, {"cap": -0.1}):
        with pytest.raises(NSDError):
            RuleConfig(**{"kind": "nucleus", **kwargs})


@pytest.mark.parametrize("smooth", [False, True])
def test_budget_holds_under_exact_float_comparison(smooth: bool) -> None:
    # Random budget states and excesses, 200,000 sequences: no tolerance anywhere. The first
    # row is a case where λ = remaining / E, summed back, rounded to B + 1 ulp.
    gen = torch.Generator().manual_seed(14)
    n, k = 200_000, 3
    budgets = (0.3, 0.7, 1.0, 2.5)
    for i, budget in enumerate(budgets):
        rows = n // len(budgets)
        spent = budget * torch.rand(rows, generator=gen, dtype=torch.float64)
        excess = torch.rand(rows, k, generator=gen, dtype=torch.float64)
        if i == 0:
            spent[0], excess[0, 0] = 0.08817727679236728, 0.7676522699834736
        rule = RuleConfig(kind="nucleus", theta=0.9, budget=budget, smooth=smooth)
        weights = relaxation_weights(rule, excess, spent)
        assert torch.all((weights >= 0) & (weights <= 1))
        running = spent.clone()
        for t in range(k):  # the scan's own order: each charge fits what is left
            step_charge = weights[:, t] * excess[:, t]
            assert torch.all(step_charge <= (budget - running).clamp_min(0.0))
            running = running + step_charge
            assert torch.all(running <= budget)
        # The block test adds the same charges to `spent`; every draft is accepted here
        # (p uniform over 2 tokens, one-hot q, u = 0), so every position is charged.
        target = torch.full((rows, k + 1, 2), 0.5)
        res = verify_block(target, torch.zeros(rows, k, dtype=torch.long), None,
                           torch.ones(rows, k, dtype=torch.bool), excess, weights,
                           torch.zeros(rows, k, dtype=torch.float64), torch.zeros(rows, dtype=torch.float64),
                           spent)
        assert torch.all(res.num_accepted == k)
        assert torch.all(res.spent <= budget)


def test_theta_one_nucleus_is_the_whole_support() -> None:
    # float32 rows whose total exceeds 1 by rounding reached θ = 1 before their smallest
    # tokens; some rows also carry exact zeros (as after top-k), which stay outside.
    gen = torch.Generator().manual_seed(15)
    rows, v = 200, 300
    probs = torch.softmax(4.0 * torch.randn(rows, v, generator=gen), dim=-1)
    probs[::3, :50] = 0.0
    mask = relaxed_set_mask(probs, RuleConfig(kind="nucleus", theta=1.0))
    assert torch.equal(mask, probs > 0)
    # Membership agrees between the full mask and the single-token test (q one-hot), for
    # every token of every row, at θ = 1 and below.
    sub = probs[:20]
    every_token = torch.arange(v).expand(20, v)  # row b, "position" j drafts token j
    plaus = sub.unsqueeze(1).expand(20, v, v)
    for theta in (0.5, 0.9, 0.999, 1.0):
        rule = RuleConfig(kind="nucleus", theta=theta)
        in_set, _ = relaxed_set_stats(rule, plaus, plaus, every_token, None)
        assert torch.equal(in_set, relaxed_set_mask(sub, rule)), theta


@pytest.mark.parametrize("rule", [RuleConfig(kind="nucleus", theta=0.3), RuleConfig(kind="nucleus", theta=0.9),
                                  RuleConfig(kind="nucleus", theta=1.0), RuleConfig(kind="typical")])
def test_sparse_excess_on_cpu_sums_the_terms_of_the_dense_formula(rule: RuleConfig) -> None:
    """On a CPU, E sums only the tokens of S with q > p; it must equal the dense
    ``Σ (q − p)₊ · 1[S]`` over the whole vocabulary (float32 rows, top-p sparse, as the
    decoding loop hands them), with the same membership of every draft token."""
    from nsd.rules.sampling import SamplingConfig, logits_to_probs

    gen = torch.Generator().manual_seed(11)
    config = SamplingConfig(temperature=0.8, top_p=0.95)
    logits = torch.randn(2, 6, 5000, generator=gen) * 4
    p = logits_to_probs(logits, config)
    q = logits_to_probs(logits + torch.randn(2, 6, 5000, generator=gen), config)  # a draft near p
    q[0, 0] = p[0, 0]  # a row with q == p: nothing to sum
    tokens = torch.multinomial(q.reshape(-1, 5000), 1, generator=gen).reshape(2, 6)
    in_set, excess = relaxed_set_stats(rule, p, p, tokens, q)
    mask = relaxed_set_mask(p, rule)
    dense = ((q.double() - p.double()).clamp_min(0.0) * mask).sum(dim=-1)
    assert torch.equal(in_set, mask.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
    assert excess[0, 0] == 0.0 and bool((excess[:, 1:] > 0).any())
    assert torch.allclose(excess, dense, rtol=1e-12, atol=0)
    # A row with a NaN is never relaxed: E is NaN, as the dense form made it.
    q[1, 2, 7] = math.nan
    _, broken = relaxed_set_stats(rule, p, p, tokens, q)
    assert math.isnan(broken[1, 2]) and torch.equal(broken[0], excess[0])
