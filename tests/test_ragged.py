"""nsd's rule on vLLM's flattened ragged layout, without vLLM.

The stock behaviour is pinned by ``vllm_stock_reference`` (a per-token reference written
from vLLM 0.32's source); ``tests/in_vllm/`` repeats the equivalence check against the real
stock function when vLLM is installed.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from nsd.integrations.vllm.ledger import FidelityLedger
from nsd.integrations.vllm.sampler import nsd_rejection_sample
from nsd.rules.ragged import padded_token_index, verify_ragged
from nsd.rules.entry import verify
from nsd.rules.verify import RuleConfig, relaxed_set_mask
from vllm_stock_reference import stock_rejection_sample

EXACT = RuleConfig(kind="exact")
NOTHING_RELAXED = (EXACT, RuleConfig(kind="nucleus", theta=0.0),
                   RuleConfig(kind="nucleus", theta=0.9, budget=0.0),
                   RuleConfig(kind="nucleus", theta=0.9, budget=0.0, smooth=True))


def ragged_case(seed: int, mode: str, with_q: bool, batch: int = 12, max_k: int = 5,
                vocab: int = 32, padded_draft: bool = True) -> dict:
    """A random ragged batch in vLLM's layout; some requests seeded, some without drafts."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, max_k + 1, (batch,), generator=gen).tolist()
    counts[0] = max_k
    num_tokens = sum(counts)
    logits = 3.0 * torch.randn(num_tokens, vocab, generator=gen)
    q = None
    if with_q:
        q = torch.softmax(logits + 2.0 * torch.randn(num_tokens, vocab, generator=gen), -1)
        drafts = torch.multinomial(q, 1, generator=gen).squeeze(-1)
    else:
        # Deterministic proposals: often the argmax, otherwise a likely token.
        top2 = logits.topk(2, dim=-1).indices
        drafts = top2[torch.arange(num_tokens), torch.randint(0, 2, (num_tokens,), generator=gen)]
    if padded_draft and num_tokens > 3:
        drafts[3] = -1  # a padded draft, which the engine must reject
    if mode == "greedy":
        greedy = [True] * batch
    elif mode == "random":
        greedy = [False] * batch
    else:
        greedy = (torch.rand(batch, generator=gen) < 0.5).tolist()
        greedy[0], greedy[1] = True, False
    return dict(
        draft_token_ids=drafts.to(torch.int32),
        num_draft_tokens=counts,
        max_spec_len=max_k,
        cu_num_draft_tokens=torch.tensor(counts).cumsum(0).to(torch.int32),
        draft_probs=q,
        target_logits=logits,
        bonus_token_ids=torch.randint(0, vocab, (batch, 1), generator=gen),
        greedy=greedy,
        seeded={b: 1000 + b for b in range(batch) if b % 3 == 1},
    )


def metadata(case: dict) -> SimpleNamespace:
    greedy = case["greedy"]
    return SimpleNamespace(
        all_greedy=all(greedy), all_random=not any(greedy),
        temperature=torch.tensor([0.0 if g else 0.8 for g in greedy]),
        generators={b: torch.Generator().manual_seed(s) for b, s in case["seeded"].items()},
    )


def run_nsd(rule: RuleConfig, case: dict, seed: int, spent: torch.Tensor | None = None,
            meta: SimpleNamespace | None = None, float32_uniforms: bool = False):
    meta = meta or metadata(case)
    torch.manual_seed(seed)
    return nsd_rejection_sample(rule, case["draft_token_ids"], case["num_draft_tokens"],
                                case["max_spec_len"], case["cu_num_draft_tokens"], case["draft_probs"],
                                case["target_logits"].clone(), case["bonus_token_ids"], meta, spent,
                                float32_uniforms=float32_uniforms)


def run_reference(case: dict, seed: int, float32_uniforms: bool = False) -> torch.Tensor:
    torch.manual_seed(seed)
    return stock_rejection_sample(case["draft_token_ids"], case["num_draft_tokens"], case["max_spec_len"],
                                  case["draft_probs"], case["target_logits"].clone(),
                                  case["bonus_token_ids"], case["greedy"], metadata(case).generators,
                                  float32_uniforms)


