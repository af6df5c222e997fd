"""Hugging Face transformers backend: a causal-LM folder, or a model object already loaded.

The model runs on ``cpu`` or ``cuda`` (``auto`` picks CUDA when torch sees one) in the
dtype asked for (``auto``: bfloat16 on CUDA, float32 on CPU). Its KV cache is the static,
position-indexed :class:`~nsd.backends.kv_cache.StaticKVCache`, so ``rewind`` is O(1).
The short forwards (one token, a verification block of ``k + 1``) can be graphed, one
graph per length, with ``compile``: ``"torch"`` (or ``True``) runs them through
``torch.compile`` (CUDA graphs on CUDA), ``"cudagraph"`` captures the eager kernels in a
plain CUDA graph (no compile time; CUDA only). The prompt prefill always runs eagerly.
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from nsd.backends.kv_cache import (GatheredKVCache, StaticKVCache, batch_causal_mask, causal_mask,
                                  static_cache_supported)
from nsd.errors import NSDError
from nsd.backends.files import check_hf_folder

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("auto", "cpu", "cuda")
# Forwards of up to this many tokens may be graphed: k + 1 for k up to 16.
GRAPH_MAX_TOKENS = 17
GRAPH_MODES = ("none", "torch", "cudagraph")


def graph_mode(compile: bool | str) -> str:
    """Normalise the ``compile`` argument: False → none, True → torch."""
    mode = {False: "none", True: "torch"}.get(compile, compile) if isinstance(compile, bool) else compile
    if mode not in GRAPH_MODES:
        raise NSDError(f"unknown compile mode {compile!r}; choose one of {', '.join(GRAPH_MODES)}")
    return mode


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto`` → CUDA when available, else CPU; ``cuda`` without a GPU is a user error."""
    text = str(device)
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or text.startswith("cuda:"):
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA support"
            raise NSDError(f"device {text} asked for, but torch {torch.__version__} ({build}) "
                           "sees no CUDA GPU; use --device cpu or auto")
        return torch.device(text)
    raise NSDError(f"unknown device {text!r}; choose one of {', '.join(DEVICES)} (or cuda:N)")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``auto``/None → bfloat16 on CUDA (what GPUs run fast), float32 on CPU (exact, and
    the fastest torch path on CPUs without bf16 matrix units)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise NSDError(f"unknown dtype {dtype!r}; choose auto or one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


class HFBackend:
    """A transformers causal LM with a static KV cache (dynamic for sliding-window models)."""

    def __init__(self, model_dir: str | Path, dtype: str | torch.dtype | None = "auto",
                 n_threads: int | None = None, device: str | torch.device = "auto",
                 max_len: int = 4096, compile: bool | str = False) -> None:
        from transformers import AutoModelForCausalLM

        target_device = resolve_device(device)
        target_dtype = resolve_dtype(dtype, target_device)
        if n_threads:
            torch.set_num_threads(n_threads)
        # Missing or truncated weight files, named, before transformers trips over them.
        check_hf_folder(Path(model_dir), tokenizer=False)
        try:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=target_dtype)
        except Exception as exc:  # what the checks cannot see: transformers names it
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise NSDError(f"could not load a causal LM from {model_dir}: {reason}") from exc
        self._setup(model.to(target_device).eval(), max_len, compile)

    @classmethod
    def from_model(cls, model: Any, max_len: int = 4096, compile: bool | str = False) -> "HFBackend":
        """Wrap an already-loaded transformers causal LM, on whatever device and in whatever
        dtype it already is (like transformers' ``assistant_model``). The model is not
        modified; it must be in eval mode."""
        if getattr(model, "training", False):
            raise NSDError("the model is in training mode (dropout active): call model.eval() first")
        backend = cls.__new__(cls)
        backend._setup(model, max_len, compile)
        return backend

    def _setup(self, model: Any, max_len: int, compile: bool | str) -> None:
        if max_len < 1:
            raise NSDError(f"max_len must be >= 1, got {max_len}")
        self.model = model
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        config = model.config
        self._vocab_size = int(model.get_output_embeddings().weight.shape[0])
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_token_ids: tuple[int, ...] = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        # transformers renamed `past_key_values` to `cache` (the old name warns from 5.2x),
        # and `num_logits_to_keep` to `logits_to_keep` (4.50).
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._keep_kwarg = next((p for p in ("logits_to_keep", "num_logits_to_keep") if p in params), None)
        self._pass_cache_position = "cache_position" in params  # transformers 4.x reads it
        self.max_positions = min(int(getattr(config, "max_position_embeddings", 1 << 30)), max_len)
        self.cache: StaticKVCache | None = None
        self._dynamic = None  # transformers' DynamicCache, for models the static cache cannot serve
        self._dynamic_len = 0
        self._tokens: list[int] = []  # the ids whose KV the cache holds
        if static_cache_supported(config):
            self.cache = StaticKVCache.for_config(config, self.max_positions, self.dtype, self.device)
        # Sequences 1.. of set_sequences (sequence 0 is `cache` and `_tokens`).
        self._more_caches: list[StaticKVCache] = []
        self._more_tokens: list[list[int]] = []
        self._graphed: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.graph_mode = graph_mode(compile) if self.cache is not None else "none"
        if self.graph_mode == "torch":
            mode = "reduce-overhead" if self.device.type == "cuda" else None  # CUDA graphs
            self._graphed = torch.compile(self._static_step, mode=mode, dynamic=False)
        elif self.graph_mode == "cudagraph":
            if self.device.type != "cuda":
                raise NSDError("compile='cudagraph' needs the model on a CUDA device")
            self._cuda_graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
            self._graph_pool = torch.cuda.graph_pool_handle()
            self._graphed = self._cudagraph_step

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def num_cached(self) -> int:
        return self.cache.position if self.cache is not None else self._dynamic_len

    @property
    def cached_tokens(self) -> list[int]:
        """The token ids whose KV the cache holds, in order (a copy)."""
        return list(self._tokens)

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], all_logits: bool = True) -> torch.Tensor:
        """Logits ``[len(tokens) or 1, V]`` float32, on the model's device."""
        n = len(tokens)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if self.num_cached + n > self.max_positions:
            raise NSDError(f"sequence of {self.num_cached + n} tokens exceeds the context of "
                           f"{self.max_positions} (raise --n-ctx, up to the model's maximum)")
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, n]
        self._tokens.extend(int(t) for t in tokens)
        if self.cache is None:
            return self._dynamic_forward(ids, all_logits)
        if self._graphed is not None and n <= GRAPH_MAX_TOKENS:
            self.cache.position_tensor.fill_(self.cache.position)
            # One graph per length n; lift dynamo's default limit of 8 recompilations.
            with torch._dynamo.config.patch(recompile_limit=2 * GRAPH_MAX_TOKENS):
                logits = self._graphed(ids)  # [n, V]
            # CUDA graphs reuse their output buffer on the next replay: copy out.
            logits = logits.to(torch.float32, copy=True)
            if not all_logits:
                logits = logits[-1:]
        else:
            logits = self._eager_step(ids, all_logits).float()
        self.cache.advance(n)
        return logits

    def _model_kwargs(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                      all_logits: bool) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"input_ids": ids, "position_ids": positions.unsqueeze(0),
                                  "attention_mask": mask, self._cache_kwarg: self.cache,
                                  "use_cache": True}
        if self._pass_cache_position:
            kwargs["cache_position"] = positions
        if self._keep_kwarg is not None:
            kwargs[self._keep_kwarg] = 0 if all_logits else 1
        return kwargs

    def _eager_step(self, ids: torch.Tensor, all_logits: bool) -> torch.Tensor:
        cache = self.cache
        n, start = ids.shape[1], cache.position
        cache.static_shapes = False
        positions = torch.arange(start, start + n, device=self.device)  # [n]
        mask = causal_mask(start, n, start + n, self.dtype, self.device)  # [1, 1, n, start + n]
        out = self.model(**self._model_kwargs(ids, positions, mask, all_logits))
        logits = out.logits[0]  # [n or 1, V]
        return logits if all_logits else logits[-1:]

    def _static_step(self, ids: torch.Tensor) -> torch.Tensor:
        """Fixed-shape forward: positions come from the cache's device tensor, attention
        spans the whole buffer. This is the function ``torch.compile`` graphs."""
        cache = self.cache
        n = ids.shape[1]
        cache.static_shapes = True
        positions = cache.position_tensor + torch.arange(n, device=self.device)  # [n]
        mask = causal_mask(cache.position_tensor, n, cache.max_len, self.dtype, self.device)
        try:
            out = self.model(**self._model_kwargs(ids, positions, mask, all_logits=True))
        finally:
            cache.static_shapes = False
        return out.logits[0]  # [n, V]

    def _cudagraph_step(self, ids: torch.Tensor) -> torch.Tensor:
        """Replay the CUDA graph of :meth:`_static_step` for this length; capture it on the
        first call. Warm-up and capture write the same keys/values, at the same slots, as
        the real call does, so they leave the cache as the call would."""
        n = ids.shape[1]
        if n not in self._cuda_graphs:
            static_ids = ids.clone()  # [1, n] the graph reads its input from here
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up off the capture stream (CUDA graph rules)
                for _ in range(2):
                    self._static_step(static_ids)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                static_logits = self._static_step(static_ids)  # [n, V]
            self._cuda_graphs[n] = (graph, static_ids, static_logits)
        graph, static_ids, static_logits = self._cuda_graphs[n]
        static_ids.copy_(ids)
        graph.replay()
        return static_logits

    def _dynamic_forward(self, ids: torch.Tensor, all_logits: bool) -> torch.Tensor:
        from transformers import DynamicCache

        if self._dynamic is None:
            self._dynamic = DynamicCache(config=self.model.config)
        kwargs: dict[str, Any] = {"input_ids": ids, self._cache_kwarg: self._dynamic, "use_cache": True}
        if self._keep_kwarg is not None:
            kwargs[self._keep_kwarg] = 0 if all_logits else 1
        logits = self.model(**kwargs).logits[0]
        self._dynamic_len += ids.shape[1]
        return (logits if all_logits else logits[-1:]).float()

    def rewind(self, num_tokens: int, seq: int = 0) -> None:
        if seq:
            with self._bound(seq):
                return self.rewind(num_tokens)
        if not 0 <= num_tokens <= self.num_cached:
            raise ValueError(f"cannot rewind to {num_tokens}: cache holds {self.num_cached}")
        del self._tokens[num_tokens:]
        if self.cache is not None:
            self.cache.rewind(num_tokens)
            return
        if num_tokens == 0:
            self.reset()
        elif self._dynamic is not None and num_tokens < self._dynamic_len:
            # A negative crop removes that many tokens in every transformers version that
            # has DynamicCache.crop; positive "keep n" was dropped in 5.x.
            self._dynamic.crop(num_tokens - self._dynamic_len)
        self._dynamic_len = num_tokens

    def reset(self, seq: int | None = None) -> None:
        """Empty the cache: of sequence ``seq`` only when given, else of every sequence
        (as :meth:`nsd.backends.llama_cpp.LlamaCppBackend.reset` does)."""
        if seq:
            with self._bound(seq):
                # seq 0 inside the binding: that one cache. None would empty them all, the
                # other requests' running sequences included.
                return self.reset(0)
        if seq is None:
            for cache in self._more_caches:
                cache.reset()
            self._more_tokens = [[] for _ in self._more_caches]
        if self.cache is not None:
            self.cache.reset()
        self._dynamic = None
        self._dynamic_len = 0
        self._tokens = []

    def save_state(self, seq: int = 0) -> tuple[list[int], torch.Tensor]:
        """A snapshot of the static cache: the token ids it holds and a copy of their keys
        and values ``[L, 2, 1, H, n, D]`` (on the model's device), for :meth:`load_state`."""
        if seq:
            with self._bound(seq):
                return self.save_state()
        if self.cache is None:
            raise NSDError("this model's cache (sliding window) cannot be saved")
        n = self.cache.position
        return list(self._tokens), self.cache.storage[..., :n, :].clone()

    def load_state(self, tokens: Sequence[int], state: torch.Tensor, seq: int = 0) -> None:
        """Replace the cache with a snapshot of :meth:`save_state`."""
        if seq:
            with self._bound(seq):
                return self.load_state(tokens, state)
        if self.cache is None:
            raise NSDError("this model's cache (sliding window) cannot be restored")
        n = len(tokens)
        self.cache.storage[..., :n, :].copy_(state)
        self.cache.position = n
        self._tokens = list(tokens)

    # ----------------------------------------------------------- several sequences
    # Sequence 0 is the cache every single-sequence call uses; sequences 1.. (after
    # set_sequences) have caches of their own. forward_many runs several sequences' new
    # tokens as one padded batch, eagerly (graphs are per cache address and length).

    def set_sequences(self, n_seq: int) -> None:
        """Hold ``n_seq`` sequences of :attr:`max_positions` tokens each (every cache
        emptied); their forwards then run eagerly."""
        if self.cache is None:
            raise NSDError("this model's cache (sliding window) cannot hold several sequences")
        if n_seq < 1:
            raise NSDError(f"the number of sequences must be >= 1, got {n_seq}")
        self.reset()
        config = self.model.config
        self._more_caches = [StaticKVCache.for_config(config, self.max_positions, self.dtype, self.device)
                             for _ in range(n_seq - 1)]
        self._more_tokens = [[] for _ in range(n_seq - 1)]
        if n_seq > 1:
            self._graphed = None

    @property
    def n_sequences(self) -> int:
        return 1 + len(self._more_caches)

    def _cache_of(self, seq: int) -> StaticKVCache:
        return self.cache if seq == 0 else self._more_caches[seq - 1]

    def _tokens_of(self, seq: int) -> list[int]:
        return self._tokens if seq == 0 else self._more_tokens[seq - 1]

    @contextlib.contextmanager
    def _bound(self, seq: int) -> Iterator[None]:
        """Run a single-sequence method on sequence ``seq``."""
        if seq == 0:
            yield
            return
        if not 0 < seq < self.n_sequences:
            raise ValueError(f"sequence {seq} outside [0, {self.n_sequences})")
        cache0, tokens0 = self.cache, self._tokens
        self.cache, self._tokens = self._more_caches[seq - 1], self._more_tokens[seq - 1]
        try:
            yield
        finally:
            self._more_tokens[seq - 1] = self._tokens
            self.cache, self._tokens = cache0, tokens0

    def seq_num_cached(self, seq: int) -> int:
        return self._cache_of(seq).position

    def seq_cached_tokens(self, seq: int) -> list[int]:
        return list(self._tokens_of(seq))

    @torch.inference_mode()
    def forward_many(self, items: Sequence[tuple[int, Sequence[int], bool]]) -> list[torch.Tensor]:
        """Several sequences' new tokens in one forward: ``(seq, tokens, all_logits)`` per
        sequence; each one's logits as :meth:`forward` gives them (up to rounding: a
        batch's matrix products may accumulate in another order)."""
        if len(items) == 1:
            seq, tokens, all_logits = items[0]
            with self._bound(seq):
                return [self.forward(tokens, all_logits)]
        seqs = [int(seq) for seq, _, _ in items]
        if len(set(seqs)) != len(seqs) or not all(0 <= s < self.n_sequences for s in seqs):
            raise ValueError(f"sequences {seqs}: each must appear once, in [0, {self.n_sequences})")
        caches = [self._cache_of(s) for s in seqs]
        lengths = [len(tokens) for _, tokens, _ in items]
        for cache, n in zip(caches, lengths):
            if n == 0:
                raise ValueError("forward needs at least one token per sequence")
            if cache.position + n > self.max_positions:
                raise NSDError(f"sequence of {cache.position + n} tokens exceeds the context of "
                               f"{self.max_positions} (raise --n-ctx, up to the model's maximum)")
        width = max(lengths)
        ids = torch.zeros(len(items), width, dtype=torch.long)  # [B, n]; padding never stored
        for b, (_, tokens, _) in enumerate(items):
            ids[b, :lengths[b]] = torch.tensor(list(tokens), dtype=torch.long)
        gathered = GatheredKVCache(caches, lengths, width)
        positions = torch.tensor(gathered.starts, device=self.device)[:, None] + \
            torch.arange(width, device=self.device)  # [B, n]
        mask = batch_causal_mask(gathered.starts, width, gathered.kv_len, self.dtype, self.device)
        kwargs: dict[str, Any] = {"input_ids": ids.to(self.device), "position_ids": positions,
                                  "attention_mask": mask, self._cache_kwarg: gathered,
                                  "use_cache": True}
        if self._keep_kwarg is not None:
            kwargs[self._keep_kwarg] = 0
        for cache in caches:
            cache.static_shapes = False
        logits = self.model(**kwargs).logits.float()  # [B, n, V]
        out = []
        for b, (seq, tokens, all_logits) in enumerate(items):
            n = lengths[b]
            out.append(logits[b, :n] if all_logits else logits[b, n - 1:n])
            caches[b].advance(n)
            self._tokens_of(seq).extend(int(t) for t in tokens)
        return out
