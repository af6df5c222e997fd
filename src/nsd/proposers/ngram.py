"""Prompt-lookup (n-gram) proposer: no draft model, drafts copied from the context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from nsd.errors import NSDError
from nsd.proposers.base import Proposal, Proposer


@dataclass(frozen=True)
class NgramConfig:
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise NSDError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")


class NgramProposer(Proposer):
    """Finds the most recent earlier occurrence of the context's last n-gram (longest n
    first) and proposes the tokens that followed it. Proposals are deterministic, so
    ``q`` is one-hot; NSD then accepts any of them inside the target nucleus."""

    def __init__(self, config: NgramConfig = NgramConfig()) -> None:
        self.config = config

    def propose(self, context: Sequence[int], k: int, generator: torch.Generator,
                lookup: bool = False) -> Proposal:
        return self.propose_matched(context, k)[0]

    def propose_matched(self, context: Sequence[int], k: int) -> tuple[Proposal, int]:
        """The proposal and the length of the n-gram it continues (0: no match)."""
        ids = np.asarray(context, dtype=np.int64)
        for n in range(min(self.config.max_ngram, len(ids) - 1), self.config.min_ngram - 1, -1):
            pattern = ids[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # earlier n-grams
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                follow = ids[start:start + k]
                if follow.size:
                    return Proposal(torch.from_numpy(follow.copy()), None), n
        return Proposal(torch.zeros(0, dtype=torch.long), None), 0
