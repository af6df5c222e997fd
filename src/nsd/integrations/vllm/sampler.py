"""NSD in place of vLLM's ``rejection_sample``, with vLLM's own randomness conventions.

No vLLM import here: this module only needs the few attributes of vLLM's
``SamplingMetadata`` it reads (``all_greedy``, ``all_random``, ``temperature``,
``generators``), so it is tested without vLLM installed. The acceptance math is
:mod:`nsd.rules.ragged` / :mod:`nsd.rules.verify`; what lives here is the order in which random
numbers are drawn, copied from the behaviour of vLLM 0.32's stock V1 sampler (unchanged in
0.33) so that a rule that relaxes nothing gives the stock output bit for bit:

1. if any request samples: one float64 uniform per draft token from the global generator,
   then overwritten per seeded request from its own ``torch.Generator`` (requests without
   drafts draw nothing);
2. if any request samples: one ``Exp(1)`` vector ``[V]`` per request from the global
   generator, overwritten per seeded request that has drafts (float64 when the engine
   asks for fp64 Gumbel noise).
"""

from __future__ import annotations

from typing import Any

import torch

from nsd.rules.ragged import RaggedVerifyResult, recover_tokens_ragged, verify_ragged
from nsd.rules.verify import RuleConfig

GREEDY_TEMPERATURE = 0.0  # vLLM marks greedy requests with temperature 0


def draw_accept_uniforms(
    num_tokens: int,
    num_draft_tokens: list[int],
    generators: dict[int, torch.Generator],
    device: torch.device,
) -> torch.Tensor:
    """``[num_tokens]`` float64 uniforms, drawn as vLLM draws them."""
    uniforms = torch.rand((num_tokens,), dtype=torch.float64, device=device)
    start = 0
    for req, n in enumerate(num_draft_tokens):
        if n == 0:
            continue  # a request without drafts must not advance its generator
        generator = generators.get(req)
        if generator is not None:
            uniforms[start:start + n].uniform_(generator=generator)
        start += n
    return uniforms


def draw_inv_exponentials(
    num_draft_tokens: list[int],
    vocab_size: int,
    generators: dict[int, torch.Generator],
    device: torch.device,
    fp64: bool = False,
) -> torch.Tensor:
    """``[B, V]`` reciprocals of ``Exp(1)`` draws, one vector per request, as vLLM draws them."""
    noise = torch.empty((len(num_draft_tokens), vocab_size),
                        dtype=torch.float64 if fp64 else torch.float32, device=device)
    noise.exponential_()
    for req, generator in generators.items():
        if num_draft_tokens[req] > 0:
            noise[req].exponential_(generator=generator)
    return noise.reciprocal()


def nsd_rejection_sample(
    rule: RuleConfig,
    draft_token_ids: torch.Tensor,  # [T] int32
    num_draft_tokens: list[int],  # [B] (host list, as vLLM passes it)
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,  # [B] int32
    draft_probs: torch.Tensor | None,  # [T, V] or None
    target_logits: torch.Tensor,  # [T, V] float32, temperature/top-k/top-p already applied
    bonus_token_ids: torch.Tensor,  # [B, 1]
    sampling_metadata: Any,
    spent: torch.Tensor | None = None,  # [B] float64 per-request deviation spent so far
    use_fp64_gumbel: bool = False,
    float32_uniforms: bool = False,
) -> RaggedVerifyResult:
    """The stock function's arguments in, nsd's ragged result out (see module docstring).

    ``float32_uniforms``: vLLM's CPU fallback kernel compares against the uniforms rounded
    to float32 (its Triton kernel on GPUs keeps float64); the plugin sets this on CPU so
    that nothing-relaxed stays bit-identical there too.
    """
    device = target_logits.device
    num_tokens = draft_token_ids.shape[0]
    batch = len(num_draft_tokens)
    if sampling_metadata.all_greedy:
        is_greedy = torch.ones(batch, dtype=torch.bool, device=device)
    else:
        is_greedy = sampling_metadata.temperature == GREEDY_TEMPERATURE
    generators = sampling_metadata.generators

    uniforms = None
    if not sampling_metadata.all_greedy:
        uniforms = draw_accept_uniforms(num_tokens, num_draft_tokens, generators, device)
        if float32_uniforms:
            uniforms = uniforms.float().double()
    target_argmax = target_logits.argmax(dim=-1)
    # For greedy requests this is the temperature-1 softmax: the plausibility p̂.
    target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
    recovered = None
    if not sampling_metadata.all_greedy:
        inv_exp = draw_inv_exponentials(num_draft_tokens, target_probs.shape[-1], generators,
                                        device, fp64=use_fp64_gumbel)
        recovered = recover_tokens_ragged(target_probs, draft_probs, draft_token_ids,
                                          cu_num_draft_tokens, inv_exp)
    return verify_ragged(rule, target_probs, target_argmax, draft_token_ids, cu_num_draft_tokens,
                         max_spec_len, draft_probs, bonus_token_ids, is_greedy, uniforms,
                         recovered, spent)
