"""A slow, obviously-correct reference of vLLM 0.32's stock rejection rule, in pure torch.

Written from reading ``vllm/v1/sample/rejection_sampler.py`` (``rejection_sample`` and
its three Triton kernels), one request and one position at a time, so tests can pin nsd's
vectorised ragged code to the stock behaviour without vLLM installed:

- greedy request: accept while ``draft == argmax(target_logits)``; the slot of the first
  mismatch gets the argmax; a fully accepted block gets the bonus token;
- sampled request: accept while ``q(x) > 0`` and ``float32(p(x) / q(x)) >= u`` (``q(x) = 1``
  without draft probabilities; a draft id of -1 is always rejected); the first rejected
  slot gets ``argmax_v (p − q)₊(v) / e(v)`` with the request's ``Exp(1)`` vector ``e``;
- random numbers: uniforms ``[T]`` float64 then exponentials ``[B, V]``, both from the
  global generator and then overwritten for seeded requests that have drafts, and neither
  drawn when every request is greedy.
"""

from __future__ import annotations

import torch


def stock_rejection_sample(
    draft_token_ids: torch.Tensor,  # [T]
    num_draft_tokens: list[int],  # [B]
    max_spec_len: int,
    draft_probs: torch.Tensor | None,  # [T, V]
    target_logits: torch.Tensor,  # [T, V] float32
    bonus_token_ids: torch.Tensor,  # [B, 1]
    is_greedy: list[bool],  # [B]
    generators: dict[int, torch.Generator],
    float32_uniforms: bool = False,  # vLLM's CPU kernel compares with float32(u)
) -> torch.Tensor:
    batch, vocab = len(num_draft_tokens), target_logits.shape[-1]
    num_tokens = draft_token_ids.shape[0]
    all_greedy = all(is_greedy)
    out = torch.full((batch, max_spec_len + 1), -1, dtype=torch.int32)
    uniforms = exps = None
    if not all_greedy:
        uniforms = torch.rand((num_tokens,), dtype=torch.float64)
        start = 0
        for b, n in enumerate(num_draft_tokens):
            if n and b in generators:
                uniforms[start:start + n].uniform_(generator=generators[b])
            start += n
        if float32_uniforms:
            uniforms = uniforms.float().double()
    argmax = target_logits.argmax(dim=-1)
    if not all_greedy:
        probs = target_logits.softmax(dim=-1, dtype=torch.float32)
        exps = torch.empty((batch, vocab), dtype=torch.float32)
        exps.exponential_()
        for b, gen in generators.items():
            if num_draft_tokens[b] > 0:
                exps[b].exponential_(generator=gen)
        inv = exps.reciprocal()
    start = 0
    for b, n in enumerate(num_draft_tokens):
        rejected = False
        for pos in range(n):
            t = start + pos
            x = int(draft_token_ids[t])
            if is_greedy[b]:
                tok = int(argmax[t])
                rejected = x != tok
            else:
                if x < 0:
                    ok = False
                else:
                    q_x = torch.tensor(1.0) if draft_probs is None else draft_probs[t, x]
                    p_x = probs[t, x]
                    ok = bool(q_x > 0) and bool((p_x / q_x).double() >= uniforms[t])
                if ok:
                    tok = x
                else:
                    rejected = True
                    if draft_probs is None:
                        resid = probs[t].clone()
                        if x >= 0:
                            resid[x] = 0.0
                    else:
                        resid = (probs[t] - draft_probs[t]).clamp_min(0.0)
                    tok = int((resid * inv[b]).argmax())
            out[b, pos] = tok
            if rejected:
                break
        if not rejected:
            out[b, n] = int(bonus_token_ids[b, 0])
        start += n
    return out
