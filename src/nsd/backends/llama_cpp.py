"""A :class:`~nsd.backends.base.ModelBackend` over llama.cpp (via llama-cpp-python).

Only llama.cpp's C API is used (through llama-cpp-python's ctypes bindings), not its
high-level ``Llama`` class: that class keeps its own token/score buffers and would copy
every logits row through Python. Here one :meth:`LlamaCppBackend.forward` of ``n`` tokens
is exactly one ``llama_decode`` call, and its logits leave llama.cpp's output buffer in
a single ``memcpy``-like copy into a torch tensor.

The KV cache holds one sequence (id 0) unless :meth:`LlamaCppBackend.set_sequences`
asks for several (a server decoding several requests in one ``llama_decode``: see
:meth:`LlamaCppBackend.forward_many`); every cache method takes the sequence as ``seq``.
:meth:`rewind` drops positions with ``llama_memory_seq_rm``, which gives logits identical
to a fresh context fed the same tokens in the same batches. Note that a *different* batching of the same tokens (one
call of 8 versus 8 calls of 1) is not bit-identical in llama.cpp: the matrix kernels
accumulate in a different order.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import numpy as np
import torch

from nsd.errors import NSDError
from nsd.backends.files import check_gguf

_INSTALL_HINT = (
    "the llama.cpp backend needs llama-cpp-python, built for this CPU; run "
    "scripts/install.sh from the project root (it builds and installs it once)"
)

# The sequence a single-sequence caller uses (every cache method's default ``seq``).
_SEQ = 0
# llama.cpp's own bound on n_seq_max (LLAMA_MAX_SEQ).
MAX_SEQUENCES = 64


# ggml log levels (ggml.h): only errors are worth showing a user.
_GGML_LOG_ERROR = 3
_GGML_LOG_CONT = 5


class _LlamaLog:
    """llama.cpp's log sink.

    llama.cpp logs hundreds of lines per model load. We show only errors, on stderr, and
    while a model loads we hold even those back: a Qwen2.5 GGUF logs a harmless
    "control-looking token" *error* every time. If the load fails, the held lines go into
    the NSDError message instead. During a load it also notes the weight buffers llama.cpp
    reports ("CPU_REPACK model buffer size = …", "AMX model buffer size = …"): which
    kernels the weights were laid out for, which no API call tells.
    """

    def __init__(self) -> None:
        self.held: list[str] | None = None
        self.buffers: list[str] = []
        self._last_level = 0

    def __call__(self, level: int, text: bytes, _user_data: object) -> None:
        if level != _GGML_LOG_CONT:
            self._last_level = level
        if self.held is not None and b"model buffer size" in text:
            self.buffers.append(text.decode("utf-8", errors="replace").split(":", 1)[-1]
                                .split("model buffer size")[0].strip())
        if self._last_level != _GGML_LOG_ERROR:
            return
        line = text.decode("utf-8", errors="replace")
        if self.held is not None:
            self.held.append(line)
        else:
            sys.stderr.write(line)


llama_log = _LlamaLog()
_log_callback: Any = None  # the ctypes wrapper; must stay referenced while installed


def import_llama_cpp() -> ModuleType:
    """Import llama_cpp lazily (the rest of nsd works without it) and quiet its log."""
    global _log_callback
    try:
        import llama_cpp
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise NSDError(f"cannot import llama_cpp ({exc}); {_INSTALL_HINT}") from exc
    if _log_callback is None:
        _log_callback = llama_cpp.llama_log_callback(llama_log)
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
    return llama_cpp


class LlamaCppBackend:
    """One GGUF model with a rewindable KV cache, batch size 1, on the CPU.

    Args:
        gguf_path: the model file.
        n_threads: CPU threads for every decode (default: all cores ``os.cpu_count()``).
        n_ctx: KV cache capacity in tokens; a forward that would exceed it raises
            :class:`NSDError`.
        seed: accepted for parity with the other backends; the backend only returns
            logits (sampling happens outside), so nothing here is random.
        use_extra_bufts: let llama.cpp repack weights into CPU-specific layouts (its
            default). On a 2-core AVX-512 machine this made the Q4_K_M 1.5B model ~20%
            faster per step and changed nothing for Q5_0/Q8_0 weights. On AMX CPUs the AMX
            kernels are such an extra buffer type (``scripts/install.sh`` builds them with
            the tile-config patch that stops their crash under GCC < 13); off, the plain CPU
            kernels run. :attr:`weight_buffers` says which were used. Logits differ
            slightly (~0.3 max) between the two settings, so keep it fixed within a run.
        flash_attn: use llama.cpp's flash-attention kernels (``None``: llama.cpp decides).
            Off by default, as in llama-cpp-python's ``Llama``: on a 2-core AMD EPYC (Zen 4)
            llama.cpp's automatic choice turned them on and a 1.5B Q4_K_M step took ~11%
            longer (51.7 vs 46.2 ms, 256 cached tokens, median of 15).
    """

    def __init__(
        self,
        gguf_path: str | os.PathLike[str],
        n_threads: int | None = None,
        n_ctx: int = 4096,
        seed: int = 0,
        *,
        use_extra_bufts: bool = True,
        flash_attn: bool | None = False,
    ) -> None:
        path = Path(gguf_path)
        if not path.is_file():
            raise NSDError(f"GGUF model file not found: {path}")
        check_gguf(path)  # a clear message for a damaged file, before llama.cpp sees it
        if n_ctx < 1:
            raise NSDError(f"n_ctx must be positive, got {n_ctx}")
        threads = n_threads if n_threads is not None else (os.cpu_count() or 1)
        if threads < 1:
            raise NSDError(f"n_threads must be positive, got {n_threads}")
        self._lib = lib = import_llama_cpp()
        self.seed = seed
        self._model: Any = None
        self._ctx: Any = None
        self._batch: Any = None
        self._embd_batch: Any = None
        self._embd_cap = 0
        lib.llama_backend_init()

        mparams = lib.llama_model_default_params()
        mparams.use_extra_bufts = use_extra_bufts
        mparams.n_gpu_layers = 0
        llama_log.held, llama_log.buffers = [], []
        try:
            self._model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        finally:
            held, llama_log.held = llama_log.held, None
            # e.g. ("CPU_Mapped", "CPU_REPACK") or, with ggml's AMX kernels, ("AMX", ...).
            self.weight_buffers: tuple[str, ...] = tuple(dict.fromkeys(llama_log.buffers))
        if not self._model:
            # One line: llama.cpp's held log lines, joined; an unknown architecture or
            # tensor type is named there.
            detail = "; ".join(line.strip() for line in held if line.strip())
            raise NSDError(f"llama.cpp could not load {path}: {detail or 'not a valid GGUF model?'}")

        self._n_threads = threads
        self.flash_attn = flash_attn
        self._eog_ids: tuple[int, ...] | None = None
        self._batch_cap = 0
        self._vocab = lib.llama_model_get_vocab(self._model)
        self._n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        self._make_context(n_ctx, 1)

    def _make_context(self, n_ctx: int, n_seq: int) -> None:
        """A context of ``n_seq`` sequences of ``n_ctx`` tokens each, all caches empty."""
        lib = self._lib
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx * n_seq
        # n_batch bounds the tokens of one llama_decode call; letting it equal the whole
        # context means any forward that fits the caches is a single call. Compute buffers
        # scale with n_ubatch (left at its default), not with n_batch.
        cparams.n_batch = n_ctx * n_seq
        cparams.n_seq_max = n_seq
        # One unified KV buffer for all sequences. With a stream per sequence llama.cpp
        # splits a batch into micro-batches of equal token counts over consecutive
        # sequence ids ("split_equal"), so a batch of sequences {0, 2}, or of a prefill
        # beside one-token steps, became several forwards; unified, any batch is one.
        # On a 2-core Zen 4 (Q4_0 1.5B, four requests of 40-90 tokens; an exploratory
        # measurement, BENCHMARKS.md "Serving: several requests per forward") a forward of one
        # token each took 63 ms unified against 83 ms per stream. The price: each query
        # attends over every sequence's cells (masked), so long contexts in many
        # sequences cost more (16 sequences of 300 tokens: 266 ms against 174 ms).
        cparams.kv_unified = n_seq > 1
        cparams.n_threads = self._n_threads
        cparams.n_threads_batch = self._n_threads
        cparams.no_perf = True
        if self.flash_attn is not None:
            cparams.flash_attn_type = (
                lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
                if self.flash_attn
                else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            self.close()
            raise NSDError(f"llama.cpp could not create a context of {n_seq} x {n_ctx} tokens")
        self._memory = lib.llama_get_memory(self._ctx)
        # llama.cpp rounds the context up (to a multiple of 256); each sequence is allowed
        # what was asked for, no more: n_batch is the asked size, so a forward longer than
        # it would abort inside llama.cpp instead of raising "context full".
        self._n_ctx = min(n_ctx, int(lib.llama_n_ctx(self._ctx)) // n_seq)
        self._n_seq = n_seq
        self._cached = [0] * n_seq  # positions each sequence's cache holds
        # The ids whose KV each sequence holds (-1: a position fed as an embedding without
        # the id it stands for).
        self._seq_tokens: list[list[int]] = [[] for _ in range(n_seq)]

    def set_sequences(self, n_seq: int) -> None:
        """Hold ``n_seq`` independent sequences (ids ``0 .. n_seq - 1``) of :attr:`n_ctx`
        tokens each, for :meth:`forward_many`. A new context: every cache is emptied."""
        if not 1 <= n_seq <= MAX_SEQUENCES:
            raise NSDError(f"the number of sequences must be in [1, {MAX_SEQUENCES}], got {n_seq}")
        if n_seq == self._n_seq:
            return
        n_ctx = self._n_ctx
        self._lib.llama_free(self._ctx)
        self._ctx = None
        self._make_context(n_ctx, n_seq)

    @property
    def n_sequences(self) -> int:
        """Sequences the cache holds (see :meth:`set_sequences`)."""
        return self._n_seq

    # ----------------------------------------------------------------- properties

    @property
    def vocab_size(self) -> int:
        """Size of the logits' last dimension (llama.cpp's ``n_vocab``)."""
        return self._n_vocab

    @property
    def num_cached(self) -> int:
        """Number of token positions currently held in the KV cache (of sequence 0)."""
        return self._cached[_SEQ]

    @property
    def cached_tokens(self) -> list[int]:
        """The token ids whose KV the cache holds, in order (a copy; sequence 0)."""
        return list(self._seq_tokens[_SEQ])

    def seq_num_cached(self, seq: int) -> int:
        """:attr:`num_cached` of sequence ``seq``."""
        return self._cached[seq]

    def seq_cached_tokens(self, seq: int) -> list[int]:
        """:attr:`cached_tokens` of sequence ``seq``."""
        return list(self._seq_tokens[seq])

    @property
    def n_ctx(self) -> int:
        """KV cache capacity in tokens (of each sequence)."""
        return self._n_ctx

    @property
    def n_threads(self) -> int:
        """CPU threads used by every decode."""
        return self._n_threads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence token the GGUF declares (``tokenizer.ggml.eos_token_id``).

        This is the same id the transformers backend reports for a model converted from
        the same file, so both backends stop at the same place. llama.cpp's wider
        end-of-generation set is :attr:`eog_token_ids`.
        """
        eos = int(self._lib.llama_vocab_eos(self._vocab))
        return (eos,) if 0 <= eos < self._n_vocab else ()

    @property
    def eog_token_ids(self) -> tuple[int, ...]:
        """Every token llama.cpp treats as end of generation for this vocabulary.

        Besides EOS/EOT this includes special tokens it recognises by name (for
        Qwen2.5: ``<|endoftext|>``, ``<|im_end|>``, the FIM/repo separators, ``</s>``).
        """
        if self._eog_ids is None:
            lib, vocab = self._lib, self._vocab
            # One ctypes call per token (~0.05 s for 150k tokens), so computed once, lazily.
            self._eog_ids = tuple(t for t in range(self._n_vocab) if lib.llama_vocab_is_eog(vocab, t))
        return self._eog_ids

    # ----------------------------------------------------------------- the protocol

    def forward(self, tokens: Sequence[int], all_logits: bool = True, seq: int = _SEQ) -> torch.Tensor:
        """Append ``tokens`` to the cache in one ``llama_decode`` and return logits.

        Returns float32 ``[len(tokens), vocab_size]`` (row ``i`` follows ``tokens[i]``),
        or only the last row ``[1, vocab_size]`` when ``all_logits`` is false — cheaper,
        since llama.cpp then computes the output projection for one position only.
        """
        ids = np.asarray(tokens, dtype=np.int32).reshape(-1)
        if ids.shape[0] == 0:
            if not all_logits:
                raise ValueError("forward(all_logits=False) needs at least one token")
            return torch.empty((0, self._n_vocab), dtype=torch.float32)
        return self.forward_many([(seq, ids, all_logits)])[0]

    def forward_many(self, items: Sequence[tuple[int, Sequence[int], bool]]) -> list[torch.Tensor]:
        """Several sequences' new tokens in one ``llama_decode``: ``items`` are
        ``(seq, tokens, all_logits)``, one per sequence; returns each one's logits, as
        :meth:`forward` would. Nothing is decoded when any item is invalid."""
        # In sequence order, as llama.cpp's batch splitting prefers them.
        order = sorted(range(len(items)), key=lambda i: int(items[i][0]))
        if order != list(range(len(items))):
            out = self.forward_many([items[i] for i in order])
            return [out[order.index(i)] for i in range(len(items))]
        arrays = [np.asarray(tokens, dtype=np.int32).reshape(-1) for _, tokens, _ in items]
        for (seq, _, _), ids in zip(items, arrays):
            if ids.shape[0] == 0:
                raise ValueError("forward needs at least one token per sequence")
            if int(ids.min()) < 0 or int(ids.max()) >= self._n_vocab:
                bad = int(ids[(ids < 0) | (ids >= self._n_vocab)][0])
                raise ValueError(f"token id {bad} outside the vocabulary [0, {self._n_vocab})")
        spans = self._spans(items, [len(ids) for ids in arrays])
        total = sum(len(ids) for ids in arrays)
        self._ensure_batch(total)
        self._tok_view[:total] = np.concatenate(arrays)
        return self._decode(self._batch, self._pos_view, self._out_view, self._batch_seqs,
                            spans, arrays)

    def _spans(self, items: Sequence[tuple[Any, ...]], lengths: list[int]
               ) -> list[tuple[int, int, bool]]:
        """``(seq, n, all_logits)`` per item, checked: known distinct sequences, room."""
        if self._ctx is None:
            raise RuntimeError("forward on a closed LlamaCppBackend")
        spans = [(int(item[0]), n, bool(item[2])) for item, n in zip(items, lengths)]
        seqs = [seq for seq, _, _ in spans]
        if len(set(seqs)) != len(seqs) or not all(0 <= s < self._n_seq for s in seqs):
            raise ValueError(f"sequences {seqs}: each must appear once, in [0, {self._n_seq})")
        for seq, n, _ in spans:
            self._check_room(n, seq)
        return spans

    @property
    def n_embd(self) -> int:
        """Width of the model's input embeddings (what :meth:`forward_embeddings` takes)."""
        return int(self._lib.llama_model_n_embd(self._model))

    def forward_embeddings(self, embd: np.ndarray, all_logits: bool = True,
                           seq: int = _SEQ, tokens: Sequence[int] | None = None) -> torch.Tensor:
        """Like :meth:`forward`, but the new positions are given as input embeddings
        ``[n, n_embd]`` (float32) instead of token ids: llama.cpp's ``batch.embd`` input,
        which enters the graph where the token-embedding lookup would have been. For an
        architecture that applies no scale to its input embeddings (Qwen2, Llama), the
        rows of ``token_embd`` give the same logits as the token ids.

        ``tokens``, when given, are the ids the rows stand for (of whatever vocabulary the
        caller embeds): :attr:`cached_tokens` records them, so a later prompt sharing them
        reuses the cache. Without them the positions record -1, which matches no prompt."""
        return self.forward_embeddings_many([(seq, embd, all_logits)],
                                            None if tokens is None else [tokens])[0]

    def forward_embeddings_many(self, items: Sequence[tuple[int, np.ndarray, bool]],
                                tokens: Sequence[Sequence[int]] | None = None
                                ) -> list[torch.Tensor]:
        """:meth:`forward_many` for input embeddings: ``(seq, embd [n, n_embd], all_logits)``;
        ``tokens``: the ids each item's rows stand for (see :meth:`forward_embeddings`)."""
        width = self.n_embd
        arrays = [np.ascontiguousarray(embd, dtype=np.float32) for _, embd, _ in items]
        for embd in arrays:
            if embd.ndim != 2 or embd.shape[1] != width:
                raise ValueError(f"input embeddings must have shape [n, {width}], got {list(embd.shape)}")
            if embd.shape[0] == 0:
                raise ValueError("forward_embeddings needs at least one position")
        ids = None
        if tokens is not None:
            ids = [np.asarray(t, dtype=np.int64).reshape(-1) for t in tokens]
            if [len(t) for t in ids] != [embd.shape[0] for embd in arrays]:
                raise ValueError("forward_embeddings: one token id per embedding row")
        spans = self._spans(items, [embd.shape[0] for embd in arrays])
        total = sum(embd.shape[0] for embd in arrays)
        self._ensure_embd_batch(total)
        self._embd_view[:total] = np.concatenate(arrays)
        return self._decode(self._embd_batch, self._embd_pos_view, self._embd_out_view,
                            self._embd_batch_seqs, spans, ids)

    def _check_room(self, n: int, seq: int = _SEQ) -> None:
        if self._cached[seq] + n > self._n_ctx:
            raise NSDError(
                f"context full: {self._cached[seq]} cached + {n} new tokens exceeds the "
                f"model context of {self._n_ctx} tokens (use a shorter prompt or fewer "
                f"new tokens, or a larger n_ctx)"
            )

    def _decode(self, batch: Any, pos_view: np.ndarray, out_view: np.ndarray,
                batch_seqs: np.ndarray, spans: list[tuple[int, int, bool]],
                ids: list[np.ndarray] | None) -> list[torch.Tensor]:
        """One ``llama_decode`` of the positions already written into ``batch``, span
        after span (``ids``: each span's token ids, or None for input embeddings that
        stand for no known ids)."""
        start = 0
        for seq, n, all_logits in spans:
            end = start + n
            pos_view[start:end] = np.arange(self._cached[seq], self._cached[seq] + n, dtype=np.int32)
            out_view[start:end] = 1 if all_logits else 0
            out_view[end - 1] = 1
            if (batch_seqs[start:end] != seq).any():  # ctypes writes only where it changed
                for i in range(start, end):
                    batch.seq_id[i][0] = seq
                batch_seqs[start:end] = seq
            start = end
        batch.n_tokens = start

        ret = self._lib.llama_decode(self._ctx, batch)
        if ret != 0:
            # On failure llama.cpp may keep part of the batch; restore our invariant.
            for seq, _, _ in spans:
                self._lib.llama_memory_seq_rm(self._memory, seq, self._cached[seq], -1)
            raise RuntimeError(f"llama_decode failed with status {ret} on {start} tokens")
        # Outputs are stored contiguously in batch order: [n_outputs, n_vocab].
        rows = [n if all_logits else 1 for _, n, all_logits in spans]
        ptr = self._lib.llama_get_logits(self._ctx)
        view = np.ctypeslib.as_array(ptr, shape=(sum(rows), self._n_vocab))
        out = torch.empty((sum(rows), self._n_vocab), dtype=torch.float32)
        np.copyto(out.numpy(), view)
        for i, (seq, n, _) in enumerate(spans):
            self._cached[seq] += n
            # Positions fed as embeddings without their ids hold none: -1 matches no
            # prompt, so a reused cache never claims them.
            self._seq_tokens[seq].extend([-1] * n if ids is None else ids[i].tolist())
        return list(out.split(rows)) if len(spans) > 1 else [out]

    def rewind(self, num_tokens: int, seq: int = _SEQ) -> None:
        """Keep the first ``num_tokens`` cached positions, drop the rest."""
        if not 0 <= num_tokens <= self._cached[seq]:
            raise ValueError(
                f"cannot rewind to {num_tokens} tokens: the cache holds {self._cached[seq]}"
            )
        if num_tokens == self._cached[seq]:
            return
        if not self._lib.llama_memory_seq_rm(self._memory, seq, num_tokens, -1):
            # Only recurrent/hybrid models refuse a partial removal.
            raise NSDError("this model's cache cannot be rewound (recurrent model?)")
        self._cached[seq] = num_tokens
        del self._seq_tokens[seq][num_tokens:]

    def reset(self, seq: int | None = None) -> None:
        """Empty the cache (of sequence ``seq`` only, when given)."""
        if seq is None:
            self._lib.llama_memory_clear(self._memory, True)
            self._cached = [0] * self._n_seq
            self._seq_tokens = [[] for _ in range(self._n_seq)]
            return
        self._lib.llama_memory_seq_rm(self._memory, seq, -1, -1)
        self._cached[seq], self._seq_tokens[seq] = 0, []

    def save_state(self, seq: int = _SEQ) -> tuple[list[int], bytes]:
        """A snapshot of the cache: the token ids it holds and llama.cpp's serialised state
        of the sequence (its KV cells), restorable with :meth:`load_state`."""
        lib = self._lib
        size = int(lib.llama_state_seq_get_size(self._ctx, seq))
        buf = (ctypes.c_uint8 * size)()
        written = int(lib.llama_state_seq_get_data(self._ctx, buf, size, seq))
        if written == 0 and self._cached[seq]:
            raise NSDError("llama.cpp could not save the cache state")
        return list(self._seq_tokens[seq]), bytes(memoryview(buf)[:written])

    def load_state(self, tokens: Sequence[int], state: bytes, seq: int = _SEQ) -> None:
        """Replace the cache with a snapshot of :meth:`save_state` (from this backend or one
        of the same model and context size, of any sequence)."""
        lib = self._lib
        self.reset(seq)
        if not tokens:
            return
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if int(lib.llama_state_seq_set_data(self._ctx, buf, len(state), seq)) == 0:
            lib.llama_memory_seq_rm(self._memory, seq, -1, -1)
            raise NSDError("llama.cpp could not restore a saved cache state")
        self._cached[seq], self._seq_tokens[seq] = len(tokens), list(tokens)

    # ----------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Free llama.cpp's batch, context and model (also done on garbage collection)."""
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        if getattr(self, "_batch", None) is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_embd_batch", None) is not None:
            lib.llama_batch_free(self._embd_batch)
            self._embd_batch = None
        if getattr(self, "_ctx", None):
            lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lib.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> LlamaCppBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- internals

    def _ensure_batch(self, n: int) -> None:
        """Have a reusable llama_batch with room for ``n`` tokens.

        The batch is allocated by llama.cpp and filled through numpy views on its
        arrays, so a forward costs no per-token Python work.
        """
        if n <= self._batch_cap:
            return
        lib = self._lib
        cap = max(n, 2 * self._batch_cap)
        if self._batch is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        batch = lib.llama_batch_init(cap, 0, 1)
        self._batch = batch
        self._batch_cap = cap
        self._tok_view = np.ctypeslib.as_array(batch.token, shape=(cap,))
        self._pos_view = np.ctypeslib.as_array(batch.pos, shape=(cap,))
        self._out_view = np.ctypeslib.as_array(batch.logits, shape=(cap,))
        self._batch_seqs = self._init_seq_ids(batch, cap)

    def _ensure_embd_batch(self, n: int) -> None:
        """Like :meth:`_ensure_batch`, for a batch of input embeddings (allocated on first use)."""
        if n <= self._embd_cap:
            return
        lib = self._lib
        cap = max(n, 2 * self._embd_cap, 8)
        if self._embd_batch is not None:
            lib.llama_batch_free(self._embd_batch)
            self._embd_batch = None
        width = self.n_embd
        batch = lib.llama_batch_init(cap, width, 1)
        self._embd_batch = batch
        self._embd_cap = cap
        self._embd_view = np.ctypeslib.as_array(batch.embd, shape=(cap, width))
        self._embd_pos_view = np.ctypeslib.as_array(batch.pos, shape=(cap,))
        self._embd_out_view = np.ctypeslib.as_array(batch.logits, shape=(cap,))
        self._embd_batch_seqs = self._init_seq_ids(batch, cap)

    @staticmethod
    def _init_seq_ids(batch: Any, cap: int) -> np.ndarray:
        """Every slot of a new batch belongs to one sequence, 0; returns the host copy of
        the slots' sequence ids, which :meth:`_decode` keeps in step with the batch."""
        np.ctypeslib.as_array(batch.n_seq_id, shape=(cap,))[:] = 1
        for i in range(cap):
            batch.seq_id[i][0] = _SEQ
        return np.full(cap, _SEQ, dtype=np.int64)
