"""The proposer interface.

A proposer guesses the next ``k`` tokens of a context. It reports the distribution each
guess was drawn from (``q``), or ``None`` when the guess is deterministic (n-gram lookup,
greedy draft), in which case ``q`` is one-hot on the guess. Proposers keep whatever state
they need (a draft KV cache, an n-gram index) in sync with the context they are handed;
the decoding loop never tells them what was accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [k] int64 draft tokens; k may be shorter than asked (even 0)
    probs: torch.Tensor | None  # [k, V] float32 q for each token, or None if one-hot

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class Proposer(Protocol):
    def propose(self, context: Sequence[int], k: int, generator: torch.Generator) -> Proposal:
        """Propose up to ``k`` tokens to follow ``context`` (the whole token history)."""
        ...
