"""A llama.cpp model fed input embeddings from a token table of its own choosing.

A reduced-vocabulary draft (see :mod:`nsd.models.draft_vocab`) has only the kept tokens in its
vocabulary, so it cannot be fed a context token outside that set by id. This backend takes
ids of the *full* vocabulary, looks their rows up in the full ``token_embd`` table (kept in
a side file, exactly as quantized in the original draft), dequantizes them with gguf-py
and feeds them through llama.cpp's ``batch.embd`` input. For an architecture whose graph
applies no scale to its input embeddings (Qwen2, Llama) this is what llama.cpp's own
row lookup computes, bit for bit; tests check it. Every context token is seen exactly.

Its logits are those of the wrapped model (the reduced vocabulary).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from nsd.errors import NSDError

INPUT_TABLE = "token_embd.weight"


@dataclass(frozen=True)
class VocabMap:
    """The reduced draft's ids → target (full-vocabulary) ids: what a draft run on
    :class:`EmbeddingInputBackend` over a reduced vocabulary needs to read its logits."""

    draft_to_target: torch.Tensor  # [Vd] int64, ascending
    target_vocab_size: int

    def expand(self, probs: torch.Tensor) -> torch.Tensor:
        """Draft probabilities ``[Vd]`` → ``[V]`` with zeros on dropped tokens."""
        full = torch.zeros(self.target_vocab_size, dtype=probs.dtype, device=probs.device)
        full[self.draft_to_target.to(probs.device)] = probs
        return full


class EmbeddingTable:
    """Rows of one (possibly quantized) embedding tensor of a GGUF file, memory-mapped."""

    def __init__(self, path: str | os.PathLike[str], name: str = INPUT_TABLE) -> None:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        tensor = next((t for t in reader.tensors if t.name == name), None)
        if tensor is None:
            raise NSDError(f"{path} has no tensor {name}")
        self._rows = tensor.data  # [n_rows, bytes per row] (quantized) or [n_rows, width]
        self._qtype = tensor.tensor_type
        self.n_rows = int(tensor.shape[-1])  # gguf shapes list the row length first
        self.width = int(tensor.shape[0])

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """float32 ``[len(ids), width]``."""
        from gguf.quants import dequantize

        return dequantize(self._rows[ids], self._qtype).astype(np.float32, copy=False).reshape(len(ids), self.width)


class EmbeddingInputBackend:
    """:class:`~nsd.backends.llama_cpp.LlamaCppBackend` ``model`` whose inputs are ids into
    ``table`` (full-vocabulary ids) rather than into the model's own vocabulary."""

    def __init__(self, model: Any, table: EmbeddingTable) -> None:
        if table.width != model.n_embd:
            raise NSDError(f"input table rows have {table.width} values, the model takes {model.n_embd}")
        self.model = model
        self.table = table

    @property
    def vocab_size(self) -> int:
        """Logits per position: the wrapped model's (reduced) vocabulary."""
        return self.model.vocab_size

    @property
    def input_vocab_size(self) -> int:
        return self.table.n_rows

    @property
    def num_cached(self) -> int:
        return self.model.num_cached

    def forward(self, tokens: Sequence[int], all_logits: bool = True, seq: int = 0) -> torch.Tensor:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            return self.model.forward([], all_logits)
        return self.forward_many([(seq, ids, all_logits)])[0]

    def forward_many(self, items: Sequence[tuple[int, Sequence[int], bool]]) -> list[torch.Tensor]:
        """Several sequences' tokens in one decode (see ``LlamaCppBackend.forward_many``)."""
        arrays = [np.asarray(tokens, dtype=np.int64).reshape(-1) for _, tokens, _ in items]
        for ids in arrays:
            if ids.size == 0:
                raise ValueError("forward needs at least one token per sequence")
            if int(ids.min()) < 0 or int(ids.max()) >= self.table.n_rows:
                bad = int(ids[(ids < 0) | (ids >= self.table.n_rows)][0])
                raise ValueError(f"token id {bad} outside the vocabulary [0, {self.table.n_rows})")
        rows = self.table.lookup(np.concatenate(arrays))  # one dequantisation for all
        bounds = np.cumsum([0] + [len(ids) for ids in arrays])
        # The cache records the full-vocabulary ids, so a later prompt that shares them
        # (the next turn of a chat, a restored prefix) reuses the draft's cache too.
        return self.model.forward_embeddings_many(
            [(seq, rows[a:b], all_logits) for (seq, _, all_logits), a, b
             in zip(items, bounds[:-1], bounds[1:])], arrays)

    def rewind(self, num_tokens: int, seq: int = 0) -> None:
        self.model.rewind(num_tokens, seq)

    def reset(self, seq: int | None = None) -> None:
        self.model.reset(seq)

    def close(self) -> None:
        self.model.close()

    def __getattr__(self, name: str) -> Any:  # n_ctx, n_threads, weight_buffers, ...
        if name in ("model", "table"):
            raise AttributeError(name)
        return getattr(self.model, name)