@pytest.mark.parametrize("mode", ["greedy", "random", "mixed"])
@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("f32", [False, True], ids=["gpu-uniforms", "cpu-uniforms"])
def test_rules_that_relax_nothing_equal_the_stock_rule_bit_for_bit(mode: str, with_q: bool, f32: bool) -> None:
    relaxed_more = 0
    for trial in range(6):
        case = ragged_case(10 * trial + 1, mode, with_q)
        ref = run_reference(case, seed=trial, float32_uniforms=f32)
        for rule in NOTHING_RELAXED:
            res = run_nsd(rule, case, seed=trial, float32_uniforms=f32)
            assert res.output_token_ids.dtype == torch.int32
            assert torch.equal(res.output_token_ids, ref), (rule, res.output_token_ids, ref)
            assert torch.all(res.deviation == 0) and not res.relaxed.any()
        nsd = run_nsd(RuleConfig(kind="nucleus", theta=0.9), case, seed=trial)
        relaxed_more += int(nsd.relaxed.sum())
    # NSD accepts more than stock on the same inputs (the cases have likely non-argmax drafts).
    assert relaxed_more > 0


def test_padded_index_covers_each_request_once() -> None:
    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)
    index, valid = padded_token_index(cu, 3, 6)
    assert index.tolist() == [[0, 1, 6], [6, 6, 6], [2, 3, 4], [5, 6, 6]]
    assert valid.sum().item() == 6


def _single_position_batch(p: torch.Tensor, q: torch.Tensor | None, x_fixed: int | None, n: int, gen):
    """n requests, one draft each, all with target p and draft q (or a fixed one-hot draft)."""
    vocab = p.shape[0]
    logits = p.log().float().expand(n, vocab).contiguous()
    if q is None:
        drafts = torch.full((n,), x_fixed, dtype=torch.int32)
        draft_probs = None
    else:
        drafts = torch.multinomial(q.float(), n, replacement=True, generator=gen).to(torch.int32)
        draft_probs = q.float().expand(n, vocab).contiguous()
    return dict(draft_token_ids=drafts, num_draft_tokens=[1] * n, max_spec_len=1,
                cu_num_draft_tokens=torch.arange(1, n + 1, dtype=torch.int32), draft_probs=draft_probs,
                target_logits=logits, bonus_token_ids=torch.zeros(n, 1, dtype=torch.int64),
                greedy=[False] * n, seeded={})


@pytest.mark.parametrize("theta", [0.5, 0.9])
def test_single_position_output_has_tv_e_and_acceptance_alpha_plus_e(theta: float) -> None:
    gen = torch.Generator().manual_seed(3)
    vocab, n = 8, 200_000
    # The draft over-weights the second token (inside both nuclei) and the fifth (inside
    # N_0.9 only), so E is 0.15 at θ = 0.5 and 0.19 at θ = 0.9.
    p = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.06, 0.04, 0.03, 0.02], dtype=torch.float64)
    q = torch.tensor([0.2, 0.4, 0.1, 0.05, 0.1, 0.05, 0.05, 0.05], dtype=torch.float64)
    case = _single_position_batch(p, q, None, n, gen)
    p32 = case["target_logits"][0].softmax(-1).double()  # p as the engine computes it
    rule = RuleConfig(kind="nucleus", theta=theta)
    mask = relaxed_set_mask(p32.float().unsqueeze(0), rule)[0]
    excess = ((q - p32).clamp_min(0) * mask).sum().item()
    assert excess > 0.02  # the case must actually relax something
    res = run_nsd(rule, case, seed=4)
    first = res.output_token_ids[:, 0].long()
    freq = torch.bincount(first, minlength=vocab).double() / n
    # Empirical TV of a V=8 histogram: its noise is about sqrt(V / n) / 2 ≈ 0.003 here.
    assert 0.5 * (freq - p32).abs().sum().item() == pytest.approx(excess, abs=0.01)
    alpha = torch.minimum(p32, q).sum().item()
    acc = res.num_accepted.double().mean().item()
    assert acc == pytest.approx(alpha + excess, abs=5 * math.sqrt(0.25 / n))
    assert torch.allclose(res.deviation[:, 0], torch.full((n,), excess, dtype=torch.float64), atol=1e-6)
    # The exact rule on the same draws reproduces p.
    exact = run_nsd(EXACT, case, seed=4)
    freq = torch.bincount(exact.output_token_ids[:, 0].long(), minlength=vocab).double() / n
    se = torch.sqrt(p32 * (1 - p32) / n)
    assert torch.all((freq - p32).abs() <= 5 * se + 1e-4)


