"""NSD in place of Model Runner V2's ``rejection_sample``, with V2's own randomness.

vLLM's Model Runner V2 (``vllm/v1/worker/gpu/``) verifies drafts in one function,
``spec_decode/rejection_sampler_utils.rejection_sample``, on a layout of its own: every
request owns ``num_drafts + 1`` consecutive logits rows (the last one samples the bonus
token), the draft token verified at row ``r`` is ``draft_sampled[r + 1]``, draft logits
(``draft_sample_method="probabilistic"``) are cached per request state and step before
temperature, and all randomness is counter-based on the request's seed and the row's
position instead of a ``torch.Generator``:

- a sampled draft at row ``r`` is accepted when ``log p(x) > log u + log q(x)`` (float32,
  ``log q = 0`` for one-hot drafts) with ``u = tl.rand(seed, pos[r])`` kept away from 0;
  a greedy draft when it is the target argmax; a draft id of -1 is always rejected;
- the token after the accepted prefix is a Gumbel-max draw, with noise keyed by
  ``(seed, pos, token id)``, over the residual ``(p − q)₊`` at a rejection (``p`` alone
  when the rejected draft is -1) or over ``p`` at the bonus row; greedy requests emit the
  target argmax instead.

:func:`nsd_rejection_sample_v2` maps that layout onto :mod:`nsd.ragged` (the same rule as
the V1 path and the local decoder) and draws its random numbers through V2's own Triton
helpers (``tl_rand32`` and ``gumbel_noised_argmax`` from ``vllm/v1/worker/gpu/sample/
gumbel.py``), called from two small kernels of ours, so that a rule that relaxes nothing
(θ = 0, B = 0, an exhausted budget) makes V2's decisions and draws V2's tokens. Two
residual differences remain, both at the level of one float32 rounding: the log-softmax
and the residual are computed by torch here and by V2's blocked kernels there, so a
comparison or a Gumbel race whose two sides agree to the last bit can fall the other way.

Triton is imported only when this module is (V2 requires Triton anyway).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from nsd.ragged import RaggedVerifyResult, residual_ragged, token_request_index, verify_ragged
from nsd.verify import RuleConfig

try:  # V2's random-number helpers: present in vLLM 0.32 and 0.33
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_noised_argmax, tl_rand32
except ImportError:  # pragma: no cover - the plugin refuses V2 then
    gumbel_noised_argmax = tl_rand32 = None

_GUMBEL_BLOCK = 1024


@triton.jit
def _uniforms_kernel(out_ptr, seed_ptr, pos_ptr):
    row = tl.program_id(0)
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    tl.store(out_ptr + row, tl_rand32(seed, pos, includes_zero=False))


@triton.jit
def _gumbel_block_kernel(
    block_max_ptr,  # [N, num_blocks] float32/float64
    block_arg_ptr,  # [N, num_blocks] int64
    num_blocks,
    logits_ptr,  # [N, V] float32
    logits_stride,
    seed_ptr,  # [N] int64
    pos_ptr,  # [N] int64
    temp_ptr,  # [N] float32
    vocab_size,
    BLOCK: tl.constexpr,
    USE_FP64: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    block_idx = tl.program_id(1)
    block = block_idx * BLOCK + tl.arange(0, BLOCK)
    mask = block < vocab_size
    logits = tl.load(logits_ptr + row * logits_stride + block, mask=mask,
                     other=float("-inf")).to(tl.float32)
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    temp = tl.load(temp_ptr + row).to(tl.float32)
    value, idx = gumbel_noised_argmax(logits, block, mask, seed, pos, temp,
                                      IS_DRAFTING=False, USE_FP64=USE_FP64,
                                      APPLY_TEMPERATURE=False)
    tl.store(block_max_ptr + row * num_blocks + block_idx, value)
    tl.store(block_arg_ptr + row * num_blocks + block_idx, block_idx * BLOCK + idx)


def draw_uniforms_v2(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[N]`` float32: V2's acceptance uniform for each (request seed, position)."""
    out = torch.empty(seeds.shape[0], dtype=torch.float32, device=seeds.device)
    if out.numel():
        _uniforms_kernel[(out.shape[0],)](out, seeds.contiguous(), positions.contiguous())
    return out


