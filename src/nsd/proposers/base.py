"""The proposer interface.

A proposer guesses the next ``k`` tokens of a context. It reports the distribution each
guess was drawn from (``q``), or ``None`` when the guess is deterministic (n-gram lookup,
greedy draft), in which case ``q`` is one-hot on the guess. Proposers keep whatever state
they need (a draft KV cache, an n-gram index) in sync with the context they are handed;
the decoding loop never tells them what was accepted.

:class:`Proposer` is the whole interface the loop uses. A proposer subclasses it and
overrides what it does; the rest keeps the no-op defaults here (a proposer with a single
source has no free tokens to offer and never hands a block to prompt lookup).
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
    # Context tokens the first block found already in the proposer's own cache (None: it
    # keeps none, or has not drafted yet); a prefix cache reports it.
    reused_tokens: int | None = None
    # Of the current generation's time in propose(), the seconds spent reading the prompt
    # (a draft model's first catch-up): a once-per-request cost, reported apart from the
    # per-block drafting it would otherwise inflate. 0 where the proposer reads no prompt.
    prefill_s: float = 0.0

    def propose(self, context: Sequence[int], k: int, generator: torch.Generator,
                lookup: bool = False) -> Proposal:
        """Propose up to ``k`` tokens to follow ``context`` (the whole token history);
        with ``lookup``, from the free source :meth:`free_length` measured."""
        ...

    def begin(self, prompt_length: int) -> None:
        """A generation starts: the context's first ``prompt_length`` tokens are the prompt
        (penalties count only the generated ones)."""

    def free_length(self, context: Sequence[int], n: int) -> tuple[int, int]:
        """``(tokens, match)``: how many tokens (up to ``n``) a free source (prompt lookup
        beside a draft model) could propose after ``context``, and the n-gram length it
        matched. A single-source proposer has none."""
        return 0, 0

    def fixed_k_lookup(self, free: int, k: int, match: int) -> bool:
        """With a policy that does not price the free source (fixed or adaptive k): whether
        it drafts the next block of ``k``."""
        return False
