"""The engines' lossy rules against reference implementations of their acceptance laws.

Each reference below is written from the engine's stated condition (see nsd.rules.lossy),
position by position with plain Python, independently of the vectorised code. Laws are
checked exactly by enumeration on small vocabularies; the samplers by Monte Carlo with
fixed seeds and a tolerance of 5 standard errors (a false failure has probability
below 1e-6 per cell).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from nsd import options as optspec
from nsd.errors import NSDError
from nsd.rules.lossy import (
    fly_deferrals,
    fly_entropy,
    relaxed_weights,
    threshold_weights,
    topk_delta_inputs,
    topk_delta_mask,
    verify_lossy,
)
from nsd.rules.entry import verify
from nsd.rules.sampling import SamplingConfig
from test_verify import _random_dist
from nsd.rules.verify import RuleConfig

V = 8


_dist = _random_dist  # the same random distributions as the nucleus tests draw


def _one_hot(idx: torch.Tensor, v: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(idx, v).double()


def _uniforms(gen: torch.Generator, b: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept uniforms [b, k] and sample uniforms [b], float64."""
    return (torch.rand(b, k, generator=gen, dtype=torch.float64),
            torch.rand(b, generator=gen, dtype=torch.float64))


# --------------------------------------------------------------------------- references


def _ref_topk_delta_set(probs: list[float], k: int, delta: float) -> set[int]:
    """TensorRT-LLM's kernel loop: walk the top-K in order, the top-1 always eligible,
    later ones while their value is ≥ top-1 − δ."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])[:k]
    best = probs[order[0]]
    out = {order[0]}
    for j in order[1:]:
        if probs[j] < best - delta:
            break
        out.add(j)
    return out


def _ref_sglang_accept_prob(p_x: float, single: float, acc: float) -> float:
    """SGLang's chain condition ``u ≤ p/acc or p ≥ single`` as a probability over u."""
    return 1.0 if p_x >= single else min(1.0, p_x / acc)


def _ref_fly_accepts(native: list[bool], gate: list[bool], window: int) -> list[bool]:
    """vLLM's pre-pass: a native rejection becomes an accept iff its gate holds and the
    next ``window`` positions all pass natively (all of them inside the block)."""
    k = len(native)
    out = []
    for t in range(k):
        defer = (not native[t] and gate[t] and t + window < k
                 and all(native[t + j] for j in range(1, window + 1)))
        out.append(native[t] or defer)
    return out


# --------------------------------------------------------------------------- top-K / δ


def test_topk_delta_set_matches_the_kernel_walk() -> None:
    gen = torch.Generator().manual_seed(0)
    for k, delta in [(1, 0.0), (3, 0.0), (3, 0.1), (10, 0.6), (4, 1.0), (8, 0.05)]:
        for p in _dist(gen, 50, sharp=1.5):
            mask = topk_delta_mask(p.unsqueeze(0), k, delta)[0]
            assert set(mask.nonzero().flatten().tolist()) == _ref_topk_delta_set(p.tolist(), k, delta)


def test_topk_delta_ties_keep_every_tied_token() -> None:
    p = torch.tensor([[0.3, 0.3, 0.2, 0.2]])
    assert topk_delta_mask(p, 1, 0.0).tolist() == [[True, True, False, False]]
    assert topk_delta_mask(p, 3, 1.0).tolist() == [[True, True, True, True]]


def _greedy_block(plaus: torch.Tensor, draft: torch.Tensor):
    """One-position greedy block: p one-hot on the argmax of p̂ at both rows."""
    top = plaus.argmax(-1)
    target = _one_hot(top, V).unsqueeze(1).expand(-1, 2, V).float()
    return target, plaus.unsqueeze(1).float(), draft.unsqueeze(-1)


def test_topk_delta_greedy_is_tensorrt_llm_law_exactly() -> None:
    """Every draft token, every row: accept iff in S, else emit the top-1; E = 1 for a
    relaxed (non-argmax) accept and 0 otherwise."""
    gen = torch.Generator().manual_seed(1)
    rule = RuleConfig("topk_delta", relaxed_topk=4, relaxed_delta=0.3)
    plaus = _dist(gen, 20, sharp=1.0)
    for x in range(V):
        draft = torch.full((20,), x)
        target, plaus3, tokens = _greedy_block(plaus, draft)
        u = torch.rand(20, 1, generator=gen, dtype=torch.float64)
        res = verify_lossy(rule, target, plaus3, tokens, None, u,
                           torch.rand(20, generator=gen, dtype=torch.float64), greedy=True)
        for row in range(20):
            ref = _ref_topk_delta_set(plaus[row].tolist(), 4, 0.3)
            top = int(plaus[row].argmax())
            assert bool(res.num_accepted[row]) == (x in ref)
            if x not in ref:
                assert int(res.next_token[row]) == top
            assert float(res.deviation[row, 0]) == (1.0 if x in ref and x != top else 0.0)


