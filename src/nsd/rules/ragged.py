"""NSD verification on a serving engine's flattened ("ragged") batch layout.

Serving engines such as vLLM flatten the draft positions of all requests into one token
axis: request ``b`` owns tokens ``cu[b-1] .. cu[b]-1`` of ``[num_tokens, ...]`` tensors,
where ``cu = cu_num_draft_tokens`` is the inclusive cumulative count (int32, on the
device). Requests have different numbers of drafts, and greedy and sampled requests share
a batch.

This module adapts that layout to nsd's own rule (:mod:`nsd.rules.verify`): the relaxed set and
its excess ``E`` are computed on the flat ``[num_tokens, V]`` tensors by
:func:`nsd.rules.verify.relaxed_set_stats`; only the small per-position results are gathered
into a padded ``[batch, max_spec_len]`` layout, where the budget policy
(:func:`nsd.rules.verify.relaxation_weights`) and the acceptance probability
(:func:`nsd.rules.verify.relaxed_acceptance`) are applied, the first rejection is found and
the output is scattered into the engine's ``[batch, max_spec_len + 1]`` int32 format with
``-1`` in slots that emit nothing.

Randomness follows the engine's conventions so that with nothing relaxed (θ = 0, B = 0
or an exhausted budget) the output is the engine's stock output bit for bit:

- one float64 uniform per draft token; a sampled request accepts iff
  ``u <= a`` with the exact part ``m = min(1, float32(p(x) / q(x)))``;
- the recovered token at the first rejection is an exponential race over the residual
  ``(p − q)₊`` (``argmax (p − q)₊ / e`` with one ``e ~ Exp(1)`` vector per request), which
  is an exact draw from the normalised residual;
- greedy requests verify against the target argmax, emit it on rejection, and relax
  all-or-nothing, as in the local decoder (:func:`nsd.rules.verify.relaxation_weights`): a
  partial relaxation at temperature 0 would make the output depend on the seed.

Everything is vectorised over tokens and requests; nothing is read back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsd.rules.lossy import set_stats
from nsd.rules.verify import (BlockOutcome, RuleConfig, charge, first_rejection, relaxation_weights, relaxed_acceptance,
                        relaxed_set_stats)

PLACEHOLDER_TOKEN_ID = -1  # the engine's marker for "no token in this slot"


@dataclass(frozen=True)
class RaggedVerifyResult:
    output_token_ids: torch.Tensor  # [B, K+1] int32: accepted drafts, then recovered/bonus; -1 after
    num_accepted: torch.Tensor  # [B] int64: draft tokens accepted per request
    relaxed: torch.Tensor  # [B, K] bool: accepted only thanks to the relaxed set
    deviation: torch.Tensor  # [B, K] float64: λ_t·E_t charged at emitted positions, 0 elsewhere
    spent: torch.Tensor  # [B] float64: deviation spent so far, this step included


def padded_token_index(
    cu_num_draft_tokens: torch.Tensor,  # [B] int, inclusive cumulative draft counts
    max_spec_len: int,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map the padded layout to flat token indices.

    Returns ``(index [B, K] int64, valid [B, K] bool)``; invalid slots point at
    ``num_tokens``, one past the end, so callers append one dummy element to each flat
    tensor before gathering (this also makes ``num_tokens == 0`` safe).
    """
    cu = cu_num_draft_tokens.to(torch.int64)
    prev = torch.nn.functional.pad(cu[:-1], (1, 0))  # [B] start of each request
    counts = cu - prev  # [B]
    offsets = torch.arange(max_spec_len, device=cu.device)  # [K]
    valid = offsets.unsqueeze(0) < counts.unsqueeze(1)  # [B, K]
    index = torch.where(valid, prev.unsqueeze(1) + offsets, torch.full_like(valid, num_tokens, dtype=torch.int64))
    return index, valid


