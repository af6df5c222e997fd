"""A tiny deterministic language model for fast tests of the decoding loop.

Logits depend on the last two tokens through a fixed random table, so a wrong KV rewind
(a stale token left in the cache) changes the output and is caught.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch


class MockLM:
    def __init__(self, vocab_size: int = 16, seed: int = 0, sharpness: float = 3.0,
                 eos_token_id: int | None = None) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.table = sharpness * torch.randn(vocab_size, vocab_size, vocab_size, generator=gen)
        self._tokens: list[int] = []
        self.eos_token_ids = () if eos_token_id is None else (eos_token_id,)
        self.forward_calls = 0

    @property
    def vocab_size(self) -> int:
        return int(self.table.shape[0])

    @property
    def num_cached(self) -> int:
        return len(self._tokens)

    def logits_after(self, tokens: Sequence[int]) -> torch.Tensor:
        prev = tokens[-2] if len(tokens) > 1 else 0
        return self.table[prev, tokens[-1]].clone()

    def forward(self, tokens: Sequence[int], all_logits: bool = True) -> torch.Tensor:
        self.forward_calls += 1
        rows = []
        for tok in tokens:
            self._tokens.append(int(tok))
            rows.append(self.logits_after(self._tokens))
        out = torch.stack(rows)
        return out if all_logits else out[-1:]

    def rewind(self, num_tokens: int, seq: int = 0) -> None:
        with self._bound(seq):
            assert 0 <= num_tokens <= len(self._tokens)
            del self._tokens[num_tokens:]

    def reset(self, seq: int | None = None) -> None:
        # As the real backends: ``seq`` empties that sequence alone, None empties all.
        if seq:
            with self._bound(seq):
                return self.reset(0)
        if seq is None:
            self._others = [[] for _ in getattr(self, "_others", [])]
        self._tokens = []

    # Several sequences, as the llama.cpp and transformers backends hold them for a server
    # decoding requests in parallel; forward_many records each batch's sequences.
    def set_sequences(self, n_seq: int) -> None:
        self._others: list[list[int]] = [[] for _ in range(n_seq - 1)]
        self._tokens = []
        self.batch_sizes: list[int] = []

    @contextlib.contextmanager
    def _bound(self, seq: int) -> Iterator[None]:
        if seq == 0:
            yield
            return
        mine, self._tokens = self._tokens, self._others[seq - 1]
        try:
            yield
        finally:
            self._others[seq - 1], self._tokens = self._tokens, mine

    def forward_many(self, items) -> list[torch.Tensor]:
        seqs = [seq for seq, _, _ in items]
        assert len(set(seqs)) == len(seqs), f"a sequence twice in one batch: {seqs}"
        self.batch_sizes.append(len(items))
        out = []
        for seq, tokens, all_logits in items:
            with self._bound(seq):
                out.append(self.forward(tokens, all_logits))
        return out

    def seq_num_cached(self, seq: int) -> int:
        with self._bound(seq):
            return self.num_cached

    def seq_cached_tokens(self, seq: int) -> list[int]:
        with self._bound(seq):
            return list(self._tokens)


class CachingLM(MockLM):
    """A mock LM that says which tokens its cache holds and saves/restores it, like the
    llama.cpp and transformers backends: the prefix cache and prefill reuse apply."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.fed_tokens = 0  # tokens evaluated, over all forwards

    def forward(self, tokens: Sequence[int], all_logits: bool = True) -> torch.Tensor:
        self.fed_tokens += len(tokens)
        return super().forward(tokens, all_logits)

    @property
    def cached_tokens(self) -> list[int]:
        return list(self._tokens)

    def save_state(self, seq: int = 0) -> tuple[list[int], bytes]:
        with self._bound(seq):
            return list(self._tokens), bytes(8 * len(self._tokens))

    def load_state(self, tokens: Sequence[int], state: bytes, seq: int = 0) -> None:
        assert len(state) == 8 * len(tokens)
        with self._bound(seq):
            self._tokens = list(tokens)


def cycle_lm(vocab_size: int, margin: float = 20.0) -> MockLM:
    """A target whose greedy continuation of token ``i`` is ``i + 1`` (mod V), by ``margin``
    logits over every other token: periodic text that n-gram lookup drafts far ahead."""
    lm = MockLM(vocab_size=vocab_size)
    lm.table = torch.zeros(vocab_size, vocab_size, vocab_size)
    nxt = (torch.arange(vocab_size) + 1) % vocab_size
    lm.table[:, torch.arange(vocab_size), nxt] = margin
    return lm


class CharTokenizer:
    """Token ``i`` <-> the ``i``-th character of ``alphabet``: enough of a Hugging Face
    tokenizer for :class:`nsd.api.Engine`."""

    eos_token_id = None
    chat_template = None

    def __init__(self, alphabet: str = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") -> None:
        self.alphabet = alphabet

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.alphabet.index(c) for c in text]

    def decode(self, tokens: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.alphabet[int(t)] for t in tokens)


class ScriptLM(MockLM):
    """A target whose greedy continuation is a fixed token script: after ``n`` tokens of
    context it predicts ``script[n]`` (by ``margin`` logits), whatever those tokens are."""

    def __init__(self, script: Sequence[int], vocab_size: int = 256, margin: float = 20.0) -> None:
        self.table = torch.zeros(vocab_size, 1, 1)  # only its first size is read (vocab_size)
        self._tokens = []
        self.eos_token_ids = ()
        self.forward_calls = 0
        self.script = list(script)
        self.margin = margin

    def logits_after(self, tokens: Sequence[int]) -> torch.Tensor:
        logits = torch.zeros(self.vocab_size)
        logits[self.script[len(tokens) % len(self.script)]] = self.margin
        return logits


class ByteTokenizer:
    """Token ``i`` <-> byte ``i`` (UTF-8), decoded as Hugging Face byte-level tokenizers do:
    a split multi-byte character renders as U+FFFD."""

    eos_token_id = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: Sequence[int], skip_special_tokens: bool = False) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