def test_topk_delta_k1_at_greedy_is_sd_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(2)
    b, k = 64, 5
    plaus = _dist(gen, b * k).view(b, k, V).float()
    bonus = _one_hot(torch.zeros(b, 1, dtype=torch.long), V)
    target = torch.cat([_one_hot(plaus.argmax(-1), V), bonus], 1).float()
    tokens = torch.where(torch.rand(b, k, generator=gen) < 0.7, plaus.argmax(-1),
                         torch.randint(0, V, (b, k), generator=gen))
    u, s = _uniforms(gen, b, k)
    for delta in (0.0, 0.6):  # K = 1: S is the argmax alone, whatever δ
        res = verify_lossy(RuleConfig("topk_delta", relaxed_topk=1, relaxed_delta=delta),
                           target, plaus, tokens, None, u, s, greedy=True)
        ref = verify(RuleConfig(kind="exact"), target, plaus, tokens, None, u, s, greedy=True)
        assert torch.equal(res.num_accepted, ref.num_accepted) and torch.equal(res.next_token, ref.next_token)
        assert float(res.spent.max()) == 0.0


def _max_block(gen, n, p, plaus, x, rule, spent=None, mix=True):
    target = p.float().view(1, 1, V).expand(n, 2, V)
    relaxed = plaus.float().view(1, 1, V).expand(n, 1, V)
    tokens = torch.full((n, 1), x)
    return verify_lossy(rule, target, target[:, :1], tokens, None,
                        torch.rand(n, 1, generator=gen, dtype=torch.float64),
                        torch.rand(n, generator=gen, dtype=torch.float64), spent, greedy=False,
                        relaxed_probs=relaxed,
                        mix_uniforms=torch.rand(n, 1, generator=gen, dtype=torch.float64) if mix else None)


def _first(res, x: int) -> torch.Tensor:
    return torch.where(res.num_accepted > 0, torch.full_like(res.next_token, x), res.next_token)


def test_topk_delta_sampled_is_modular_max_verdict_with_exact_deviation() -> None:
    """λ = 1: a point mass on x (in S) or on the top-1 (not), E = 1 − p(y) = its TV."""
    gen = torch.Generator().manual_seed(3)
    rule = RuleConfig("topk_delta", relaxed_topk=3, relaxed_delta=0.6)
    for _ in range(10):
        plaus = _dist(gen, 1, sharp=1.0)[0]
        p = torch.softmax(torch.log(plaus) / 0.7, -1)  # a tempered target, same argmax
        for x in range(V):
            res = _max_block(gen, 50, p, plaus, x, rule)
            y = x if x in _ref_topk_delta_set(plaus.tolist(), 3, 0.6) else int(plaus.argmax())
            assert torch.all(_first(res, x) == y)
            tv = 0.5 * (_one_hot(torch.tensor(y), V) - p).abs().sum()
            expected = torch.full((50,), float(tv), dtype=torch.float64)
            assert torch.allclose(res.deviation[:, 0], expected, atol=1e-6)


def test_topk_delta_sampled_smooth_mixes_with_the_exact_law() -> None:
    """Budget remainder r < E: λ = r/E, law λ·δ_y + (1 − λ)·p, TV = λE (Monte Carlo)."""
    gen = torch.Generator().manual_seed(4)
    plaus = _dist(gen, 1, sharp=1.0)[0]
    p = plaus.clone()
    x = int(torch.argsort(plaus, descending=True)[1])  # second best: in S at K = 3, δ = 0.6
    e = 1.0 - float(p[x])
    rule = RuleConfig("topk_delta", relaxed_topk=3, relaxed_delta=0.6, budget=0.4 * e, smooth=True)
    n = 200_000
    res = _max_block(gen, n, p, plaus, x, rule)
    lam = 0.4
    law = lam * _one_hot(torch.tensor(x), V) + (1 - lam) * p
    freq = torch.bincount(_first(res, x), minlength=V).double() / n
    se = torch.sqrt(law * (1 - law) / n).clamp_min(1e-9)
    assert torch.all((freq - law).abs() <= 5 * se + 1e-9)
    assert float(res.deviation[0, 0]) == pytest.approx(lam * e, rel=1e-12)
    assert float(0.5 * (law - p).abs().sum()) == pytest.approx(lam * e, rel=1e-9)