def gumbel_argmax_v2(
    logits: torch.Tensor,  # [N, V] float32 (-inf where a token cannot be drawn)
    seeds: torch.Tensor,  # [N] int64
    positions: torch.Tensor,  # [N] int64
    temperatures: torch.Tensor,  # [N] float32: 0 means plain argmax (no noise)
    use_fp64: bool = False,
) -> torch.Tensor:
    """``[N]`` int64: V2's Gumbel-max draw per row (its noise, keyed by seed/position/token)."""
    rows, vocab = logits.shape
    if rows == 0:
        return torch.zeros(0, dtype=torch.int64, device=logits.device)
    logits = logits.float().contiguous()
    num_blocks = triton.cdiv(vocab, _GUMBEL_BLOCK)
    block_max = torch.empty(rows, num_blocks, dtype=torch.float64 if use_fp64 else torch.float32,
                            device=logits.device)
    block_arg = torch.empty(rows, num_blocks, dtype=torch.int64, device=logits.device)
    _gumbel_block_kernel[(rows, num_blocks)](
        block_max, block_arg, num_blocks, logits, logits.stride(0), seeds.contiguous(),
        positions.contiguous(), temperatures.float().contiguous(), vocab,
        BLOCK=_GUMBEL_BLOCK, USE_FP64=use_fp64)
    block_max = torch.nan_to_num(block_max, nan=float("-inf"))  # V2 maps NaN maxima to -inf
    best = block_max.argmax(dim=-1, keepdim=True)
    return block_arg.gather(-1, best).squeeze(-1)


def nsd_rejection_sample_v2(
    rule: RuleConfig,
    target_logits: torch.Tensor,  # [L, V] processed (temperature, top-k/p applied)
    draft_logits: torch.Tensor | None,  # [max_num_reqs, K, V'] pre-temperature, or None
    draft_sampled: torch.Tensor,  # [L]: row r's input token; drafts are at r + 1
    cu_num_logits: torch.Tensor,  # [R + 1]
    pos: torch.Tensor,  # [L]
    idx_mapping: torch.Tensor,  # [R] request -> request-state index
    temperature: torch.Tensor,  # [max_num_reqs]
    seed: torch.Tensor,  # [max_num_reqs]
    num_speculative_steps: int,
    spent: torch.Tensor | None = None,  # [R] float64
    use_fp64: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, RaggedVerifyResult]:
    """V2's arguments in; ``(sampled [R, K+1] int64, num_sampled [R] int32, result)`` out.

    ``sampled`` holds the accepted drafts then the recovered or bonus token, -1 after;
    ``num_sampled`` counts the tokens emitted (accepted + 1), as V2's function returns them.
    Nothing is read back to the host: the sizes come from tensor shapes.
    """
    device = target_logits.device
    num_reqs = cu_num_logits.shape[0] - 1
    num_logits = target_logits.shape[0]
    vocab = target_logits.shape[1]
    if draft_logits is not None:
        vocab = min(vocab, draft_logits.shape[-1])  # a padded target vocabulary
    logits = target_logits[:, :vocab].float()
    num_drafts = num_logits - num_reqs

    cu = cu_num_logits.to(torch.int64)
    ones = torch.arange(1, num_reqs + 1, device=device)
    cu_drafts = cu[1:] - ones  # [R] inclusive cumulative draft counts
    draft_req = token_request_index(cu_drafts, num_drafts)  # [T]
    draft_rows = torch.arange(num_drafts, device=device) + draft_req  # [T] logits row of each draft
    bonus_rows = cu[1:] - 1  # [R]
    draft_step = draft_rows - cu[:-1][draft_req]  # [T] i within the request
    tokens = draft_sampled.to(torch.int64)[draft_rows + 1]  # [T]; -1 marks a placeholder
    valid = tokens >= 0
    safe = tokens.clamp_min(0)

    state = idx_mapping.to(torch.int64)  # [R]
    req_temp = temperature.float()[state]  # [R]
    req_seed = seed.to(torch.int64)[state]  # [R]
    is_greedy = req_temp == 0.0
    tok_temp, tok_seed = req_temp[draft_req], req_seed[draft_req]
    tok_pos = pos.to(torch.int64)[draft_rows]

    row_logits = logits[draft_rows]  # [T, V]
    target_logp = row_logits.log_softmax(dim=-1)
    target_probs = row_logits.softmax(dim=-1)
    target_argmax = row_logits.argmax(dim=-1)
    draft_probs = draft_logp_x = None
    if draft_logits is not None:
        draft_rows_logits = draft_logits[state[draft_req], draft_step, :vocab]  # [T, V]
        draft_probs, draft_logp_x = _draft_distribution(draft_rows_logits, tok_temp, safe)

    # V2's exact test for sampled requests, in its float32 log form.
    uniforms = draw_uniforms_v2(tok_seed, tok_pos)  # [T] float32
    target_logp_x = target_logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    log_u_plus_q = uniforms.log() + (draft_logp_x if draft_logp_x is not None else 0.0)
    exact_accept = valid & (target_logp_x > log_u_plus_q)

    # The token drawn at a rejection: V2's Gumbel race over nsd's residual (p - q)+, or
    # over p when the rejected draft is a placeholder; greedy rows use the argmax.
    recovered = _recovered_tokens(target_probs, draft_probs, tokens, tok_seed, tok_pos,
                                  torch.where(is_greedy[draft_req], 1.0, tok_temp), use_fp64)
    # The bonus token: V2's Gumbel draw over p at the bonus row (plain argmax when greedy).
    bonus = gumbel_argmax_v2(logits[bonus_rows], req_seed, pos.to(torch.int64)[bonus_rows],
                             req_temp, use_fp64)

    result = verify_ragged(rule, target_probs, target_argmax, tokens, cu_drafts,
                           num_speculative_steps, draft_probs, bonus, is_greedy,
                           uniforms.double(), recovered, spent, exact_accept=exact_accept)
    sampled = result.output_token_ids.to(torch.int64)
    num_sampled = (result.num_accepted + 1).to(torch.int32)
    return sampled, num_sampled, result


