"""Prompt lookup beside a draft model: the free proposer where the text repeats.

Copying a continuation of an earlier occurrence of the context's last n-gram costs
nothing, and where text repeats (code being edited, a document being summarised or
quoted, a conversation echoing itself) such copies are often accepted. Elsewhere the draft
model proposes. Which one drafts the next block, and how many tokens, is the draft-length
policy's choice (:meth:`nsd.draftlen.costmodel.CostModelK.plan` prices both: a lookup block costs
no draft steps and has its own acceptance estimate); this class only offers both.

Exactness is untouched: each block is verified against the ``q`` it was really drawn from
(one-hot for a copied block), and which proposer drafts depends only on the context.
"""

from __future__ import annotations

from typing import Sequence

import torch

from nsd.proposers.base import Proposal, Proposer
from nsd.proposers.draft_model import DraftModelProposer
from nsd.proposers.ngram import NgramProposer

# With a fixed k there is no policy to price the two proposers, so lookup drafts a block
# only after a match this long: copies after 3+ matched tokens were accepted at 0.84-0.87
# per position in every setting measured, after 1 or 2 at 0.28-0.64, below the draft
# model's 0.84-0.98 (src/nsd/acceptance_priors.json, BENCHMARKS.md).
FIXED_K_MIN_MATCH = 3


class HybridProposer(Proposer):
    """A draft model, and prompt lookup over the context for free blocks."""

    def __init__(self, draft: DraftModelProposer, lookup: NgramProposer) -> None:
        self.draft = draft
        self.lookup = lookup
        self._cached: tuple[int, int, Proposal] | None = None  # (context length, n, proposal)

    @property
    def reused_tokens(self) -> int | None:
        """The draft model's (see :class:`DraftModelProposer`); None until it drafts."""
        return self.draft.reused_tokens

    @property
    def prefill_s(self) -> float:
        """The draft model's (see :class:`nsd.proposers.base.Proposer`): lookup reads no prompt."""
        return self.draft.prefill_s

    def begin(self, prompt_length: int) -> None:
        """Where the generated tokens start (the draft model's penalties count only those)."""
        self.draft.begin(prompt_length)

    def free_length(self, context: Sequence[int], n: int) -> tuple[int, int]:
        """``(tokens, match)``: how many tokens (up to ``n``) prompt lookup can propose
        after ``context``, and the length of the n-gram it matched (the policy prices
        each match length on its own: a longer match is likelier to be copied right)."""
        if n <= 0:
            return 0, 0
        proposal, match = self.lookup.propose_matched(context, n)
        self._cached = (len(context), n, proposal)
        return len(proposal), match

    def fixed_k_lookup(self, free: int, k: int, match: int) -> bool:
        """With a fixed k: whether prompt lookup drafts the block, ``free`` tokens being
        available after a match of ``match`` tokens (see :data:`FIXED_K_MIN_MATCH`)."""
        return free >= k > 0 and match >= min(FIXED_K_MIN_MATCH, self.lookup.config.max_ngram)

    def propose(self, context: Sequence[int], k: int, generator: torch.Generator,
                lookup: bool = False) -> Proposal:
        if not lookup:
            return self.draft.propose(context, k, generator)
        cached = self._cached
        if cached is not None and cached[0] == len(context) and cached[1] >= k:
            proposal = cached[2]
        else:
            proposal = self.lookup.propose(context, k, generator)
        return Proposal(proposal.tokens[:k], None)