def test_topk_delta_budget_zero_sampled_is_exact() -> None:
    gen = torch.Generator().manual_seed(5)
    plaus = _dist(gen, 1)[0]
    x = int(torch.argsort(plaus, descending=True)[1])
    n = 200_000
    res = _max_block(gen, n, plaus, plaus, x, RuleConfig("topk_delta", budget=0.0), mix=False)
    freq = torch.bincount(_first(res, x), minlength=V).double() / n
    se = torch.sqrt(plaus * (1 - plaus) / n).clamp_min(1e-9)
    assert torch.all((freq - plaus).abs() <= 5 * se + 1e-9)
    assert float(res.spent.max()) == 0.0


def test_topk_delta_refuses_sampled_drafts() -> None:
    p = torch.full((1, 2, V), 1.0 / V)
    with pytest.raises(NSDError, match="topk_delta"):
        verify_lossy(RuleConfig("topk_delta"), p, p[:, :1], torch.zeros(1, 1, dtype=torch.long),
                     p[:, :1], torch.zeros(1, 1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
                     greedy=True)


def test_topk_delta_inputs_only_where_max_reads_them_and_mix_drawn_last() -> None:
    """The untempered softmax only for a relaxing top-K/δ at T > 0; the mix uniforms only
    with smooth, as the generator's next draws (so other rules' streams stay unchanged)."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(6)) * 3.0
    sampled, greedy = SamplingConfig(temperature=0.5, top_k=2), SamplingConfig()
    for rule, sampling in ((RuleConfig("nucleus", theta=0.9), sampled), (RuleConfig("topk_delta"), greedy),
                           (RuleConfig("topk_delta", budget=0.0, smooth=True), sampled)):
        gen = torch.Generator().manual_seed(1)
        state = gen.get_state()
        assert topk_delta_inputs(rule, sampling, logits, gen) == (None, None)
        assert torch.equal(gen.get_state(), state)  # nothing drawn
    relaxed, mix = topk_delta_inputs(RuleConfig("topk_delta"), sampled, logits, torch.Generator())
    # Temperature and top-k do not touch MAX's ranking law: the plain softmax of the logits.
    assert mix is None and torch.allclose(relaxed[0], torch.softmax(logits, -1))
    relaxed, mix = topk_delta_inputs(RuleConfig("topk_delta", smooth=True), sampled, logits,
                                     torch.Generator().manual_seed(2))
    expected = torch.rand(1, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert relaxed.shape == (1, 3, V) and torch.equal(mix, expected)


# --------------------------------------------------------------------------- SGLang thresholds


@pytest.mark.parametrize("single, acc", [(1.0, 1.0), (0.3, 1.0), (1.0, 0.5), (0.4, 0.2), (0.0, 1.0)])
def test_threshold_weight_gives_sglang_acceptance_and_exact_tv(single: float, acc: float) -> None:
    gen = torch.Generator().manual_seed(6)
    for p in _dist(gen, 30, sharp=1.5):
        w = threshold_weights(p, single, acc)
        for x in range(V):
            px = float(p[x])
            a = px + float(w[x]) * (1 - px)
            assert a == pytest.approx(_ref_sglang_accept_prob(px, single, acc), abs=1e-12)
            # Closed-form law of one position: x w.p. a, else p without x.
            rest = p.clone()
            rest[x] = 0
            law = (1 - a) * rest / rest.sum() if rest.sum() > 0 else torch.zeros_like(p)
            law[x] = a
            tv = 0.5 * float((law - p).abs().sum())
            assert tv == pytest.approx(float(w[x]) * (1 - px), abs=1e-12)  # E = w(x)(1 − p(x))
        # The general-q formula E = Σ w (q − p)₊ is nsd's: check it against the closed form.
        q = _dist(gen, 1)[0]
        m = torch.clamp(p / q, max=1.0)
        acc_prob = m + w * (1 - m)
        resid = (p - q).clamp_min(0)
        law = q * acc_prob + (1 - (q * acc_prob).sum()) * resid / resid.sum()
        excess = float((w * (q - p).clamp_min(0)).sum())
        assert 0.5 * float((law - p).abs().sum()) == pytest.approx(excess, abs=1e-12)


@pytest.mark.parametrize("single, acc", [(0.3, 1.0), (1.0, 0.5), (0.4, 0.2)])
def test_threshold_decisions_are_sglang_coin_test_on_a_grid(single: float, acc: float) -> None:
    """Every draft token × a grid of uniforms: accept iff u < a(x), SGLang's condition."""
    gen = torch.Generator().manual_seed(16)
    rule = RuleConfig("threshold", threshold_single=single, threshold_acc=acc)
    grid = torch.linspace(0.0, 0.999, 200, dtype=torch.float64)
    for p in _dist(gen, 5, sharp=1.5):
        n = V * grid.numel()
        tokens = torch.arange(V).repeat_interleave(grid.numel()).unsqueeze(-1)  # [n, 1]
        u = grid.repeat(V).unsqueeze(-1)
        target = p.float().view(1, 1, V).expand(n, 2, V)
        res = verify_lossy(rule, target, target[:, :1], tokens, None, u, torch.zeros(n, dtype=torch.float64))
        p32 = p.float()
        a = torch.tensor([_ref_sglang_accept_prob(float(p32[int(x)]), single, acc) for x in tokens[:, 0]],
                         dtype=torch.float64)
        clear = (u[:, 0] - a).abs() > 1e-6  # boundary ties are measure-zero conventions
        assert torch.equal((res.num_accepted > 0)[clear], (u[:, 0] < a)[clear])


def test_threshold_sampler_matches_the_closed_form() -> None:
    gen = torch.Generator().manual_seed(7)
    p = _dist(gen, 1)[0]
    x = int(torch.argsort(p, descending=True)[2])
    rule = RuleConfig("threshold", threshold_single=0.9, threshold_acc=0.5)
    n = 200_000
    target = p.float().view(1, 1, V).expand(n, 2, V)
    res = verify_lossy(rule, target, target[:, :1], torch.full((n, 1), x), None,
                       torch.rand(n, 1, generator=gen, dtype=torch.float64),
                       torch.rand(n, generator=gen, dtype=torch.float64), greedy=False)
    a = _ref_sglang_accept_prob(float(p[x]), 0.9, 0.5)
    rest = p.clone()
    rest[x] = 0
    law = (1 - a) * rest / rest.sum()
    law[x] = a
    freq = torch.bincount(_first(res, x), minlength=V).double() / n
    se = torch.sqrt(law * (1 - law) / n).clamp_min(1e-9)
    assert torch.all((freq - law).abs() <= 5 * se + 1e-9)
    assert float(res.deviation[0, 0]) == pytest.approx(a - float(p[x]), abs=1e-7)


def test_thresholds_at_one_are_sd_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(8)
    b, k = 64, 4
    p = _dist(gen, b * (k + 1)).view(b, k + 1, V).float()
    tokens = torch.randint(0, V, (b, k), generator=gen)
    u, s = _uniforms(gen, b, k)
    res = verify_lossy(RuleConfig("threshold"), p, p[:, :k], tokens, None, u, s)
    ref = verify(RuleConfig(kind="exact"), p, p[:, :k], tokens, None, u, s)
    assert torch.equal(res.num_accepted, ref.num_accepted) and torch.equal(res.next_token, ref.next_token)
    assert float(res.spent.max()) == 0.0


def test_threshold_refuses_greedy_and_sampled_drafts() -> None:
    p = torch.full((1, 2, V), 1.0 / V)
    args = (torch.zeros(1, 1, dtype=torch.long),)
    z = (torch.zeros(1, 1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    rule = RuleConfig("threshold", threshold_acc=0.5)
    with pytest.raises(NSDError, match="threshold: .*temperature > 0"):
        verify_lossy(rule, p, p[:, :1], *args, None, *z, greedy=True)
    with pytest.raises(NSDError, match="threshold: .*argmax"):
        verify_lossy(rule, p, p[:, :1], *args, p[:, :1], *z)
    with pytest.raises(NSDError, match="not a set-based rule"):
        relaxed_weights(RuleConfig("fly"), p)


# --------------------------------------------------------------------------- FLy


def test_fly_entropy_is_top_k_without_renormalising() -> None:
    p = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    ref = -(0.5 * math.log(0.5) + 0.25 * math.log(0.25) + 0.125 * math.log(0.125))
    assert float(fly_entropy(p, 3)[0]) == pytest.approx(ref, rel=1e-6)
    assert float(fly_entropy(p, 1)[0]) == pytest.approx(-0.5 * math.log(0.5), rel=1e-6)


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("window", [1, 2, 3])
def test_fly_decisions_match_vllm_prepass(greedy: bool, window: int) -> None:
    gen = torch.Generator().manual_seed(9 + window)
    b, k = 400, 6
    plaus = _dist(gen, b * k, sharp=0.8).view(b, k, V)
    if greedy:
        target = torch.cat([_one_hot(plaus.argmax(-1), V), _dist(gen, b).view(b, 1, V)], 1)
        tokens = torch.where(torch.rand(b, k, generator=gen) < 0.6, plaus.argmax(-1),
                             torch.randint(0, V, (b, k), generator=gen))
        q = None
    else:
        target = torch.cat([plaus, _dist(gen, b).view(b, 1, V)], 1)
        q = _dist(gen, b * k, sharp=0.8).view(b, k, V)
        tokens = torch.multinomial(q.view(-1, V), 1, generator=gen).view(b, k)
    u = torch.rand(b, k, generator=gen, dtype=torch.float64)
    rule = RuleConfig("fly", fly_window_size=window, fly_entropy_threshold=0.8)
    res = verify_lossy(rule, target.float(), plaus.float(), tokens, None if q is None else q.float(), u,
                       torch.rand(b, generator=gen, dtype=torch.float64), greedy=greedy)
    ent = fly_entropy(plaus.float(), 3)
    deferred = 0
    for row in range(b):
        native, gate = [], []
        for t in range(k):
            x = int(tokens[row, t])
            px = float(target[row, t, x])
            qx = 1.0 if q is None else float(q[row, t, x])
            native.append(float(u[row, t]) < min(1.0, px / qx))
            gate.append(float(ent[row, t]) >= 0.8 and float(plaus[row, t, x]) > 0)
        ref = _ref_fly_accepts(native, gate, window)
        lead = next((t for t, ok in enumerate(ref) if not ok), k)
        assert int(res.num_accepted[row]) == lead
        deferred += sum(1 for t in range(lead) if not native[t])
        if greedy:  # one deferral = deviation 1 exactly, as nsd's greedy relaxed accept
            assert float(res.spent[row]) == sum(1 for t in range(lead) if not native[t])
    assert deferred >= 10  # the rule did act


def test_fly_infinite_threshold_is_sd_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(12)
    b, k = 64, 6
    p = _dist(gen, b * (k + 1), sharp=0.5).view(b, k + 1, V).float()
    q = _dist(gen, b * k, sharp=0.5).view(b, k, V).float()
    tokens = torch.multinomial(q.view(-1, V), 1, generator=gen).view(b, k)
    u, s = _uniforms(gen, b, k)
    rule = RuleConfig("fly", fly_window_size=1, fly_entropy_threshold=math.inf)
    res = verify_lossy(rule, p, p[:, :k], tokens, q, u, s)
    ref = verify(RuleConfig(kind="exact"), p, p[:, :k], tokens, q, u, s)
    assert torch.equal(res.num_accepted, ref.num_accepted) and torch.equal(res.next_token, ref.next_token)
    assert float(res.spent.max()) == 0.0
    on = verify_lossy(RuleConfig("fly", fly_window_size=1, fly_entropy_threshold=0.0),
                      p, p[:, :k], tokens, q, u, s)
    assert bool((on.num_accepted > ref.num_accepted).any())  # and at 0 it defers


def _fly_block_law(rule, p_mat, q_mat, k):
    """Exact law of the first k+1 tokens: one FLy block, then exact target sampling.

    Toy Markov chain on V3 tokens (start token 0). Drafts are enumerated with their
    q-probability and native accept bits with probability m or 1 − m (the uniform is
    placed inside the matching interval); the recovered/bonus token with its law.
    Returns (law [V3]*(k+1), target law, E[D])."""
    v = p_mat.shape[0]
    target_seq = torch.zeros([v] * (k + 1), dtype=torch.float64)
    for seq in itertools.product(range(v), repeat=k + 1):
        prob, prev = 1.0, 0
        for y in seq:
            prob *= float(p_mat[prev, y])
            prev = y
        target_seq[seq] = prob
    law = torch.zeros_like(target_seq)
    expected_d = 0.0
    for drafts in itertools.product(range(v), repeat=k):
        prevs = (0,) + drafts
        q_rows = torch.stack([q_mat[prevs[t]] for t in range(k)])  # [k, V3]
        w_draft = math.prod(float(q_rows[t, drafts[t]]) for t in range(k))
        if w_draft == 0:
            continue
        p_rows = torch.stack([p_mat[prevs[t]] for t in range(k + 1)])  # [k+1, V3]
        m = [min(1.0, float(p_rows[t, drafts[t]]) / float(q_rows[t, drafts[t]])) for t in range(k)]
        for bits in itertools.product([True, False], repeat=k):
            w = w_draft * math.prod(m[t] if bits[t] else 1 - m[t] for t in range(k))
            if w == 0:
                continue
            inside = [m[t] / 2 if bits[t] else (1 + m[t]) / 2 for t in range(k)]  # u in the bit's interval
            u = torch.tensor([inside], dtype=torch.float64)
            plaus = p_rows[:k].unsqueeze(0)  # sampled verification: p̂ = p
            res = verify_lossy(rule, p_rows.unsqueeze(0), plaus, torch.tensor([drafts]),
                               q_rows.unsqueeze(0), u, torch.zeros(1, dtype=torch.float64))
            j = int(res.num_accepted[0])
            expected_d += w * float(res.spent[0])
            if j < k:
                resid = (p_rows[j] - q_rows[j]).clamp_min(0)
                nxt = resid / resid.sum()
            else:
                nxt = p_rows[k]
            for y in range(v):
                if nxt[y] == 0:
                    continue
                head = drafts[:j] + (y,)
                for tail in itertools.product(range(v), repeat=k - j):
                    prob, prev = w * float(nxt[y]), y
                    for z in tail:
                        prob *= float(p_mat[prev, z])
                        prev = z
                    law[head + tail] += prob
    return law, target_seq, expected_d


@pytest.mark.parametrize("threshold", [0.0, 0.9])  # every row gated in / one row out
def test_fly_sequence_tv_is_bounded_by_expected_d(threshold: float) -> None:
    """The derived bound TV(FLy, target) ≤ E[D], exactly, on a toy chain; and the
    harness itself reproduces the target exactly when FLy is off. (Seed 13 measured:
    θ = 0: TV 0.347 ≤ E[D] 0.510; θ = 0.9, one deferral site: TV = E[D] = 0.0863.)"""
    gen = torch.Generator().manual_seed(13)
    v3, k = 3, 3
    p_mat = _dist(gen, v3, v=v3, sharp=0.7)
    q_mat = _dist(gen, v3, v=v3, sharp=0.7)
    off = RuleConfig("fly", fly_window_size=1, fly_entropy_threshold=math.inf)
    law, target, d = _fly_block_law(off, p_mat, q_mat, k)
    assert float(law.sum()) == pytest.approx(1.0, abs=1e-12)
    assert 0.5 * float((law - target).abs().sum()) < 1e-12 and d == 0.0
    on = RuleConfig("fly", fly_window_size=1, fly_entropy_threshold=threshold)
    law, target, d = _fly_block_law(on, p_mat, q_mat, k)
    tv = 0.5 * float((law - target).abs().sum())
    assert tv > 1e-3  # FLy moved the law: the bound is tested, not vacuous
    assert tv <= d + 1e-12


def test_smooth_acts_on_the_set_rules_not_on_fly() -> None:
    # A deferral is all or nothing: --smooth does not act on fly (the one acts-on check in
    # nsd.options makes the front ends refuse or note it), and its budget stays hard.
    assert not optspec.ALL["smooth"].acts_on(["fly"])
    assert optspec.ALL["smooth"].acts_on(["threshold"]) and optspec.ALL["smooth"].acts_on(["topk_delta"])
    assert RuleConfig("threshold", smooth=True).smooth
    assert RuleConfig("topk_delta", smooth=True).smooth


# --------------------------------------------------------------------------- budgets


@pytest.mark.parametrize("kind, greedy", [("topk_delta", True), ("topk_delta", False),
                                          ("threshold", False), ("fly", False), ("fly", True)])
@pytest.mark.parametrize("smooth", [False, True])
def test_budget_never_exceeded_on_any_path(kind: str, greedy: bool, smooth: bool) -> None:
    # fly with smooth: the flag does not act on fly, and D <= B must hold regardless.
    gen = torch.Generator().manual_seed(14)
    b, k, budget = 256, 5, 1.3
    knobs = {"topk_delta": {}, "threshold": {"threshold_single": 0.3, "threshold_acc": 0.4},
             "fly": {"fly_window_size": 1, "fly_entropy_threshold": 0.0}}[kind]
    rule = RuleConfig(kind, budget=budget, smooth=smooth, **knobs)
    spent = torch.zeros(b, dtype=torch.float64)
    for _ in range(12):
        plaus = _dist(gen, b * k, sharp=1.0).view(b, k, V)
        if greedy:
            target = torch.cat([_one_hot(plaus.argmax(-1), V), _dist(gen, b).view(b, 1, V)], 1)
        else:
            target = torch.cat([plaus, _dist(gen, b).view(b, 1, V)], 1)
        tokens = torch.randint(0, V, (b, k), generator=gen)
        res = verify_lossy(rule, target.float(), plaus.float(), tokens, None,
                           torch.rand(b, k, generator=gen, dtype=torch.float64),
                           torch.rand(b, generator=gen, dtype=torch.float64), spent, greedy=greedy,
                           relaxed_probs=plaus.float(),
                           mix_uniforms=torch.rand(b, k, generator=gen, dtype=torch.float64))
        assert torch.all(res.deviation >= 0)
        spent = res.spent
        assert float(spent.max()) <= budget  # the float total itself, every path
    assert float(spent.max()) > 0.5  # the rule spent budget


def test_fly_budget_gates_on_cost_without_the_window() -> None:
    """A position's opening must not read later uniforms through the budget.

    Position 0 (flat target) costs the whole budget; position 1 is confident (gated out)
    and its uniform decides 0's window. Position 2's opening must be the same either way:
    closed, since the budget scan charged position 0 whatever its window said."""
    b, k = 1, 4
    flat = torch.full((V,), 1.0 / V, dtype=torch.float64)
    sure = torch.full((V,), 0.01 / (V - 1), dtype=torch.float64)
    sure[0] = 0.99
    plaus = torch.stack([flat, sure, flat, flat]).unsqueeze(0)  # [1, 4, V]
    target = torch.cat([plaus, plaus[:, :1]], 1)
    tokens = torch.zeros(b, k, dtype=torch.long)
    rule = RuleConfig("fly", fly_window_size=1, fly_entropy_threshold=0.5, budget=1.0 - 1.0 / V)
    outs = []
    for u1 in (0.01, 0.995):  # position 1 natively accepts / rejects
        u = torch.tensor([[0.99, u1, 0.99, 0.01]], dtype=torch.float64)
        opened, _ = fly_deferrals(rule, target, plaus, tokens, None, u, torch.zeros(b, dtype=torch.float64))
        outs.append(bool(opened[0, 2]))
    assert outs == [False, False]
    free = RuleConfig("fly", fly_window_size=1, fly_entropy_threshold=0.5)
    opened, _ = fly_deferrals(free, target, plaus, tokens, None, u, torch.zeros(b, dtype=torch.float64))
    assert bool(opened[0, 2])  # without a budget it would open: the budget is what closed it


def test_lossy_config_checks_knobs_with_the_option_words() -> None:
    with pytest.raises(NSDError, match="relaxed_topk must be a whole number >= 1"):
        RuleConfig("topk_delta", relaxed_topk=0)
    with pytest.raises(NSDError, match="threshold_acc must be"):
        RuleConfig("threshold", threshold_acc=0.0)
    with pytest.raises(NSDError, match="unknown verification rule 'mtp'.*topk_delta, threshold, fly"):
        RuleConfig("mtp")
    assert not RuleConfig("threshold").relaxes
    assert RuleConfig("threshold", threshold_acc=0.9).relaxes
    assert not RuleConfig("fly", fly_entropy_threshold=math.inf).relaxes
    assert not RuleConfig("topk_delta", budget=0.0).relaxes
