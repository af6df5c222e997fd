"""The lossy verification rules other engines ship, each with its exact deviation.

Vocabulary as in :mod:`nsd.rules.verify`: ``p`` the target's sampling law per position, ``p̂``
its plausibility law (``p`` when sampling; the softmax at temperature 1 when greedy),
``q`` the draft's law (one-hot for an argmax or deterministic draft: ``draft_probs=None``),
``m = min(1, p(x)/q(x))`` the exact test, ``λ`` the budget's relaxation weight.

Each rule below is the engine's own, read from its source (cited; no code copied):

``topk_delta`` — TensorRT-LLM's relaxed acceptance for MTP and Modular MAX's, same knobs.
    ``S = {argmax p̂} ∪ {y among the K largest p̂ : p̂(y) ≥ max p̂ − δ}``, with ``p̂`` the
    *untempered* softmax of the raw target logits and δ a difference of probabilities
    (not log-probabilities, whatever the variable names say). Argmax drafts only.
    - Greedy verification: TensorRT-LLM, ``tensorrt_llm/_torch/speculative/mtp.py``
      (``sample_and_accept_draft_tokens``: softmax of the raw logits, top-K) and
      ``cpp/tensorrt_llm/kernels/speculativeDecoding/mtpKernels.cu``
      (``mtpRelaxedAcceptanceKernel``: accept iff the draft is a top-K index whose value is
      ≥ top-1 − δ, the top-1 always eligible; at the first miss emit the top-1). This is
      nsd's greedy rule with ``S`` in place of the nucleus: ``E_t = 1 − p(x)``, i.e. 1 for
      a non-argmax accept, 0 otherwise.
    - Sampled verification (temperature > 0): Modular MAX,
      ``max/python/max/nn/sampling/rejection_sampler.py`` (``_relaxed_thinking_verdict``,
      ``stochastic_acceptance_sampler``): in a relaxed row the exact verdict is *replaced*:
      accept iff ``x ∈ S``, otherwise reject and emit ``argmax p̂`` (not a residual draw);
      temperature-0 rows fall back to strict greedy there. Its output at a position is a
      point mass on ``y = x`` (in ``S``) or ``y = argmax`` (not), so, exactly,
      ``E_t = TV(δ_y, p) = 1 − p(y)``, known before the decision. Defaults K = 10,
      δ = 0.6 from MAX's ``SpeculativeConfig`` fields ``relaxed_topk``/``relaxed_delta``
      (the stored copy read gave no file path; its docs match the sampler above).
      TensorRT-LLM's own defaults are 1 and 0 (off), its DeepSeek-R1 recipe 10 and 0.6.
    Both engines relax only inside ``<think>…</think>``; nsd relaxes every position (as if
    the whole reply were a thinking span) and leaves the span policy to the caller.

``threshold`` — SGLang's ``speculative_accept_threshold_single`` / ``_acc``.
    ``sgl-kernel/csrc/speculative/speculative_sampling.cuh``
    (``TreeSpeculativeSamplingTargetOnly``), called from the non-greedy branch of
    ``python/sglang/srt/speculative/eagle_info.py`` (``eagle_utils.py`` in older releases;
    defaults and help text in ``server_args.py``) with ``p`` = softmax(logits / T) after
    top-k/top-p renormalisation. Draft tokens are deterministic ("target only": q is
    ignored). For a chain (one candidate per depth, nsd's case) the accumulated mass is
    the candidate's own ``p(x)``, so: accept iff ``u ≤ p(x)/t_acc`` or ``p(x) ≥ t_single``;
    on rejection draw from ``p`` with ``x`` removed. (In a tree the same coin is reused
    across siblings, accumulating their mass; nsd drafts chains.) Written as nsd's rule
    with a *per-token weight* ``w(y) ∈ [0, 1]`` instead of a set indicator:
    ``w = 1`` where ``p ≥ t_single`` or ``p ≥ t_acc``, else ``w = p(1/t_acc − 1)/(1 − p)``,
    so that ``a = p + w(1 − p)``. The same algebra as nsd's gives the exact deviation
    ``E = Σ_y w(y)(q(y) − p(y))₊ = w(x)(1 − p(x))`` for one-hot q. Defaults 1 and 1 (exact).
    Greedy verification is plain argmax matching in SGLang: refused here, as are sampled
    drafts.

``fly`` — vLLM's FLy (arXiv 2511.22972), ``rejection_sample_method: "fly"``:
    ``vllm/v1/spec_decode/fly.py`` (``compute_fly_entropy``,
    ``apply_fly_greedy_acceptance_kernel``, ``apply_fly_random_acceptance_kernel``) and
    ``docs/features/speculative_decoding/fly.md``. At position t (0-based, k drafts) a
    native rejection is turned into an accept iff ``H_t ≥ fly_entropy_threshold`` with
    ``H_t = −Σ_{top fly_entropy_top_k of p̂} p̂ log p̂`` (not renormalised), ``t + W < k``,
    ``p̂(x_t) > 0`` (and ``q(x_t) > 0``), and the *native* test passes at every one of
    ``t+1 … t+W`` (same uniforms). Greedy and sampled drafts, greedy and sampled
    verification. Defaults W = 6 (vLLM: ``min(6, k − 1)``), threshold 0.3, top-k 3.
    nsd follows ModelRunnerV1's pre-pass there (entropy of the *processed* ``p`` when
    sampling, of the raw-logit softmax when greedy); a review of the vLLM pull request
    notes that one ModelRunnerV2 version gated on untempered logits at T > 0 (the same at
    T = 0).
    The deviation is not a per-position set formula (the decision reads future tokens).
    nsd reports a derived *bound* ``D``, charging ``c_t = 1 − m_t`` at every emitted
    position where a deferral was open (gate and window pass, budget allows) whether or
    not the native test failed there. Coupling FLy with exact SD on the same draws, the two
    agree until FLy's first deferral, and ``P(first deferral at t | all but u_t) ≤ c_t``,
    so ``TV(FLy's sequence law, the target's) ≤ P(any deferral) ≤ E[D]``. At temperature 0
    ``c_t`` is 1 exactly at each deferral (as nsd's greedy ``E``). A budget gates openings
    on ``c_t`` *without* the window (which reads later uniforms and would bias the bound),
    so ``D ≤ B`` on every path; ``--smooth`` has no meaning here: it does not act on fly
    (the front ends refuse or note it, as any knob of another method) and the budget stays hard.

Everything is vectorised over the batch and vocabulary; Python loops run over k only.
"""

