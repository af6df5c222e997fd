"""Verification rules for speculative decoding, as pure tensor functions.

Vocabulary (used the same way everywhere in nsd):

- *draft tokens* ``x_1..x_k`` were drawn by the proposer from ``q`` (or chosen
  deterministically, ``q = one-hot``).
- ``p`` is the target's sampling distribution at each position (``k + 1`` rows: one per
  draft token plus the *bonus* position after the last one).
- the *relaxed set* ``S`` at a position is where a rule may accept beyond the exact test:
  the target nucleus ``N_θ(p̂)`` for NSD, the typical set for Medusa-style acceptance,
  empty for the exact rule.
- an *accepted* token passed the test; at the first rejection a *recovered* token is drawn
  from the residual ``(p − q)₊``; if all ``k`` pass, a *bonus* token is drawn from ``p``.

The rule (see NSD-MATH.md): with relaxation weight ``λ ∈ [0, 1]`` at a position,
``a(x) = m + λ·1[x∈S]·(1 − m)``, ``m = min(1, p(x)/q(x))``. The output distribution then
has total variation ``λ·E`` from ``p``, with ``E = Σ_{y∈S} (q(y) − p(y))₊``, exactly.
``λ = 0`` is standard speculative sampling, ``λ = 1`` plain NSD; a fidelity budget picks
``λ`` per position so the summed deviation never exceeds it.

Everything here is vectorised over a batch ``B`` and the ``k`` draft positions; the only
Python loops run over ``k`` (≤ a few dozen: the budget scan and its charge), never over
the vocabulary.
Randomness is passed in as float64 uniforms so every rule is a deterministic function of
its inputs and can be tested exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nsd import options
from nsd.errors import NSDError
from nsd.rules.sampling import sample_from

RULE_KINDS = ("exact", "nucleus", "typical", *options.LOSSY_METHODS)

# Nucleus threshold search looks at this many top tokens first; only rows whose top mass
# falls short of θ pay for a full sort. LLM nuclei at θ ≤ 0.95 are almost always smaller.
_NUCLEUS_TOPK = 256


@dataclass(frozen=True)
class RuleConfig:
    """Which verification rule to apply, and its knobs.

    kind:
        ``"exact"`` — standard speculative sampling (lossless).
        ``"nucleus"`` — NSD: also accept draft tokens in ``N_θ(p̂)``.
        ``"typical"`` — Medusa-style: also accept tokens with
        ``p̂(x) > min(epsilon, typical_delta · exp(−H(p̂)))``.
        ``"topk_delta"``, ``"threshold"``, ``"fly"`` — the engines' rules of
        :mod:`nsd.rules.lossy` (TensorRT-LLM / Modular MAX, SGLang, vLLM's FLy), with their
        knobs (``relaxed_*``, ``threshold_*``, ``fly_*``).
    budget:
        Hard cap ``B`` on the summed deviation ``Σ E_t`` of one sequence (``inf`` = none).
    cap:
        Optional per-position cap ``δ``: a position with ``E_t > δ`` is verified exactly.
    smooth:
        When the remaining budget cannot cover ``E_t``, relax a fraction
        ``λ = remaining / E_t`` instead of not at all, so the budget is spent exactly.
    """

    kind: str = "exact"
    theta: float = 0.0
    budget: float = options.default("budget")
    cap: float = options.default("cap")
    smooth: bool = options.default("smooth")
    typical_epsilon: float = options.default("typical_epsilon")
    typical_delta: float = options.default("typical_delta")
    relaxed_topk: int = options.default("relaxed_topk")
    relaxed_delta: float = options.default("relaxed_delta")
    threshold_single: float = options.default("threshold_single")
    threshold_acc: float = options.default("threshold_acc")
    fly_window_size: int = options.default("fly_window_size")
    fly_entropy_threshold: float = options.default("fly_entropy_threshold")
    fly_entropy_top_k: int = options.default("fly_entropy_top_k")

    def __post_init__(self) -> None:
        if self.kind not in RULE_KINDS:
            raise NSDError(f"unknown verification rule {self.kind!r}; use {', '.join(RULE_KINDS)}")
        options.check_fields(self, options.DECODING)  # ranges are defined once, there

    @classmethod
    def for_method(cls, method: str, **knobs: float | bool) -> RuleConfig:
        """The rule a user-level method (``ar``, ``sd``, ``nsd``, ``typical``) verifies with;
        the one place that maps methods to rules."""
        options.check("method", method)
        return cls(kind=options.METHOD_RULE[method], **knobs)

    @property
    def relaxes(self) -> bool:
        """Whether the rule can ever depart from exact speculative sampling."""
        if self.kind == "exact" or self.budget == 0 or self.cap == 0:
            return False
        if self.kind == "nucleus":
            return self.theta > 0
        if self.kind == "threshold":
            return self.threshold_single < 1 or self.threshold_acc < 1
        if self.kind == "fly":
            return not math.isinf(self.fly_entropy_threshold)
        return True  # typical; topk_delta: even K = 1 replaces the sampled verdict by greedy (MAX)

    @property
    def lossy(self) -> bool:
        """One of the engines' rules (:mod:`nsd.rules.lossy`), not nsd's own."""
        return self.kind in options.LOSSY_METHODS

    @property
    def argmax_drafts(self) -> bool:
        """Whether the rule is defined for argmax (deterministic) drafts only."""
        return self.kind in options.ARGMAX_DRAFT_METHODS


def method_of_rule(rule: RuleConfig, speculative: bool = True) -> str:
    """The method a run is named by, from what it did: ``ar`` without drafts, ``sd`` for a
    rule that cannot relax (θ = 0, budget 0, cap 0 verify exactly), else the relaxing
    method whose rule it is (:data:`nsd.options.METHOD_RULE` read backwards)."""
    if not speculative:
        return "ar"
    if not rule.relaxes:
        return "sd"
    return next(m for m in options.RELAXED_METHODS if options.METHOD_RULE[m] == rule.kind)


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: torch.Tensor  # [B] int64: draft tokens accepted (0..k)
    next_token: torch.Tensor  # [B] int64: recovered token, or bonus if all were accepted
    accepted: torch.Tensor  # [B, k] bool: position passed its test (prefix up to first False counts)
    relaxed: torch.Tensor  # [B, k] bool: accepted position that failed the exact test
    deviation: torch.Tensor  # [B, k] float64: λ_t·E_t charged at emitted positions, 0 after
    spent: torch.Tensor  # [B] float64: budget spent, including this block


# --------------------------------------------------------------------------- relaxed sets


def nucleus_threshold(plaus_probs: torch.Tensor, theta: float) -> torch.Tensor:
    """Smallest probability inside the nucleus ``N_θ``, per row.

    plaus_probs: ``[..., V]``. Returns ``[...]`` float32.

    Sorting by probability, the nucleus is the shortest prefix whose mass reaches θ (the
    crossing token included). Ties at the crossing are resolved by keeping every token
    tied with it, so ``N_θ = {y : p̂(y) ≥ t, p̂(y) > 0}`` with ``t`` returned here. This is
    order-free, hence identical in every code path (full mask or single-token test).
    ``θ = 0`` gives ``+inf`` (empty nucleus); ``θ ≥ 1`` gives the smallest positive
    probability, so the nucleus is the whole support.

    Mass is measured relative to the row's own total: float32 rows sum to 1 only up to
    rounding, and against an absolute θ a total of 1 + 1e-7 "reaches" θ = 1 before its
    smallest tokens, while a total of 1 − 1e-7 never does. Normalising makes the nucleus a
    property of the distribution's shape alone, for every θ, at the cost of one row sum.
    """
    shape = plaus_probs.shape[:-1]
    if theta <= 0:
        return torch.full(shape, math.inf, dtype=plaus_probs.dtype, device=plaus_probs.device)
    flat = plaus_probs.reshape(-1, plaus_probs.shape[-1])
    if theta >= 1:  # no cumulative sum: its rounding is exactly what must not decide here
        positive = torch.where(flat > 0, flat, torch.full_like(flat, math.inf))
        return positive.amin(dim=-1).reshape(shape)
    top = min(_NUCLEUS_TOPK, flat.shape[-1])
    values = torch.topk(flat, top, dim=-1).values  # [R, top], descending
    target_mass = theta * flat.double().sum(dim=-1, keepdim=True)  # [R, 1]: θ × row total
    thresholds = _crossing_value(values, target_mass)
    return _complete_short_rows(flat, target_mass, thresholds,
                                host_sync=flat.device.type == "cpu").reshape(shape)


def _complete_short_rows(flat: torch.Tensor, target_mass: torch.Tensor, thresholds: torch.Tensor,
                         host_sync: bool) -> torch.Tensor:
    """Fill in the rows whose nucleus is larger than the top-k look (NaN in ``thresholds``).

    flat: ``[R, V]``; target_mass: ``[R, 1]`` float64 θ × row total; thresholds: ``[R]``.
    Both branches take the same ``target_mass``, so which one runs never changes the
    nucleus (an absolute θ here once made unnormalised rows differ on accelerators).
    """
    short = torch.isnan(thresholds)
    if not host_sync:
        # On an accelerator, asking which rows fell short would stall on a host read; a
        # full sort of every row is cheaper than that stall.
        full = torch.sort(flat, dim=-1, descending=True).values
        return torch.where(short, _crossing_value(full, target_mass, exhaustive=True), thresholds)
    if short.any():  # pay for the full sort on the short rows only
        full = torch.sort(flat[short], dim=-1, descending=True).values
        thresholds = thresholds.clone()
        thresholds[short] = _crossing_value(full, target_mass[short], exhaustive=True)
    return thresholds


def _crossing_value(sorted_desc: torch.Tensor, target_mass: torch.Tensor,
                    exhaustive: bool = False) -> torch.Tensor:
    """Value of the first token whose inclusive cumulative mass reaches ``target_mass``.

    sorted_desc: ``[R, n]`` descending; target_mass: ``[R, 1]`` float64 (θ × row total).
    NaN where the given prefix never reaches it (unless ``exhaustive``: then the whole row
    is the nucleus — the sorted cumulative sum rounds differently from the row total and
    can end a hair under θ·total for θ near 1 — and the smallest positive value is returned).
    """
    cumulative = torch.cumsum(sorted_desc.double(), dim=-1)
    reached = cumulative >= target_mass
    first = reached.to(torch.int8).argmax(dim=-1, keepdim=True)  # first True, 0 if none
    value = sorted_desc.gather(-1, first).squeeze(-1)
    never = ~reached.any(dim=-1)
    # torch.where rather than masked assignment: no host sync on an accelerator.
    if exhaustive:
        positive = torch.where(sorted_desc > 0, sorted_desc, torch.full_like(sorted_desc, math.inf))
        return torch.where(never, positive.amin(dim=-1), value)
    return torch.where(never, torch.full_like(value, math.nan), value)


def typical_threshold(plaus_probs: torch.Tensor, epsilon: float, delta: float) -> torch.Tensor:
    """Medusa's typical-acceptance threshold ``min(ε, δ·exp(−H(p̂)))`` per row ``[...]``.

    The entropy is computed in at least float32: in float16 the clamp's 1e-30 is 0, so a
    zero probability gives ``0·log 0 = NaN``, the threshold NaN and an empty typical set
    (silently the exact rule); bfloat16 keeps 8 bits of mantissa, too few for a sum over
    the vocabulary. Half-precision inputs upcast exactly, so their set is the float32 one.
    """
    probs = plaus_probs if plaus_probs.dtype in (torch.float32, torch.float64) else plaus_probs.float()
    logp = torch.log(probs.clamp_min(1e-30))
    entropy = -(probs * logp).sum(dim=-1)
    return torch.clamp(delta * torch.exp(-entropy), max=epsilon)


def relaxed_set_mask(plaus_probs: torch.Tensor, rule: RuleConfig) -> torch.Tensor:
    """Boolean mask ``[..., V]`` of the rule's relaxed set (nucleus, typical set, or empty)."""
    if rule.kind == "nucleus":
        t = nucleus_threshold(plaus_probs, rule.theta).unsqueeze(-1)
        return (plaus_probs >= t) & (plaus_probs > 0)
    if rule.kind == "typical":
        t = typical_threshold(plaus_probs, rule.typical_epsilon, rule.typical_delta).unsqueeze(-1)
        return plaus_probs > t
    return torch.zeros_like(plaus_probs, dtype=torch.bool)


def relaxed_set_stats(
    rule: RuleConfig,
    plaus_probs: torch.Tensor,  # [B, k, V] p̂ at the draft positions
    target_probs: torch.Tensor,  # [B, k, V] p at the draft positions
    draft_tokens: torch.Tensor,  # [B, k] int64
    draft_probs: torch.Tensor | None,  # [B, k, V] q, or None for one-hot proposals
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: is the draft token in the relaxed set, and the excess ``E``.

    Returns ``(token_in_set [B, k] bool, excess [B, k] float64)`` with
    ``E = Σ_{y∈S} (q(y) − p(y))₊``. For one-hot ``q`` this is ``1 − p(x)`` when ``x ∈ S``
    and 0 otherwise, computed without materialising a vocabulary-sized mask.
    """
    if not rule.relaxes:
        zeros = torch.zeros(draft_tokens.shape, dtype=torch.float64, device=draft_tokens.device)
        return torch.zeros(draft_tokens.shape, dtype=torch.bool, device=draft_tokens.device), zeros
    tok = draft_tokens.unsqueeze(-1)
    if draft_probs is None:
        if rule.kind == "nucleus":
            t = nucleus_threshold(plaus_probs, rule.theta)
            p_hat_x = plaus_probs.gather(-1, tok).squeeze(-1)
            in_set = (p_hat_x >= t) & (p_hat_x > 0)
        else:
            t = typical_threshold(plaus_probs, rule.typical_epsilon, rule.typical_delta)
            in_set = plaus_probs.gather(-1, tok).squeeze(-1) > t
        p_x = target_probs.gather(-1, tok).squeeze(-1).double()
        excess = torch.where(in_set, (1.0 - p_x).clamp_min(0.0), torch.zeros_like(p_x))
        return in_set, excess
    mask = relaxed_set_mask(plaus_probs, rule)  # [B, k, V]
    in_set = mask.gather(-1, tok).squeeze(-1)
    if draft_probs.device.type != "cpu":
        # Dense: no host sync (the sparse form below needs nonzero()'s count on the host).
        surplus = (draft_probs.double() - target_probs.double()).clamp_min(0.0)
        return in_set, (surplus * mask).sum(dim=-1)
    # On a CPU, only the few tokens in S with q > p are summed: a nucleus is a few dozen
    # tokens of a 152k row, and the dense float64 form cost ~2.7 ms per row on two Zen 4
    # cores (a verification of 8 sampled drafts spent 22 ms here). q > p in float32 is
    # exactly (q − p)₊ > 0 in float64, so the same terms are summed (in another order).
    live = mask & (draft_probs > target_probs)
    where = live.nonzero(as_tuple=True)
    terms = draft_probs[where].double() - target_probs[where].double()
    excess = torch.zeros(live.shape[:-1], dtype=torch.float64, device=live.device)
    excess.index_put_(where[:-1], terms, accumulate=True)
    # A NaN compares false and would drop out of the sum; the dense form made E NaN, which
    # no cap admits, so such a row is never relaxed. Keep that.
    broken = torch.isnan(draft_probs).any(dim=-1) | torch.isnan(target_probs).any(dim=-1)
    return in_set, excess.masked_fill(broken, math.nan)


# --------------------------------------------------------------------------- budget policy


def relaxation_weights(
    rule: RuleConfig,
    excess: torch.Tensor,  # [B, k] float64 E_t
    spent: torch.Tensor,  # [B] float64 budget already spent by this sequence
    greedy: torch.Tensor | bool = False,  # [B] bool (or one bool for all): temperature-0 rows
) -> torch.Tensor:
    """Relaxation weight ``λ_t ∈ [0, 1]`` per position ``[B, k]`` float64.

    Scans left to right assuming every earlier position of the block is emitted (only
    positions up to the first rejection are, and those all precede it), charging
    ``λ_t·E_t``. Hard budget: ``λ_t = 1`` iff ``spent + E_t ≤ B`` (and ``E_t ≤ δ``), else 0.
    Smooth: a position the remainder cannot cover gets ``λ_t = remaining / E_t``.

    Greedy rows relax all-or-nothing even when the rule is smooth. At temperature 0 a
    relaxed accept costs ``E = 1`` and ``m`` is 0 or 1, so a partial ``λ`` would make the
    accept a coin flip on the uniform, and a greedy output would depend on the seed. Every
    caller (local decoder, ragged/vLLM path) passes its greedy rows here, so they agree.
    """
    if not rule.relaxes:
        return torch.zeros_like(excess)
    allowed = excess <= rule.cap
    if math.isinf(rule.budget):
        return allowed.double()
    weights = torch.zeros_like(excess)
    running = spent.clone()
    if rule.smooth:
        hard_rows = torch.as_tensor(greedy, dtype=torch.bool, device=excess.device)
        hard_rows = hard_rows.expand(excess.shape[:-1])
    for t in range(excess.shape[-1]):
        e = excess[:, t]
        # Test the float sum itself, not e <= B − spent: the two round differently, and
        # "D ≤ B on every path" must hold for the number reported.
        fits = running + e <= rule.budget
        if rule.smooth:
            partial = torch.where(hard_rows, torch.zeros_like(e), _partial_weight(rule.budget, running, e))
            lam = torch.where(fits, torch.ones_like(e), partial)
        else:
            lam = fits.double()
        lam = lam * allowed[:, t]
        weights[:, t] = lam
        running = running + lam * e  # verify_block charges these very products, in this order
    return weights


def _partial_weight(budget: float, running: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Largest ``λ ≤ remaining / e`` whose charge ``λ·e`` still fits under ``budget`` in float.

    ``remaining / e`` times ``e`` can round one ulp above ``remaining``, and ``running +
    remaining`` one ulp above ``budget``; both are stepped down until the sum fits (one step
    suffices in round-to-nearest, the loop is a bound, not a search). Rounding is monotone,
    so a charge ≤ that remainder keeps ``running + λ·e ≤ budget``.
    """
    zero = torch.zeros_like(e)
    remaining = (budget - running).clamp_min(0.0)
    for _ in range(4):
        over = running + remaining > budget
        if not bool(over.any()):
            break
        remaining = torch.where(over, torch.nextafter(remaining, zero), remaining)
    lam = torch.where(e > 0, remaining / e.clamp_min(1e-300), torch.ones_like(e)).clamp(0.0, 1.0)
    for _ in range(4):
        over = lam * e > remaining
        if not bool(over.any()):
            break
        lam = torch.where(over, torch.nextafter(lam, zero), lam)
    return lam


# --------------------------------------------------------------------------- the block test


def relaxed_acceptance(
    exact_prob: torch.Tensor,  # [...] float64 m = min(1, p(x)/q(x))
    token_in_set: torch.Tensor,  # [...] bool: draft token lies in the relaxed set
    weights: torch.Tensor,  # [...] float64 relaxation weight λ ∈ [0, 1]
) -> torch.Tensor:
    """Acceptance probability ``a = m + λ·1[x∈S]·(1 − m)`` ``[...]`` float64.

    With ``λ = 0`` this is ``m`` bit for bit (``m + 0.0``), which is what makes θ = 0 and
    B = 0 reproduce the exact rule's decisions exactly in every caller.
    """
    return exact_prob + weights * token_in_set * (1.0 - exact_prob)


def verify_block(
    target_probs: torch.Tensor,  # [B, k+1, V] p at each draft position + the bonus position
    draft_tokens: torch.Tensor,  # [B, k] int64
    draft_probs: torch.Tensor | None,  # [B, k, V] q, or None: q is one-hot on the draft token
    token_in_set: torch.Tensor,  # [B, k] bool: draft token lies in the relaxed set
    excess: torch.Tensor,  # [B, k] float64: E_t = Σ_{y∈S}(q − p)₊
    weights: torch.Tensor,  # [B, k] float64: relaxation weight λ_t ∈ [0, 1]
    accept_uniforms: torch.Tensor,  # [B, k] float64 in [0, 1)
    sample_uniforms: torch.Tensor,  # [B] float64 in [0, 1): draws the recovered/bonus token
    spent: torch.Tensor | None = None,  # [B] float64 deviation already spent
    check_draft_support: bool = True,
) -> VerifyResult:
    """Verify a block of drafts left to right; the first rejection ends it.

    Acceptance probability ``a = m + λ·1[x∈S]·(1 − m)`` with ``m = min(1, p(x)/q(x))``.
    At the first rejection the recovered token comes from ``(p − q)₊``; if none is
    rejected, the bonus token from ``p`` at position ``k``.

    ``check_draft_support`` raises on a draft token with ``q(x) = 0`` (a proposer bug);
    the check reads a flag back to the host, so callers on an accelerator turn it off.
    """
    if spent is None:
        spent = torch.zeros(draft_tokens.shape[0], dtype=torch.float64, device=draft_tokens.device)
    tok = draft_tokens.unsqueeze(-1)
    p_x = target_probs[:, :tok.shape[1]].gather(-1, tok).squeeze(-1).double()  # [B, k]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(-1, tok).squeeze(-1).double()
        if check_draft_support and bool((q_x <= 0).any()):
            raise ValueError("proposer drew a token it gave probability 0: a proposer bug")
    exact_prob = torch.clamp(p_x / q_x, max=1.0)  # m
    accept_prob = relaxed_acceptance(exact_prob, token_in_set, weights)
    accepted = accept_uniforms < accept_prob
    outcome = first_rejection(accepted, weights, excess)
    residual = _residual(target_probs, draft_tokens, draft_probs, outcome)
    return VerifyResult(
        num_accepted=outcome.num_accepted,
        next_token=sample_from(residual, sample_uniforms),
        accepted=accepted,
        relaxed=accepted & (accept_uniforms >= exact_prob) & outcome.leading,
        deviation=outcome.deviation,
        spent=charge(spent, outcome.deviation),
    )


@dataclass(frozen=True)
class BlockOutcome:
    """Where each row's block ends: the accepted run, the first rejection, and the
    deviation charged at the positions whose output counts."""

    leading: torch.Tensor  # [B, k] bool: the accepted prefix
    num_accepted: torch.Tensor  # [B] int64: its length
    has_rejection: torch.Tensor  # [B] bool: a draft was rejected (else every one passed)
    rejected_at: torch.Tensor  # [B] int64: the first rejected position (clamped to k - 1)
    deviation: torch.Tensor  # [B, k] float64: λ_t·E_t on the accepted prefix and the rejection


def first_rejection(
    accepted: torch.Tensor,  # [B, k] bool: position passed its test
    weights: torch.Tensor,  # [B, k] float64 relaxation weight λ_t
    excess: torch.Tensor,  # [B, k] float64 E_t
    drafts: torch.Tensor | None = None,  # [B] int: real drafts per row (None: all k)
) -> BlockOutcome:
    """The first rejection, vectorised (no loop over rows or positions), and the
    deviation: ``λ_t·E_t`` where a token is emitted (the accepted prefix and the rejected
    position, whose recovered token it shapes), 0 after. The one place every verifier
    (:func:`verify_block`, :func:`nsd.rules.ragged.verify_ragged`, Modular MAX's verdict in
    :mod:`nsd.rules.lossy`) finds where a block ends."""
    k = accepted.shape[-1]
    leading = (~accepted).cumsum(dim=-1) == 0  # [B, k]
    num_accepted = leading.sum(dim=-1)
    has_rejection = num_accepted < (k if drafts is None else drafts)
    rejected_at = num_accepted.clamp(max=max(k - 1, 0))
    emitted = leading
    if k > 0:
        at_rejection = torch.zeros_like(leading).scatter(-1, rejected_at.unsqueeze(-1),
                                                         has_rejection.unsqueeze(-1))
        emitted = leading | at_rejection
    deviation = torch.where(emitted, weights * excess, torch.zeros_like(excess))
    return BlockOutcome(leading, num_accepted, has_rejection, rejected_at, deviation)


def _residual(
    target_probs: torch.Tensor,  # [B, k+1, V] p
    draft_tokens: torch.Tensor,  # [B, k] int64
    draft_probs: torch.Tensor | None,  # [B, k, V] q, or None: one-hot
    outcome: BlockOutcome,
) -> torch.Tensor:
    """``[B, V]``: what the next token is drawn from, the residual ``(p − q)₊`` at the
    first rejection, or ``p`` at the bonus position where every draft passed."""
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    p_row = target_probs[rows, outcome.num_accepted]  # [B, V]
    if k == 0:
        return p_row
    rejected_at = outcome.rejected_at
    if draft_probs is None:
        q_row = torch.zeros_like(p_row)
        q_row[rows, draft_tokens[rows, rejected_at]] = 1.0
    else:
        q_row = draft_probs[rows, rejected_at]
    residual = torch.where(outcome.has_rejection.unsqueeze(-1), (p_row - q_row).clamp_min(0.0), p_row)
    # Z = 0 would mean rejection was impossible; guard against float dust anyway.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, p_row, residual)


def charge(spent: torch.Tensor, deviation: torch.Tensor) -> torch.Tensor:
    """``spent + Σ_t deviation[:, t]``, added left to right (spent [B], deviation [B, k]).

    The order is the budget scan's in :func:`relaxation_weights`, so the result is exactly
    the scan's running total at the last charged position and can never round above the
    budget; a pairwise ``deviation.sum()`` could, by an ulp. This is the one way a deviation
    is added to a sequence's total: every path (local decoder, ragged adapter, vLLM ledger)
    charges through it, so ``D ≤ B`` holds for every number reported.
    """
    total = spent.clone()
    for t in range(deviation.shape[-1]):
        total = total + deviation[:, t]
    return total
