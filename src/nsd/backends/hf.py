"""Hugging Face transformers backend: any causal-LM folder (or a converted GGUF)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Sequence

import torch

from nsd.errors import NSDError
from nsd.model_files import check_hf_folder

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFBackend:
    """A transformers causal LM with a ``DynamicCache`` that is cropped on rewind."""

    def __init__(self, model_dir: str | Path, dtype: str | torch.dtype = "float32",
                 n_threads: int | None = None) -> None:
        from transformers import AutoModelForCausalLM

        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise NSDError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
            dtype = _DTYPES[dtype]
        if n_threads:
            torch.set_num_threads(n_threads)
        # Missing or truncated weight files, named, before transformers trips over them.
        check_hf_folder(Path(model_dir), tokenizer=False)
        try:
            self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        except Exception as exc:  # what the checks cannot see: transformers names it
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise NSDError(f"could not load a causal LM from {model_dir}: {reason}") from exc
        self.model.eval()
        self._vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self._cache = None
        self._num_cached = 0
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        # transformers renamed `past_key_values` to `cache` (the old name warns from 5.2x).
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def num_cached(self) -> int:
        return self._num_cached

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], all_logits: bool = True) -> torch.Tensor:
        from transformers import DynamicCache

        if len(tokens) == 0:
            raise ValueError("forward needs at least one token")
        if self._num_cached + len(tokens) > self.max_positions:
            raise NSDError(f"sequence of {self._num_cached + len(tokens)} tokens exceeds the model's "
                           f"context of {self.max_positions}")
        if self._cache is None:
            self._cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        out = self.model(input_ids=ids, **{self._cache_kwarg: self._cache}, use_cache=True,
                         logits_to_keep=0 if all_logits else 1)
        self._num_cached += len(tokens)
        return out.logits[0].float()  # [n or 1, V]

    def rewind(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._num_cached:
            raise ValueError(f"cannot rewind to {num_tokens}: cache holds {self._num_cached}")
        if num_tokens == 0:
            self.reset()
            return
        if self._cache is not None and num_tokens < self._num_cached:
            # A negative crop removes that many tokens in every transformers version that
            # has DynamicCache.crop; positive "keep n" was dropped in 5.x.
            self._cache.crop(num_tokens - self._num_cached)
        self._num_cached = num_tokens

    def reset(self) -> None:
        self._cache = None
        self._num_cached = 0
