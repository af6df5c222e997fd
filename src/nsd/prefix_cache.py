"""Reusing the KV state of earlier prompts: the live cache, and saved recent sequences.

Two levels:

* The **live** cache. Every backend that reports its ``cached_tokens`` is reused by the
  decoding loop's prefill as far as it matches the new prompt (see :func:`nsd.decode.decode`),
  and the draft proposer does the same with the draft's cache. A multi-turn chat, whose
  every turn extends the last one, needs nothing more.
* **Saved** sequences. Before the live cache is cut back for a prompt that diverges from it
  (another conversation, an edited turn), :class:`PrefixCache` snapshots it (target and
  draft: ``save_state``), and before a generation it restores the saved snapshot sharing
  the longest prefix with the prompt when that beats the live cache. Snapshots are kept in
  least-recently-used order within a byte budget.

Reuse changes no token: a restored cache holds the very keys and values computed for those
tokens. Logits after a reused prefix equal those of a fresh prefill up to the rounding of a
different batching (llama.cpp's kernels, like any matrix kernels, accumulate a batch of 800
tokens in another order than 800 batches of one).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from nsd.backends.base import cached_tokens, common_prefix_length
from nsd.errors import NSDError

# Sequences shorter than this are not worth a snapshot (their prefill is a few ms).
MIN_SAVED_TOKENS = 16


@dataclass
class _Entry:
    target_tokens: list[int]
    target_state: Any
    draft_tokens: list[int] | None
    draft_state: Any
    nbytes: int


def _nbytes(state: Any) -> int:
    if isinstance(state, (bytes, bytearray)):
        return len(state)
    numel, size = getattr(state, "numel", None), getattr(state, "element_size", None)
    if callable(numel) and callable(size):
        return int(numel()) * int(size())
    return 0


def _saveable(backend: Any) -> bool:
    return backend is not None and hasattr(backend, "save_state") and hasattr(backend, "load_state")


class PrefixCache:
    """Saved KV snapshots of recent sequences, ``budget_bytes`` at most (0: none are
    saved, only the live cache is reused), least recently used evicted first; and the
    reuse counters of every generation the engine runs."""

    def __init__(self, budget_bytes: int, min_tokens: int = MIN_SAVED_TOKENS) -> None:
        if budget_bytes < 0:
            raise NSDError(f"the prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.min_tokens = min_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest first
        self._next_id = 0
        # Slots decoding in parallel share one cache: every entry access holds this.
        self._lock = threading.RLock()
        self.hits = 0  # generations that reused at least one prompt token
        self.misses = 0
        self.reused_tokens = 0  # prompt tokens not prefilled again
        self.draft_reused_tokens = 0  # context tokens the draft model did not read again
        self.prompt_tokens = 0
        self.restores = 0  # saved snapshots loaded back into the model
        self.saves = 0
        self.evictions = 0
        self.bytes_held = 0

    @property
    def entries(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ before / after
    def prepare(self, target: Any, draft: Any, prompt_ids: Sequence[int]) -> int:
        """Before a generation of ``prompt_ids``: put the best prefix available into the
        caches. Returns the prompt tokens the target's cache now shares with the prompt
        (what the prefill will skip)."""
        with self._lock:
            return self._prepare(target, draft, list(prompt_ids[:-1]))

    def _prepare(self, target: Any, draft: Any, want: list[int]) -> int:
        live = cached_tokens(target)
        live_keep = common_prefix_length(live, want) if live is not None else 0
        best_id, best_keep = None, 0
        for key, entry in self._entries.items():
            keep = common_prefix_length(entry.target_tokens, want)
            if keep > best_keep:
                best_id, best_keep = key, keep
        if best_id is not None and best_keep > live_keep:
            best = self._entries[best_id]
            self._entries.move_to_end(best_id)
            self._save_live(target, draft)  # (may evict `best`: it is restored all the same)
            self._restore(best, target, draft)
            return best_keep
        if live is not None and live_keep < len(live):
            self._save_live(target, draft)  # the prefill is about to cut it back
        return live_keep

    def record(self, prompt_tokens: int, reused: int, draft_reused: int | None = None) -> None:
        """Count a generation's reuse (its statistics' ``cached_prompt_tokens``, and the
        tokens its draft model found in its own cache when it first drafted, if it did)."""
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.reused_tokens += reused
            self.draft_reused_tokens += draft_reused or 0
            if reused:
                self.hits += 1
            else:
                self.misses += 1

    # ------------------------------------------------------------------ internals
    def _save_live(self, target: Any, draft: Any) -> None:
        if self.budget_bytes == 0 or not _saveable(target):
            return
        tokens = cached_tokens(target)
        if tokens is None or len(tokens) < self.min_tokens:
            return
        for key, entry in list(self._entries.items()):
            if common_prefix_length(entry.target_tokens, tokens) == len(tokens):
                with self._lock:
                    self._entries.move_to_end(key)  # already saved (or a longer one is)
                return
        t_tokens, t_state = target.save_state()
        d_tokens = d_state = None
        if _saveable(draft) and cached_tokens(draft) is not None:
            d_tokens, d_state = draft.save_state()
        entry = _Entry(t_tokens, t_state, d_tokens, d_state, _nbytes(t_state) + _nbytes(d_state))
        if entry.nbytes > self.budget_bytes:
            return
        with self._lock:
            # A saved prefix of this sequence is superseded by it.
            for key, old in list(self._entries.items()):
                if common_prefix_length(old.target_tokens, t_tokens) == len(old.target_tokens):
                    self._drop(key)
            self._entries[self._next_id] = entry
            self._next_id += 1
            self.bytes_held += entry.nbytes
            self.saves += 1
            while self.bytes_held > self.budget_bytes:
                self._drop(next(iter(self._entries)))
                self.evictions += 1

    def _drop(self, key: int) -> None:
        self.bytes_held -= self._entries.pop(key).nbytes

    def _restore(self, entry: _Entry, target: Any, draft: Any) -> None:
        target.load_state(entry.target_tokens, entry.target_state)
        if entry.draft_tokens is not None and _saveable(draft):
            draft.load_state(entry.draft_tokens, entry.draft_state)
        self.restores += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "reused_tokens": self.reused_tokens,
                    "draft_reused_tokens": self.draft_reused_tokens,
                    "prompt_tokens": self.prompt_tokens, "restores": self.restores,
                    "saves": self.saves, "evictions": self.evictions,
                    "bytes_held": self.bytes_held, "entries": len(self._entries),
                    "budget_bytes": self.budget_bytes}