def test_deterministic_draft_is_accepted_in_the_nucleus_and_charged_one_minus_p() -> None:
    gen = torch.Generator().manual_seed(8)
    p = torch.softmax(2.0 * torch.randn(8, generator=gen, dtype=torch.float64), -1)
    x = int(torch.argsort(p, descending=True)[1])
    case = _single_position_batch(p, None, x, 50_000, gen)
    p_x = case["target_logits"][0].softmax(-1)[x].item()
    exact = run_nsd(EXACT, case, seed=1)
    assert exact.num_accepted.double().mean().item() == pytest.approx(p_x, abs=0.01)
    nsd = run_nsd(RuleConfig(kind="nucleus", theta=0.9), case, seed=1)
    assert torch.all(nsd.num_accepted == 1)
    assert torch.allclose(nsd.deviation[:, 0], torch.full_like(nsd.deviation[:, 0], 1 - p_x), atol=1e-6)


def test_greedy_accepts_nucleus_tokens_and_emits_argmax_on_rejection() -> None:
    case = dict(draft_token_ids=torch.tensor([1, 0], dtype=torch.int32), num_draft_tokens=[2],
                max_spec_len=2, cu_num_draft_tokens=torch.tensor([2], dtype=torch.int32), draft_probs=None,
                target_logits=torch.tensor([[3.0, 2.8, -5.0, -5.0], [2.0, -1.0, -5.0, -5.0]]),
                bonus_token_ids=torch.tensor([[3]]), greedy=[True], seeded={})
    assert run_nsd(EXACT, case, 0).output_token_ids.tolist() == [[0, -1, -1]]
    nsd = run_nsd(RuleConfig(kind="nucleus", theta=0.9), case, 0)
    assert nsd.output_token_ids.tolist() == [[1, 0, 3]]
    assert nsd.deviation.tolist() == [[1.0, 0.0]] and nsd.relaxed.tolist() == [[True, False]]
    tight = run_nsd(RuleConfig(kind="nucleus", theta=0.9, budget=0.5), case, 0)
    assert tight.output_token_ids.tolist() == [[0, -1, -1]] and tight.spent.item() == 0.0


@pytest.mark.parametrize("mode", ["greedy", "mixed"])
def test_budget_is_never_exceeded_across_steps(mode: str) -> None:
    budget = 1.5
    rule = RuleConfig(kind="nucleus", theta=0.95, budget=budget)
    spent = None
    for step in range(20):
        case = ragged_case(500 + step, mode, with_q=(step % 2 == 0))
        res = run_nsd(rule, case, seed=step, spent=spent)
        spent = res.spent
        assert torch.all(spent <= budget)
    assert spent.max() > 0.5 * budget  # the budget is actually used


