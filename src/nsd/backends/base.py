"""The model backend interface.

A backend wraps one causal LM with its KV cache. The cache *owns its position and its
rewind*: the decoding loop only ever says "evaluate these new tokens" and "keep the first
``n`` positions". Everything else (dtype, threads, kernels) is the backend's business.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

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

    def forward(self, tokens: Sequence[int], all_logits: bool = True) -> torch.Tensor:
        """Append ``tokens`` to the cache and return their logits.

        Returns a float32 tensor ``[len(tokens), vocab_size]``: row ``i`` is the
        next-token logits after ``tokens[i]``. With ``all_logits=False`` only the last row
        is needed (``[1, vocab_size]``; a prefill need not compute the others).
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


@runtime_checkable
class SupportsCachedTokens(Protocol):
    """A backend that says which tokens its cache holds (llama.cpp, transformers, a
    sequence of a batch): a prefix cache and the decoding loop's prefill keep the longest
    common prefix with a new prompt instead of starting from an empty cache."""

    @property
    def num_cached(self) -> int: ...

    @property
    def cached_tokens(self) -> Sequence[int]:
        """The token ids whose KV the cache holds, in order."""
        ...


@runtime_checkable
class SupportsBatch(Protocol):
    """One sequence of a backend whose forwards run together with other sequences'
    (:class:`nsd.backends.sequences.SequenceView`): a block's cost depends on what the
    others add to the forwards it joins."""

    def batch_others(self) -> int:
        """Tokens the other sequences carried in this sequence's last forward."""
        ...


def cached_tokens(backend: Any) -> Sequence[int] | None:
    """The token ids whose KV ``backend`` holds, in order, or None when the backend does
    not say (then nothing may be reused: the caller must :meth:`~ModelBackend.reset`)."""
    if not isinstance(backend, SupportsCachedTokens):
        return None
    tokens = backend.cached_tokens
    return tokens if tokens is not None and len(tokens) == backend.num_cached else None


def eos_token_ids(backend: Any) -> Sequence[int]:
    """The end-of-sequence ids a backend read from its model file (``eos_token_ids``,
    optional: a tokenizer may name them instead), else none."""
    return getattr(backend, "eos_token_ids", ())


def device_of(backend: Any) -> torch.device:
    """Where a backend computes: its ``device`` (optional; the transformers backend has
    one), else the CPU (llama.cpp, test mocks)."""
    device = getattr(backend, "device", None)
    return torch.device(device) if device is not None else torch.device("cpu")


def context_limit(backends: Sequence[Any]) -> int | None:
    """Tokens every one of ``backends`` can hold in one sequence (llama.cpp's ``n_ctx``,
    the transformers backend's ``max_positions``), or None where none says."""
    limits = [getattr(b, attr) for b in backends if b is not None
              for attr in ("n_ctx", "max_positions") if isinstance(getattr(b, attr, None), int)]
    return min(limits) if limits else None


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
