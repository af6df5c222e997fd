"""The one logits → probabilities transform, shared by target and draft.

Both sides of a speculative step must warp their logits the same way, or the exact rule
stops being exact: ``p`` must be what plain autoregressive decoding would sample from, and
``q`` what the proposer really drew from. Keeping a single function for both is the
simplest way to make that true.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch

from nsd import options
from nsd.errors import NSDError


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a sampling distribution.

    ``temperature == 0`` means greedy: the distribution is one-hot on the argmax.
    ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` disable those filters.

    Before all of them, OpenAI's logit adjustments (see :func:`adjust_logits`):
    ``presence_penalty`` and ``frequency_penalty`` (by the generated tokens so far) and
    ``logit_bias`` (``(token id, bias)`` pairs).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        options.check_fields(self, options.DECODING)  # ranges are defined once, there
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        if any(t < 0 or not math.isfinite(b) for t, b in bias) or len({t for t, _ in bias}) < len(bias):
            raise NSDError("logit_bias must map distinct token ids >= 0 to finite numbers")
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalizes(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def adjusts_logits(self) -> bool:
        """True when :func:`adjust_logits` changes anything (penalties or a bias)."""
        return self.penalizes or bool(self.logit_bias)


def adjust_logits(logits: torch.Tensor, config: SamplingConfig, history: Sequence[int] = (),
                  drafts: Sequence[int] = ()) -> torch.Tensor:
    """OpenAI's logit adjustments, on raw logits ``[V]`` or ``[R, V]`` (float32 out).

    ``logit_bias`` adds its bias to each listed token. The penalties follow OpenAI's
    definition: ``l[j] -= frequency_penalty * c[j] + presence_penalty * (c[j] > 0)``, where
    ``c[j]`` counts token ``j`` among the tokens generated before the position (the prompt
    does not count). Row ``i`` is the position after ``history + drafts[:i]``, as in a
    verification block (``history``: the generated tokens before the block); a single row
    follows ``history``. Target and draft call this with the same tokens, so their
    distributions are the same transform of their logits.
    """
    if not config.adjusts_logits:
        return logits
    single = logits.dim() == 1
    rows = logits.float().reshape(1, -1) if single else logits.float()
    rows = rows.clone()
    vocab = rows.shape[-1]
    if config.logit_bias:
        pairs = [(t, b) for t, b in config.logit_bias if t < vocab]
        if pairs:
            ids = torch.tensor([t for t, _ in pairs], device=rows.device)
            rows[:, ids] += torch.tensor([b for _, b in pairs], device=rows.device)
    n_rows = rows.shape[0]
    extra = list(drafts[:n_rows - 1])
    if config.penalizes and (history or extra):
        seen = Counter(int(t) for t in history)
        tokens = sorted(set(seen) | {int(t) for t in extra})
        tokens = [t for t in tokens if t < vocab]
        column = {t: j for j, t in enumerate(tokens)}
        counts = torch.zeros(n_rows, len(tokens), dtype=torch.float32)
        for t, c in seen.items():
            if t in column:
                counts[:, column[t]] = c
        for i, t in enumerate(extra):
            if int(t) in column:
                counts[i + 1:, column[int(t)]] += 1
        penalty = config.frequency_penalty * counts + config.presence_penalty * (counts > 0).float()
        ids = torch.tensor(tokens, dtype=torch.long, device=rows.device)
        rows[:, ids] -= penalty.to(rows.device)
    return rows[0] if single else rows


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig, history: Sequence[int] = (),
                    drafts: Sequence[int] = ()) -> torch.Tensor:
    """Warp ``logits`` ``[..., V]`` into the sampling distribution ``[..., V]`` (float32).

    Order follows the common convention (HF, llama.cpp, vLLM): the logit adjustments
    (:func:`adjust_logits`, given the generated ``history`` and a block's ``drafts``), then
    temperature, then top-k, then top-p on the renormalised remainder, then min-p.
    """
    logits = adjust_logits(logits, config, history, drafts).float()
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
                       probs: torch.Tensor, history: Sequence[int] = (),
                       drafts: Sequence[int] = ()) -> torch.Tensor:
    """The target's plausibility distribution p̂ that the nucleus is taken from.

    It is ``p`` itself when sampling; under greedy decoding ``p`` is one-hot, whose nucleus
    relaxes nothing, so p̂ is then the softmax at temperature 1 of the adjusted logits
    (penalties and bias applied, as for ``p``).
    """
    if config.greedy:
        return untempered_probs(logits, config, history, drafts)
    return probs


def untempered_probs(logits: torch.Tensor, config: SamplingConfig, history: Sequence[int] = (),
                     drafts: Sequence[int] = ()) -> torch.Tensor:
    """The softmax at temperature 1 of the adjusted logits (penalties and bias applied, no
    temperature or filters): p̂ under greedy decoding, and the law top-K/δ acceptance ranks
    candidates by at any temperature (TensorRT-LLM and Modular MAX take the raw logits)."""
    return torch.softmax(adjust_logits(logits, config, history, drafts).float(), dim=-1)


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
