"""The one entry point every caller verifies a block through, whichever rule.

nsd's own rules (exact, nucleus, typical: :mod:`nsd.rules.verify`) and the engines' rules
(top-K/δ, thresholds, FLy: :mod:`nsd.rules.lossy`, built on the former's block test) meet
here, above both, so neither module needs the other's entry.
"""

from __future__ import annotations

import torch

from nsd.rules.lossy import verify_lossy
from nsd.rules.verify import (RuleConfig, VerifyResult, relaxation_weights, relaxed_set_stats,
                              verify_block)


def verify(
    rule: RuleConfig,
    target_probs: torch.Tensor,  # [B, k+1, V]
    plaus_probs: torch.Tensor,  # [B, k, V] p̂ at the draft positions (== p unless greedy)
    draft_tokens: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V] or None
    accept_uniforms: torch.Tensor,  # [B, k] float64
    sample_uniforms: torch.Tensor,  # [B] float64
    spent: torch.Tensor | None = None,  # [B] float64
    greedy: torch.Tensor | bool = False,  # [B] bool or one bool: temperature-0 rows
    relaxed_probs: torch.Tensor | None = None,  # [B, k, V] untempered softmax (topk_delta, T > 0)
    mix_uniforms: torch.Tensor | None = None,  # [B, k] float64 (topk_delta, T > 0, smooth)
) -> VerifyResult:
    """Relaxed set, budget policy and block test in one call: the one entry point every
    caller verifies a block through, whichever rule (the engines' rules go to
    :func:`~nsd.rules.lossy.verify_lossy`, with one bool ``greedy``).

    ``greedy`` marks rows decoded at temperature 0 (``p`` one-hot): the budget relaxes them
    all-or-nothing (see :func:`~nsd.rules.verify.relaxation_weights`).
    """
    k = draft_tokens.shape[-1]
    if spent is None:
        spent = torch.zeros(draft_tokens.shape[0], dtype=torch.float64, device=draft_tokens.device)
    if rule.lossy:
        return verify_lossy(rule, target_probs, plaus_probs, draft_tokens, draft_probs,
                            accept_uniforms, sample_uniforms, spent, bool(greedy),
                            relaxed_probs, mix_uniforms)
    in_set, excess = relaxed_set_stats(rule, plaus_probs, target_probs[:, :k], draft_tokens, draft_probs)
    weights = relaxation_weights(rule, excess, spent, greedy)
    return verify_block(target_probs, draft_tokens, draft_probs, in_set, excess, weights,
                        accept_uniforms, sample_uniforms, spent)