from __future__ import annotations

from typing import Sequence

import torch

from nsd.errors import NSDError
from nsd.rules.sampling import SamplingConfig, sample_from, untempered_probs
from nsd.rules.verify import (RuleConfig, VerifyResult, charge, first_rejection, relaxation_weights,
                              verify_block)

# The rules' knobs live on :class:`nsd.rules.verify.RuleConfig` (kinds ``topk_delta``,
# ``threshold``, ``fly``), defined once in :mod:`nsd.options`.


# --------------------------------------------------------------------------- relaxed sets


def topk_delta_mask(relaxed_probs: torch.Tensor, topk: int, delta: float) -> torch.Tensor:
    """``S`` as a mask ``[..., V]`` from the untempered target softmax ``relaxed_probs``.

    Ties at the K-th value keep every tied token, so the set does not depend on the order
    a top-k kernel happens to return; a token the target gives probability 0 is never in.
    """
    probs = relaxed_probs if relaxed_probs.dtype in (torch.float32, torch.float64) else relaxed_probs.float()
    top = torch.topk(probs, min(topk, probs.shape[-1]), dim=-1).values  # [..., K] descending
    kth, best = top[..., -1:], top[..., :1]
    return (probs >= kth) & (probs >= best - delta) & (probs > 0)  # δ ≥ 0 keeps the top-1