def _pad(flat: torch.Tensor, index: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
    """Gather a flat ``[T]`` tensor into ``[B, K]`` with ``fill`` in invalid slots."""
    extended = torch.cat([flat, flat.new_full((1,), fill)])
    return extended[index]


def token_request_index(cu_num_draft_tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Request index of every flat token, ``[T]`` int64 (device-side, no host sync)."""
    tokens = torch.arange(num_tokens, device=cu_num_draft_tokens.device)
    return torch.searchsorted(cu_num_draft_tokens.to(torch.int64), tokens, right=True)


def recover_tokens_ragged(
    target_probs: torch.Tensor,  # [T, V] float32 p at each draft position
    draft_probs: torch.Tensor | None,  # [T, V] q, or None: q is one-hot on the draft token
    draft_token_ids: torch.Tensor,  # [T] int
    cu_num_draft_tokens: torch.Tensor,  # [B] int
    inv_exponentials: torch.Tensor,  # [B, V] 1/e with e ~ Exp(1), one vector per request
) -> torch.Tensor:
    """Recovered token per draft position: ``argmax (p − q)₊ · (1/e)``, ``[T]`` int64.

    The exponential race draws from the normalised residual ``(p − q)₊ / Z`` without
    normalising; with one-hot ``q`` the residual is ``p`` with the draft token removed.
    """
    num_tokens = draft_token_ids.shape[0]
    residual = residual_ragged(target_probs, draft_probs, draft_token_ids)
    req = token_request_index(cu_num_draft_tokens, num_tokens)
    return (residual * inv_exponentials[req]).argmax(dim=-1)


def residual_ragged(
    target_probs: torch.Tensor,  # [T, V] float32 p at each draft position
    draft_probs: torch.Tensor | None,  # [T, V] q, or None: q is one-hot on the draft token
    draft_token_ids: torch.Tensor,  # [T] int
) -> torch.Tensor:
    """The unnormalised residual ``(p − q)₊`` a rejection resamples from, ``[T, V]``.

    With one-hot ``q`` it is ``p`` with the draft token removed (a padded draft, -1,
    removes nothing, as in the engine).
    """
    if draft_probs is None:
        # Compare instead of scatter, so that -1 matches no vocabulary entry.
        vocab = torch.arange(target_probs.shape[-1], device=target_probs.device)
        drawn = vocab.unsqueeze(0) == draft_token_ids.long().unsqueeze(-1)  # [T, V]
        return torch.where(drawn, torch.zeros_like(target_probs), target_probs)
    return (target_probs - draft_probs).clamp_min(0.0)


def verify_ragged(
    rule: RuleConfig,
    target_probs: torch.Tensor,  # [T, V] float32 softmax of the processed target logits
    target_argmax: torch.Tensor,  # [T] int: argmax of the target logits (greedy requests)
    draft_token_ids: torch.Tensor,  # [T] int, -1 marks a padded draft that must be rejected
    cu_num_draft_tokens: torch.Tensor,  # [B] int
    max_spec_len: int,
    draft_probs: torch.Tensor | None,  # [T, V] q, or None for one-hot proposals
    bonus_token_ids: torch.Tensor,  # [B] or [B, 1] int: token after a fully accepted block
    is_greedy: torch.Tensor,  # [B] bool
    accept_uniforms: torch.Tensor | None,  # [T] float64; None only if every request is greedy
    recovered_token_ids: torch.Tensor | None,  # [T] int; None only if every request is greedy
    spent: torch.Tensor | None = None,  # [B] float64 deviation already spent per request
    exact_accept: torch.Tensor | None = None,  # [T] bool: the engine's own exact test
) -> RaggedVerifyResult:
    """NSD (or the exact rule) on the flat layout; see the module docstring.

    ``exact_accept``: for an engine whose exact test is not ``u <= min(1, p(x)/q(x))`` in
    this form (vLLM's Model Runner V2 compares ``log p(x) > log u + log q(x)`` in float32),
    its own per-token decision. A sampled draft is then accepted when the engine accepts it
    or, where the rule relaxes (``λ·1[x∈S] > 0``), when ``u <= a``; with nothing relaxed
    the decisions are the engine's exactly, and the acceptance probability is still
    ``a = m + λ·1[x∈S]·(1 − m)`` (the two tests differ only in the last bit of ``m``).

    ``target_probs`` plays both roles: it is ``p`` for sampled requests, and for greedy
    ones (whose logits the engine leaves at temperature 1) the plausibility ``p̂`` the
    nucleus is taken from, while their ``p`` is one-hot on ``target_argmax``.
    """
    num_tokens = draft_token_ids.shape[0]
    batch = cu_num_draft_tokens.shape[0]
    index, valid = padded_token_index(cu_num_draft_tokens, max_spec_len, num_tokens)
    if spent is None:
        spent = torch.zeros(batch, dtype=torch.float64, device=target_probs.device)

    tokens = draft_token_ids.long()
    real = tokens >= 0  # [T]
    safe_tokens = tokens.clamp_min(0)
    greedy_flat = _greedy_flat(is_greedy, cu_num_draft_tokens, num_tokens)  # [T]
    greedy_tok = _pad(greedy_flat, index, False)  # [B, K]

    # --- the rule's per-token quantities, on the flat layout
    in_set, excess = _set_stats(rule, target_probs, safe_tokens, draft_probs, greedy_flat)
    exact_random = _exact_part(target_probs, draft_probs, safe_tokens, real)  # [T] float64
    hit_argmax = tokens == target_argmax.long()

    # --- per position, padded [B, K]
    in_set = _pad(torch.where(real, in_set.double(), 0.0), index, 0.0)
    excess_rand = _pad(torch.where(real, excess, torch.zeros_like(excess)), index, 0.0)
    # Greedy: p is one-hot, q is treated as one-hot (greedy drafts), so E = w(x)·1[x ≠ argmax].
    excess_greedy = in_set * (~_pad(hit_argmax, index, True)).double()
    excess = torch.where(greedy_tok, excess_greedy, excess_rand)
    exact = torch.where(greedy_tok, _pad(hit_argmax & real, index, False).double(),
                        _pad(exact_random, index, 0.0))

    # Greedy requests relax all-or-nothing, decided inside the budget scan itself (as on
    # the local decoder's path), so the scan's running total is what is charged.
    weights = relaxation_weights(rule, excess, spent, is_greedy.to(torch.bool))  # [B, K]
    accept_prob = relaxed_acceptance(exact, in_set, weights)
    sampled_accept, sampled_relaxed = _sampled_decisions(
        accept_prob, exact, weights * in_set > 0,
        None if accept_uniforms is None else _pad(accept_uniforms, index, 1.0),
        None if exact_accept is None else _pad(exact_accept.to(torch.bool) & real, index, False))
    accepted = torch.where(greedy_tok, accept_prob >= 1.0, sampled_accept) & valid
    relaxed = accepted & torch.where(greedy_tok, exact < 1.0, sampled_relaxed)

    # --- first rejection (the same core as the local verifier); emit in the engine's format
    outcome = first_rejection(accepted, weights, excess, drafts=valid.sum(dim=-1))

    recovered_flat = target_argmax.long() if recovered_token_ids is None else \
        torch.where(greedy_flat, target_argmax.long(), recovered_token_ids.long())
    out = _output_slots(outcome, _pad(tokens, index, PLACEHOLDER_TOKEN_ID),
                        _pad(recovered_flat, index, 0), bonus_token_ids)
    return RaggedVerifyResult(
        output_token_ids=out,
        num_accepted=outcome.num_accepted,
        relaxed=relaxed & outcome.leading,
        deviation=outcome.deviation,
        # Left to right, in the budget scan's order: a pairwise sum can round an ulp past B.
        spent=charge(spent, outcome.deviation),
    )


def _set_stats(
    rule: RuleConfig,
    target_probs: torch.Tensor,  # [T, V]
    tokens: torch.Tensor,  # [T] int, padding clamped to 0
    draft_probs: torch.Tensor | None,  # [T, V] or None
    greedy_flat: torch.Tensor,  # [T] bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule's weight ``w(x)`` (1 inside a set, 0 outside) and excess ``E`` per token,
    by the local verifier's own functions (:mod:`nsd.rules.verify`, :mod:`nsd.rules.lossy`):
    the math is not restated here."""
    if rule.lossy:  # the engines' per-position rules; fly is refused at start-up
        return set_stats(rule, target_probs, target_probs, tokens, draft_probs, greedy_flat)
    return relaxed_set_stats(rule, target_probs, target_probs, tokens, draft_probs)


def _sampled_decisions(
    accept_prob: torch.Tensor,  # [B, K] float64 a
    exact: torch.Tensor,  # [B, K] float64 m
    relaxable: torch.Tensor,  # [B, K] bool: λ·1[x∈S] > 0
    uniforms: torch.Tensor | None,  # [B, K] float64 (1.0 in padding); None: all greedy
    engine_exact: torch.Tensor | None,  # [B, K] bool: the engine's own exact test, if given
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted, relaxed)`` ``[B, K]`` of a sampled request's drafts: ``u <= a``, or
    where the engine has its own exact test, that test or ``u <= a`` where the rule relaxes."""
    if uniforms is None:
        uniforms = torch.ones_like(accept_prob)  # every request greedy: never consulted
    if engine_exact is None:
        return uniforms <= accept_prob, uniforms > exact
    return engine_exact | ((uniforms <= accept_prob) & relaxable), ~engine_exact


def _exact_part(
    target_probs: torch.Tensor,  # [T, V] p
    draft_probs: torch.Tensor | None,  # [T, V] q, or None for one-hot proposals
    tokens: torch.Tensor,  # [T] int64 draft tokens, padded ones clamped to 0
    real: torch.Tensor,  # [T] bool: not a padded draft
) -> torch.Tensor:
    """``m = min(1, float32(p(x) / q(x)))`` per flat token ``[T]`` float64, 0 where the
    engine rejects outright (``q(x) = 0``, a proposer bug, and padded drafts)."""
    p_x = target_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [T] float32
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    # float32 division as the engine does it, so θ = 0 reproduces its decisions exactly.
    ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny), torch.zeros_like(p_x))
    return torch.where((q_x > 0) & real, ratio.double().clamp(max=1.0),
                       torch.zeros_like(ratio, dtype=torch.float64))


def _output_slots(
    outcome: BlockOutcome,
    draft_pad: torch.Tensor,  # [B, K] int64 drafts, PLACEHOLDER_TOKEN_ID past each row's own
    recovered: torch.Tensor,  # [B, K] int64 token to emit at a rejection, per position
    bonus_token_ids: torch.Tensor,  # [B] or [B, 1] int
) -> torch.Tensor:
    """The engine's ``[B, K + 1]`` int32 output: the accepted drafts, then the recovered
    token at the first rejection or the bonus token, ``-1`` in the slots after."""
    batch, max_spec_len = draft_pad.shape
    out = torch.full((batch, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                     device=draft_pad.device)
    out[:, :max_spec_len] = torch.where(outcome.leading, draft_pad, out[:, :max_spec_len])
    if max_spec_len > 0:
        at_rejection = recovered.gather(-1, outcome.rejected_at.unsqueeze(-1)).squeeze(-1)
    else:
        at_rejection = torch.zeros(batch, dtype=torch.int64, device=draft_pad.device)
    last = torch.where(outcome.has_rejection, at_rejection, bonus_token_ids.reshape(batch).long())
    out.scatter_(-1, outcome.num_accepted.unsqueeze(-1), last.unsqueeze(-1))
    return out.to(torch.int32)


def _greedy_flat(is_greedy: torch.Tensor, cu_num_draft_tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``is_greedy`` expanded from requests to flat tokens, ``[T]`` bool."""
    return is_greedy.to(torch.bool)[token_request_index(cu_num_draft_tokens, num_tokens)]