@pytest.mark.parametrize("smooth", [False, True])
def test_budget_holds_exactly_on_the_vllm_path_and_in_its_ledger(smooth: bool) -> None:
    # 500 engine steps of 12 requests (6,000 request-steps), each request living a few
    # steps, its D carried by the plugin's ledger from step to step as in the engine. B =
    # 0.3 is where a pairwise sum of the step's charges rounds to 0.30000000000000004; the
    # smooth rule spends every budget down to B exactly, so it meets that rounding often.
    # No tolerance: D ≤ B for the number the adapter returns and for the ledger's D, and the
    # two are the same float.
    budget = 0.3
    rule = RuleConfig(kind="nucleus", theta=0.95, budget=budget, smooth=smooth)
    ledger = FidelityLedger(log_requests=False)
    batch, steps = 12, 500
    lifetime = [2 + b % 4 for b in range(batch)]
    exhausted, near = 0, 0
    for step in range(steps):
        case = ragged_case(20_000 + step, "random", with_q=step % 3 != 0, batch=batch, padded_draft=False)
        req_ids = [f"r{b}-{step // lifetime[b]}" for b in range(batch)]
        spent = ledger.spent(req_ids, torch.device("cpu"))
        res = run_nsd(rule, case, seed=step, spent=spent)
        assert torch.all(res.spent <= budget), res.spent.max().item()
        ledger.record(req_ids, case["num_draft_tokens"], res.output_token_ids, res, step=step)
        folded = ledger.spent(req_ids, torch.device("cpu"))
        assert torch.all(folded <= budget), folded.max().item()
        assert torch.equal(folded, res.spent)
        exhausted += int((res.spent == budget).sum())
        near += int((res.spent > 0.9 * budget).sum())
        ended = {r for b, r in enumerate(req_ids) if (step + 1) // lifetime[b] != step // lifetime[b]}
        ledger.finish(ended)
    assert near > 300  # budgets really are spent ...
    if smooth:
        assert exhausted > 3000  # ... to the last bit


@pytest.mark.parametrize("smooth", [False, True])
def test_greedy_decisions_agree_between_local_and_vllm_paths(smooth: bool) -> None:
    # Identical greedy inputs to the local decoder's rule (nsd.rules.entry.verify, p one-hot, p̂ the
    # temperature-1 softmax) and to the ragged/vLLM adapter. Budgets 1.5 and 2.5 with spent
    # 0–1.2 leave remainders below one relaxed accept's E = 1: the smooth rule must still
    # relax all-or-nothing on both paths, so the accept never depends on the uniform.
    gen = torch.Generator().manual_seed(31)
    batch, k, vocab = 400, 5, 12
    logits = 1.5 * torch.randn(batch, k + 1, vocab, generator=gen)
    plaus = torch.softmax(logits, dim=-1)
    argmax = logits.argmax(dim=-1)  # [B, k+1]
    one_hot = torch.nn.functional.one_hot(argmax, vocab).float()
    top3 = logits[:, :k].topk(3, dim=-1).indices
    drafts = top3.gather(-1, torch.randint(0, 3, (batch, k, 1), generator=gen)).squeeze(-1)
    spent = torch.tensor([0.0, 0.3, 0.5, 0.7, 1.2], dtype=torch.float64).repeat(batch // 5)
    uniforms = torch.rand(batch, k, generator=gen, dtype=torch.float64)
    partial_remainders = 0
    for budget in (1.5, 2.5):
        rule = RuleConfig(kind="nucleus", theta=0.95, budget=budget, smooth=smooth)
        local = verify(rule, one_hot, plaus[:, :k], drafts, None, uniforms,
                       torch.rand(batch, generator=gen, dtype=torch.float64), spent, greedy=True)
        ragged = verify_ragged(
            rule, plaus[:, :k].reshape(-1, vocab), argmax[:, :k].reshape(-1), drafts.reshape(-1).to(torch.int32),
            torch.full((batch,), k).cumsum(0).to(torch.int32), k, None, argmax[:, k], torch.ones(batch, dtype=torch.bool),
            uniforms.reshape(-1), None, spent)
        assert torch.equal(local.num_accepted, ragged.num_accepted)
        assert torch.equal(local.relaxed, ragged.relaxed)
        assert torch.equal(local.deviation, ragged.deviation)
        assert torch.equal(local.spent, ragged.spent) and torch.all(local.spent <= budget)
        local_out = torch.full((batch, k + 1), -1, dtype=torch.int64)
        for b in range(batch):  # the engine's layout: accepted drafts, then recovered/bonus
            n = int(local.num_accepted[b])
            local_out[b, :n] = drafts[b, :n]
            local_out[b, n] = local.next_token[b]
        assert torch.equal(local_out, ragged.output_token_ids.long())
        assert torch.all((local.deviation == 0) | (local.deviation == 1))  # never a fraction of E
        partial_remainders += int((local.relaxed.sum(-1) > 0).sum())
    assert partial_remainders > 100  # the relaxation is actually exercised


def test_no_tensor_is_created_on_the_default_device() -> None:
    # With the default device set to "meta", any factory call that forgets `device=` would
    # make a meta tensor and the first op mixing it with the CPU inputs would fail.
    case = ragged_case(7, "mixed", with_q=True)
    expected = run_nsd(RuleConfig(kind="nucleus", theta=0.9, budget=2.0), case, seed=3)
    meta = metadata(case)
    spent = torch.zeros(12, dtype=torch.float64)
    with torch.device("meta"):
        res = run_nsd(RuleConfig(kind="nucleus", theta=0.9, budget=2.0), case, seed=3, spent=spent, meta=meta)
    assert res.output_token_ids.device.type == "cpu"
    assert torch.equal(res.output_token_ids, expected.output_token_ids)


def test_one_hot_q_is_exact_at_theta_zero_for_a_deterministic_drafter() -> None:
    """draft_sample_method="greedy": vLLM's drafter proposes its argmax, so q is one-hot and
    the exact rule (θ = 0) reproduces p: accept with p(x), else draw from p without x."""
    gen = torch.Generator().manual_seed(21)
    p = torch.softmax(1.5 * torch.randn(8, generator=gen, dtype=torch.float64), -1)
    x = int(torch.argsort(p, descending=True)[2])
    n = 200_000
    case = _single_position_batch(p, None, x, n, gen)
    p32 = case["target_logits"][0].softmax(-1).double()
    se = torch.sqrt(p32 * (1 - p32) / n)
    for rule in NOTHING_RELAXED:
        res = run_nsd(rule, case, seed=2)
        freq = torch.bincount(res.output_token_ids[:, 0].long(), minlength=8).double() / n
        assert torch.all((freq - p32).abs() <= 5 * se + 1e-4), rule


def test_one_hot_q_is_exact_for_any_drafter_and_charges_at_least_the_true_e() -> None:
    """Verifying as one-hot treats the draft as a fixed guess: given x, the exact rule emits
    x with p(x), else a draw from p without x, which is p whatever drew x. So θ = 0 is exact
    even for drafts sampled from a spread q; acceptance falls from Σ min(p, q) to Σ q·p, and
    the charge E = 1[x∈S]·(1 − p(x)) bounds the step's deviation given x, which on average
    is at least the E computed with the true q (D is conservative, the budget still holds)."""
    gen = torch.Generator().manual_seed(5)
    p = torch.tensor([0.5, 0.3, 0.1, 0.1], dtype=torch.float64)
    q = torch.tensor([0.1, 0.4, 0.4, 0.1], dtype=torch.float64)
    n = 200_000
    case = _single_position_batch(p, q, None, n, gen)
    p32 = case["target_logits"][0].softmax(-1).double()
    as_one_hot = {**case, "draft_probs": None}
    with_q, one_hot = run_nsd(EXACT, case, seed=3), run_nsd(EXACT, as_one_hot, seed=3)
    se = torch.sqrt(p32 * (1 - p32) / n)
    for res in (with_q, one_hot):
        freq = torch.bincount(res.output_token_ids[:, 0].long(), minlength=4).double() / n
        assert torch.all((freq - p32).abs() <= 5 * se + 1e-4)
    tol = 5 * math.sqrt(0.25 / n)
    assert with_q.num_accepted.double().mean().item() == pytest.approx(torch.minimum(p32, q).sum().item(), abs=tol)
    assert one_hot.num_accepted.double().mean().item() == pytest.approx((q * p32).sum().item(), abs=tol)
    rule = RuleConfig(kind="nucleus", theta=0.9)
    e_true = run_nsd(rule, case, seed=3).deviation[:, 0].mean().item()
    e_one_hot = run_nsd(rule, as_one_hot, seed=3).deviation[:, 0].mean().item()
    assert e_one_hot > e_true + 0.05


@pytest.mark.parametrize("theta", [0.0, 0.5, 0.9])
def test_one_hot_q_as_none_equals_an_explicit_one_hot_tensor(theta: float) -> None:
    """q = None is q one-hot on the draft: the same decisions, tokens and E = 1[x∈S]·(1 − p(x))."""
    case = ragged_case(77, "mixed", with_q=False, padded_draft=False)
    one_hot = torch.nn.functional.one_hot(case["draft_token_ids"].long(), 32).float()
    rule = RuleConfig(kind="nucleus", theta=theta)
    implicit = run_nsd(rule, case, seed=6)
    explicit = run_nsd(rule, {**case, "draft_probs": one_hot}, seed=6)
    assert torch.equal(implicit.output_token_ids, explicit.output_token_ids)
    assert torch.allclose(implicit.deviation, explicit.deviation, atol=1e-6)
    assert torch.equal(implicit.relaxed, explicit.relaxed)


def test_engine_exact_test_is_reproduced_when_nothing_relaxes() -> None:
    """exact_accept (Model Runner V2's log-form test) decides alone when λ·1[x∈S] = 0."""
    case = ragged_case(13, "random", with_q=True, padded_draft=False)
    probs = case["target_logits"].softmax(-1)
    argmax = case["target_logits"].argmax(-1)
    t = case["draft_token_ids"].shape[0]
    gen = torch.Generator().manual_seed(1)
    uniforms = torch.rand(t, generator=gen, dtype=torch.float64)
    engine = torch.rand(t, generator=gen) < 0.6  # any decisions: they must come back as given
    batch = len(case["num_draft_tokens"])
    args = (probs, argmax, case["draft_token_ids"], case["cu_num_draft_tokens"], case["max_spec_len"],
            case["draft_probs"], case["bonus_token_ids"], torch.zeros(batch, dtype=torch.bool),
            uniforms, argmax)
    index, valid = padded_token_index(case["cu_num_draft_tokens"], case["max_spec_len"], t)
    given = torch.cat([engine, torch.zeros(1, dtype=torch.bool)])[index] & valid
    expect = ((~given).cumsum(-1) == 0).sum(-1)
    for rule in NOTHING_RELAXED:
        res = verify_ragged(rule, *args, exact_accept=engine)
        assert torch.equal(res.num_accepted, expect) and not res.relaxed.any()
    nsd = verify_ragged(RuleConfig(kind="nucleus", theta=0.9), *args, exact_accept=engine)
    assert torch.all(nsd.num_accepted >= expect) and nsd.relaxed.any()