def topk_delta_inputs(
    rule: RuleConfig,
    sampling: SamplingConfig,
    draft_logits: torch.Tensor,  # [k, V] the target's raw logits at the draft positions
    generator: torch.Generator,
    history: Sequence[int] = (),
    drafts: Sequence[int] = (),
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(relaxed_probs [1, k, V], mix_uniforms [1, k] float64)``: what Modular MAX's sampled
    top-K/δ verdict reads beyond every rule's inputs, each ``None`` where nothing reads it
    (another rule, greedy, no relaxation; the mix uniforms without ``smooth``).

    Call it after drawing the block's accept and sample uniforms: the mix uniforms are
    drawn last and only where used, so every other rule's random stream stays as it was.
    They come from ``generator``'s device (a CPU one: a seed means the same on any device)
    and move to the logits'.
    """
    if rule.kind != "topk_delta" or not rule.relaxes or sampling.greedy:
        return None, None
    # MAX ranks candidates by the untempered softmax, whatever the sampling temperature.
    relaxed_probs = untempered_probs(draft_logits, sampling, history, drafts).unsqueeze(0)
    if not rule.smooth:
        return relaxed_probs, None
    mix = torch.rand(1, draft_logits.shape[0], dtype=torch.float64, generator=generator,
                     device=generator.device)
    return relaxed_probs, mix.to(draft_logits.device)


def threshold_weights(target_probs: torch.Tensor, single: float, acc: float) -> torch.Tensor:
    """SGLang's per-token relaxation weight ``w(y)`` ``[..., V]`` float64 (see module doc).

    ``a = p + w(1 − p)`` equals SGLang's acceptance probability: 1 where ``p ≥ single`` or
    ``p ≥ acc``, ``p / acc`` below that.
    """
    p = target_probs.double()
    full = (p >= single) | (p >= acc)
    partial = p * (1.0 / acc - 1.0) / (1.0 - p).clamp_min(1e-300)
    return torch.where(full, torch.ones_like(p), partial.clamp(0.0, 1.0))


def relaxed_weights(rule: RuleConfig, probs: torch.Tensor) -> torch.Tensor:
    """The set-based rules' relaxation weight per token ``[..., V]`` float64 (0/1 for a set).

    ``probs``: the untempered softmax for ``topk_delta``, ``p`` for ``threshold``. Their
    deviation for any draft law is ``E = Σ_y w(y)(q(y) − p(y))₊``.
    """
    if rule.kind == "topk_delta":
        return topk_delta_mask(probs, rule.relaxed_topk, rule.relaxed_delta).double()
    if rule.kind == "threshold":
        return threshold_weights(probs, rule.threshold_single, rule.threshold_acc)
    raise NSDError(f"{rule.kind}: not a set-based rule (its deviation is not a set formula)")


def set_stats(
    rule: RuleConfig,
    plaus_probs: torch.Tensor,  # [..., V] p̂ (p unless greedy)
    target_probs: torch.Tensor,  # [..., V] p at the draft positions
    draft_tokens: torch.Tensor,  # [...] int64
    draft_probs: torch.Tensor | None,  # [..., V] q, or None: one-hot drafts
    greedy: torch.Tensor,  # [...] bool: the position's row is decoded at temperature 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-position rules as NSD's algebra with a weight: ``(w(x) [...] float64, E [...]
    float64)``, ``E = Σ_y w(y)(q(y) − p(y))₊`` (``w(x)(1 − p(x))`` for a one-hot q).

    ``topk_delta`` relaxes greedy rows only (TensorRT-LLM's rule, ``w`` the set ``S`` on p̂);
    at temperature > 0 Modular MAX's verdict replaces the residual draw, which is not this
    form (:func:`verify_lossy` runs it). ``threshold`` relaxes sampled rows only (SGLang's
    greedy verification is argmax matching). A row the rule does not relax gets ``w = 0``:
    the exact rule. Used by :func:`verify_lossy` and by the ragged (vLLM) verifier.
    """
    if rule.kind == "fly":
        raise NSDError("fly: not a per-position rule (a deferral reads the window's later "
                       "positions), so it has no per-position weight")
    tok = draft_tokens.unsqueeze(-1)
    if rule.kind == "threshold":
        acts = ~greedy
        probs = target_probs
    else:
        acts = greedy
        probs = plaus_probs
    if draft_probs is None:
        p_x = target_probs.gather(-1, tok).squeeze(-1).double()
        ranked_x = probs.gather(-1, tok).squeeze(-1)
        w = relaxed_weights(rule, ranked_x.unsqueeze(-1)).squeeze(-1) if rule.kind == "threshold" \
            else relaxed_weights(rule, probs).gather(-1, tok).squeeze(-1)
        excess = w * (1.0 - p_x).clamp_min(0.0)
    else:
        dense = relaxed_weights(rule, probs)  # [..., V]
        w = dense.gather(-1, tok).squeeze(-1)
        excess = (dense * (draft_probs.double() - target_probs.double()).clamp_min(0.0)).sum(dim=-1)
    zero = torch.zeros_like(excess)
    return torch.where(acts, w, zero), torch.where(acts, excess, zero)


def fly_entropy(plaus_probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """FLy's gate: ``−Σ p̂ log p̂`` over the ``top_k`` largest ``p̂`` (no renormalising)."""
    probs = plaus_probs if plaus_probs.dtype in (torch.float32, torch.float64) else plaus_probs.float()
    top = torch.topk(probs, min(top_k, probs.shape[-1]), dim=-1).values
    terms = torch.where(top > 0, top * torch.log(top.clamp_min(1e-300)), torch.zeros_like(top))
    return -terms.sum(dim=-1)


# --------------------------------------------------------------------------- the rules


def verify_lossy(
    rule: RuleConfig,
    target_probs: torch.Tensor,  # [B, k+1, V] p
    plaus_probs: torch.Tensor,  # [B, k, V] p̂ (p unless greedy)
    draft_tokens: torch.Tensor,  # [B, k] int64
    draft_probs: torch.Tensor | None,  # [B, k, V] q, or None: one-hot drafts
    accept_uniforms: torch.Tensor,  # [B, k] float64
    sample_uniforms: torch.Tensor,  # [B] float64
    spent: torch.Tensor | None = None,  # [B] float64
    greedy: bool = False,
    relaxed_probs: torch.Tensor | None = None,  # [B, k, V] untempered softmax (topk_delta, T > 0)
    mix_uniforms: torch.Tensor | None = None,  # [B, k] float64 (topk_delta, T > 0, smooth)
) -> VerifyResult:
    """Verify one block with a lossy rule; refuses the cases the engine does not define."""
    batch, k = draft_tokens.shape
    if spent is None:
        spent = torch.zeros(batch, dtype=torch.float64, device=draft_tokens.device)
    if rule.kind == "fly":
        return _verify_fly(rule, target_probs, plaus_probs, draft_tokens, draft_probs,
                           accept_uniforms, sample_uniforms, spent)
    if draft_probs is not None:
        raise NSDError(f"{rule.kind}: defined for argmax (deterministic) drafts only; "
                       "this draft was sampled")
    if rule.kind == "threshold" and greedy:
        raise NSDError("threshold: SGLang's thresholds act at temperature > 0 only "
                       "(its greedy verification is plain argmax matching)")
    if rule.kind == "threshold" or greedy:  # SGLang; TensorRT-LLM (NSD's greedy rule with S)
        weight, excess = set_stats(rule, plaus_probs, target_probs[:, :k], draft_tokens, None,
                                   torch.full_like(draft_tokens, greedy, dtype=torch.bool))
        weights = relaxation_weights(rule, excess, spent, greedy)
        return verify_block(target_probs, draft_tokens, None, weight, excess, weights,
                            accept_uniforms, sample_uniforms, spent)
    if not rule.relaxes:  # budget or cap 0: the exact rule, which needs no candidate set
        zeros = torch.zeros(batch, k, dtype=torch.float64, device=draft_tokens.device)
        return verify_block(target_probs, draft_tokens, None, zeros, zeros, zeros,
                            accept_uniforms, sample_uniforms, spent)
    tok = draft_tokens.unsqueeze(-1)
    p_x = target_probs[:, :k].gather(-1, tok).squeeze(-1).double()  # [B, k]
    if relaxed_probs is None:
        raise ValueError("topk_delta at temperature > 0 needs relaxed_probs, the untempered "
                         "target softmax (Modular MAX's candidate set)")
    return _verify_max_replacing(rule, target_probs, relaxed_probs, draft_tokens, p_x,
                                 accept_uniforms, sample_uniforms, spent, mix_uniforms)


def _verify_max_replacing(rule: RuleConfig, target_probs: torch.Tensor, relaxed_probs: torch.Tensor,
                          draft_tokens: torch.Tensor, p_x: torch.Tensor, accept_uniforms: torch.Tensor,
                          sample_uniforms: torch.Tensor, spent: torch.Tensor,
                          mix_uniforms: torch.Tensor | None) -> VerifyResult:
    """Modular MAX's relaxed verdict at temperature > 0, mixed with the exact one by ``λ``.

    Relaxed branch: accept iff ``x ∈ S``; at a miss emit ``argmax p̂``. Exact branch
    (one-hot q): accept with ``p(x)``, at a miss draw from ``p`` without ``x``. The output
    law at a position is ``λ·δ_y + (1 − λ)·p``, so its deviation is ``λ·(1 − p(y))``.
    """
    batch, k = draft_tokens.shape
    device = draft_tokens.device
    tok = draft_tokens.unsqueeze(-1)
    in_set = topk_delta_mask(relaxed_probs, rule.relaxed_topk, rule.relaxed_delta).gather(-1, tok).squeeze(-1)
    fallback = relaxed_probs.argmax(dim=-1)  # [B, k] MAX's recovery: the top-1
    p_fallback = target_probs[:, :k].gather(-1, fallback.unsqueeze(-1)).squeeze(-1).double()
    excess = torch.where(in_set, 1.0 - p_x, 1.0 - p_fallback).clamp_min(0.0)
    weights = relaxation_weights(rule, excess, spent, False)
    if mix_uniforms is None:
        if bool(((weights > 0) & (weights < 1)).any()):
            raise ValueError("a partial relaxation needs mix_uniforms")
        mix_uniforms = torch.zeros_like(weights)
    relaxed_branch = mix_uniforms < weights  # λ = 0 never, λ = 1 always
    accepted = torch.where(relaxed_branch, in_set, accept_uniforms < p_x)
    # Where the block ends and what it charges, found as every other verifier finds it.
    outcome = first_rejection(accepted, weights, excess)
    num_accepted, at, has_rejection = outcome.num_accepted, outcome.rejected_at, outcome.has_rejection
    rows = torch.arange(batch, device=device)
    p_row = target_probs[rows, num_accepted].double()  # [B, V]
    if k > 0:
        residual = p_row.clone()
        residual[rows, draft_tokens[rows, at]] = 0.0
        residual = torch.where(has_rejection.unsqueeze(-1), residual, p_row)
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p_row, residual)
    else:
        residual = p_row
    drawn = sample_from(residual, sample_uniforms)
    if k > 0:
        use_fallback = has_rejection & relaxed_branch[rows, at]
        drawn = torch.where(use_fallback, fallback[rows, at], drawn)
    relaxed = accepted & outcome.leading & relaxed_branch & ~(accept_uniforms < p_x)
    return VerifyResult(num_accepted=num_accepted, next_token=drawn, accepted=accepted,
                        relaxed=relaxed, deviation=outcome.deviation,
                        spent=charge(spent, outcome.deviation))


def fly_deferrals(
    rule: RuleConfig,
    target_probs: torch.Tensor,  # [B, k+1, V]
    plaus_probs: torch.Tensor,  # [B, k, V]
    draft_tokens: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V] or None
    accept_uniforms: torch.Tensor,  # [B, k] float64
    spent: torch.Tensor,  # [B] float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where FLy may turn a rejection into an accept, and the bound's charge there.

    Returns ``(open [B, k] bool, charge [B, k] float64)``: ``open`` = gate ∧ window ∧
    budget, ``charge = 1 − m`` (the native rejection probability of the drawn token).
    """
    _, k = draft_tokens.shape
    tok = draft_tokens.unsqueeze(-1)
    p_x = target_probs[:, :k].gather(-1, tok).squeeze(-1).double()
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, tok).squeeze(-1).double()
    m = torch.where(q_x > 0, torch.clamp(p_x / q_x.clamp_min(1e-300), max=1.0), torch.zeros_like(p_x))
    native = accept_uniforms < m  # [B, k]
    cost = (1.0 - m).clamp_min(0.0)
    if not rule.relaxes or k == 0:
        return torch.zeros_like(native), cost
    window = rule.fly_window_size
    positions = torch.arange(k, device=draft_tokens.device)
    plaus_x = plaus_probs.gather(-1, tok).squeeze(-1)
    gate = ((fly_entropy(plaus_probs, rule.fly_entropy_top_k) >= rule.fly_entropy_threshold)
            & (positions + window < k) & (plaus_x > 0) & (q_x > 0))
    # Window: native accepts at t+1 … t+W, from a cumulative count of native rejections.
    rejections = torch.cat([torch.zeros_like(native[:, :1], dtype=torch.long),
                            (~native).long().cumsum(dim=-1)], dim=-1)  # [B, k+1]
    end = (positions + window).clamp(max=k - 1)
    passes = (rejections[:, end + 1] - rejections[:, positions + 1]) == 0
    # The budget sees gated costs only (no window: that reads later uniforms, see module doc).
    # A deferral is all or nothing, so every row takes the hard budget (greedy=True): --smooth
    # does not act on fly (nsd.options), and a partial λ here would open a position whose
    # charge the remainder cannot cover.
    lam = relaxation_weights(rule, torch.where(gate, cost, torch.zeros_like(cost)), spent, True)
    return gate & passes & (lam > 0), cost


def _verify_fly(rule: RuleConfig, target_probs: torch.Tensor, plaus_probs: torch.Tensor,
                draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                accept_uniforms: torch.Tensor, sample_uniforms: torch.Tensor,
                spent: torch.Tensor) -> VerifyResult:
    opened, cost = fly_deferrals(rule, target_probs, plaus_probs, draft_tokens, draft_probs,
                                 accept_uniforms, spent)
    # An open position accepts whatever its uniform (a = 1); verify_block charges
    # λ·E = 1·cost at the emitted open positions, which is the bound's D.
    weights = opened.double()
    return verify_block(target_probs, draft_tokens, draft_probs, opened, cost, weights,
                        accept_uniforms, sample_uniforms, spent)
