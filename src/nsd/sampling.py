"""The one logits → probabilities transform, shared by target and draft.

Both sides of a speculative step must warp their logits the same way, or the exact rule
stops being exact: ``p`` must be what plain autoregressive decoding would sample from, and
``q`` what the proposer really drew from. Keeping a single function for both is the
simplest way to make that true.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nsd.errors import NSDError


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a sampling distribution.

    ``temperature == 0`` means greedy: the distribution is one-hot on the argmax.
    ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` disable those filters.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise NSDError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise NSDError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise NSDError(f"top-p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p < 1):
            raise NSDError(f"min-p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Warp ``logits`` ``[..., V]`` into the sampling distribution ``[..., V]`` (float32).

    Order of filters follows the common convention (HF, llama.cpp): temperature, then
    top-k, then top-p on the renormalised remainder, then min-p.
    """
    logits = logits.float()
    if config.greedy:
        # Explicit branch: a one-hot on the argmax, ties broken by the lowest index.
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return probs
    logits = logits / config.temperature
    vocab = logits.shape[-1]
    if 0 < config.top_k < vocab:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if config.top_p < 1.0:
        probs = _top_p_filter(probs, config.top_p)
    if config.min_p > 0.0:
        floor = config.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def plausibility_probs(logits: torch.Tensor, config: SamplingConfig,
                       probs: torch.Tensor) -> torch.Tensor:
    """The target's plausibility distribution p̂ that the nucleus is taken from.

    It is ``p`` itself when sampling; under greedy decoding ``p`` is one-hot, whose nucleus
    relaxes nothing, so p̂ is then the plain softmax at temperature 1.
    """
    if config.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return probs


# Top-p looks at this many most probable tokens first; only rows whose top mass falls short
# of top-p pay for a full sort. A full sort of a 152k vocabulary costs ~15 ms per row on a
# 2-core CPU, as much as a third of a model step, on every draft and target row.
_TOP_P_CANDIDATES = 256


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most probable tokens whose mass reaches ``top_p``; among
    tokens tied at the cut, the lowest ids (the order of a stable descending sort)."""
    vocab = probs.shape[-1]
    flat = probs.reshape(-1, vocab)
    if flat.device.type == "cpu" and vocab > _TOP_P_CANDIDATES:
        kept = _top_p_from_candidates(flat, top_p)
        if kept is not None:
            return kept.reshape(probs.shape)
    # The general path (an accelerator, a nucleus wider than the candidates, a tie across
    # the cut): one full stable sort per row.
    sorted_probs, order = torch.sort(flat, dim=-1, descending=True, stable=True)
    drop_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    kept = flat.masked_fill(drop, 0.0)
    return (kept / kept.sum(dim=-1, keepdim=True)).reshape(probs.shape)


def _top_p_from_candidates(flat: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """Top-p from the ``_TOP_P_CANDIDATES`` most probable tokens of each row, or None where
    they cannot decide it: the kept count must fall inside them, and the first dropped
    candidate must be strictly below the cut (else which of the tied tokens the sorted
    order keeps depends on their ids, which a top-k does not order)."""
    values, ids = torch.topk(flat, _TOP_P_CANDIDATES, dim=-1)  # [R, C], descending
    mass_before = torch.cumsum(values, dim=-1) - values  # the same float32 sums as a sort's
    count = (mass_before < top_p).sum(dim=-1, keepdim=True)  # [R, 1], >= 1 as top_p > 0
    if not bool((count < _TOP_P_CANDIDATES).all()):
        return None
    cut = values.gather(-1, count - 1)
    if not bool((values.gather(-1, count) < cut).all()):
        return None
    keep = torch.arange(_TOP_P_CANDIDATES) < count  # [R, C]: the first `count` candidates
    values = values * keep
    out = torch.zeros_like(flat)
    return out.scatter_(-1, ids, values / values.sum(dim=-1, keepdim=True))


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: one token per row of ``probs`` ``[B, V]`` from ``uniforms`` ``[B]``.

    Unnormalised rows are fine (the CDF is scaled by the row total). Float64 throughout so
    a uniform of exactly 0 or a tiny total cannot pick a zero-probability token.
    """
    cdf = torch.cumsum(probs.double(), dim=-1)  # [B, V]
    # Uniforms are drawn on the CPU (seeded runs agree across devices); follow the probs.
    uniforms = uniforms.to(device=probs.device, dtype=torch.float64)
    target = uniforms.unsqueeze(-1) * cdf[:, -1:]  # [B, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)