def _draft_distribution(
    draft_logits: torch.Tensor,  # [T, V] pre-temperature draft logits of each draft position
    temperature: torch.Tensor,  # [T] float32 its request's temperature
    tokens: torch.Tensor,  # [T] int64 draft tokens (placeholders clamped to 0)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, V], log q(x) [T])``: the draft's distribution at its request's temperature.

    Greedy requests have temperature 0: their q is never used (the greedy test compares
    with the argmax); divide by 1 there to keep the tensor finite."""
    scale = torch.where(temperature == 0.0, torch.ones_like(temperature), temperature)
    scaled = draft_logits.float() / scale.unsqueeze(-1)
    draft_logp_x = scaled.log_softmax(dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return scaled.softmax(dim=-1), draft_logp_x


def _recovered_tokens(
    target_probs: torch.Tensor,  # [T, V] p
    draft_probs: torch.Tensor | None,  # [T, V] q, or None for one-hot proposals
    tokens: torch.Tensor,  # [T] int64 draft tokens, -1 for a placeholder
    seeds: torch.Tensor,  # [T] int64 the request's seed
    positions: torch.Tensor,  # [T] int64
    temperature: torch.Tensor,  # [T] float32 (1 for greedy rows)
    use_fp64: bool,
) -> torch.Tensor:
    """``[T]`` the token drawn at a rejection: V2's Gumbel race over nsd's residual
    ``(p − q)₊``, or over ``p`` where the rejected draft is a placeholder."""
    residual = residual_ragged(target_probs, draft_probs, tokens)
    residual = torch.where((tokens >= 0).unsqueeze(-1), residual, target_probs)
    residual_logits = torch.where(residual > 0, residual.log(), torch.full_like(residual, float("-inf")))
    return gumbel_argmax_v2(residual_logits, seeds, positions, temperature, use_fp64)


def v2_num_draft_tokens(cu_num_logits: torch.Tensor) -> torch.Tensor:
    """``[R]`` drafts per request from V2's ``cu_num_logits`` (device-side)."""
    return torch.diff(cu_num_logits.to(torch.int64)) - 1


def stock_kwargs_ok(kwargs: dict[str, Any]) -> bool:
    """Whether V2's call asks for nothing beyond standard verification."""
    return (not kwargs.get("use_block_verification", False)
            and kwargs.get("contexts") is None
            and not kwargs.get("fly_window_size", 0))
