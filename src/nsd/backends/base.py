"""The model backend interface.

A backend wraps one causal LM with its KV cache. The cache *owns its position and its
rewind*: the decoding loop only ever says "evaluate these new tokens" and "keep the first
``n`` positions". Everything else (dtype, threads, kernels) is the backend's business.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class ModelBackend(Protocol):
    """A causal LM with a rewindable KV cache, batch size 1."""

    @property
    def vocab_size(self) -> int:
        """Size of the logits' last dimension."""
        ...

    @property
    def num_cached(self) -> int:
        """Number of token positions currently held in the KV cache."""
        ...

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` to the cache and return their logits.

        Returns a float32 tensor ``[len(tokens), vocab_size]``: row ``i`` is the
        next-token logits after ``tokens[i]``.
        """
        ...

    def rewind(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` cached positions, drop the rest.

        After ``rewind(n)`` followed by ``forward(t)``, the logits must equal those of a
        fresh cache fed ``prefix[:n] + t`` with the same batching.
        """
        ...

    def reset(self) -> None:
        """Empty the cache."""
        ...
