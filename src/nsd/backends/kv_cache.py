"""A static, position-indexed KV cache that plugs into transformers models.

All keys and values live in one preallocated tensor ``[layers, 2, 1, kv_heads, max_len,
head_dim]``. Writing ``n`` new tokens fills slots ``position .. position + n - 1``;
rewinding only moves ``position`` back — the stale slots are overwritten by the next write
and never attended to in between, because the caller's attention mask stops at the
position. No tensor is copied or freed on rewind, and the storage keeps one address for
its whole life, which is what CUDA graphs need.

Two ways to read it back, chosen by the caller per forward:

* eager (``static_shapes = False``): ``update`` returns views of the filled prefix
  ``[1, H, position + n, D]``, so attention costs what the context costs;
* graphed (``static_shapes = True``): ``update`` writes at the slots given by the device
  tensor ``position_tensor`` and returns the whole ``[1, H, max_len, D]`` buffer, so every
  call of a given ``n`` has the same shapes; the mask must then cover ``max_len``.
"""

from __future__ import annotations

from typing import Any

import torch

try:  # subclassing Cache lets models that type-check their cache argument accept ours
    from transformers.cache_utils import Cache as _HFCache
except ImportError:  # pragma: no cover - transformers is a dependency of this backend
    _HFCache = object


def static_cache_supported(config: Any) -> bool:
    """True for decoder configs whose every layer is full causal attention.

    Sliding-window and hybrid (linear attention) layers need a different mask and
    eviction rule; those models keep transformers' dynamic cache.
    """
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return False
    if getattr(config, "use_sliding_window", False):
        return False
    # Configs that declare a window without the Qwen2-style switch apply it unconditionally.
    if getattr(config, "sliding_window", None) and not hasattr(config, "use_sliding_window"):
        return False
    return True


class StaticKVCache(_HFCache):
    """Preallocated keys/values for batch size 1; the position is the only state."""

    is_compileable = True

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        try:
            super().__init__(layers=[])  # transformers >= 4.56: the base keeps a layer list
        except TypeError:
            super().__init__()
        self.num_layers = num_layers
        self.max_len = max_len
        self.storage = torch.zeros(num_layers, 2, 1, num_kv_heads, max_len, head_dim,
                                   dtype=dtype, device=device)  # [L, 2, 1, H, max_len, D]
        self.position = 0  # tokens held; slots at and after it are free
        # Device copy of `position` for graphed calls, updated in place so its address is fixed.
        self.position_tensor = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.static_shapes = False
        if hasattr(torch, "_dynamo"):
            # Without fixed addresses, CUDA graphs would copy the cache in and out each call.
            torch._dynamo.mark_static_address(self.storage)
            torch._dynamo.mark_static_address(self.position_tensor)

    @classmethod
    def for_config(cls, config: Any, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> "StaticKVCache":
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return cls(int(config.num_hidden_layers), kv_heads, head_dim, max_len, dtype, device)

    def __len__(self) -> int:
        return self.num_layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new keys/values ``[1, H, n, D]``; return what attention reads."""
        n = key_states.shape[-2]
        keys = self.storage[layer_idx, 0]  # [1, H, max_len, D]
        values = self.storage[layer_idx, 1]
        if self.static_shapes:
            slots = self.position_tensor + torch.arange(n, device=self.storage.device)  # [n]
            keys.index_copy_(2, slots, key_states.to(keys.dtype))
            values.index_copy_(2, slots, value_states.to(values.dtype))
            return keys, values
        end = self.position + n
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions, room for {self.max_len}")
        keys[:, :, self.position:end] = key_states
        values[:, :, self.position:end] = value_states
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, n: int) -> None:
        """Count ``n`` tokens written by the forward that just ran (all layers at once)."""
        self.position += n

    def rewind(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` positions: O(1), the storage is not touched."""
        if not 0 <= num_tokens <= self.position:
            raise ValueError(f"cannot rewind to {num_tokens}: cache holds {self.position}")
        self.position = num_tokens

    def reset(self) -> None:
        self.position = 0

    # What transformers' model code may ask of a cache.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.position

    def get_max_length(self) -> int:
        return self.max_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_len


def causal_mask(start: int | torch.Tensor, num_new: int, kv_len: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """Additive mask ``[1, 1, num_new, kv_len]``: query ``i`` (at position ``start + i``)
    sees keys ``0 .. start + i`` and nothing after, so stale slots past the position are
    never read. ``start`` may be a device tensor ``[1]`` (graphed calls)."""
    query_pos = start + torch.arange(num_new, device=device)  # [n]
    key_pos = torch.arange(kv_len, device=device)  # [kv_len]
    visible = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # [n, kv_len]
    # The dtype's lowest finite value rather than -inf: additive, and never NaN after softmax.
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    mask = mask.masked_fill(~visible, torch.finfo(dtype).min)
    return mask[None, None]


class GatheredKVCache(_HFCache):
    """One forward's cache over several sequences' :class:`StaticKVCache`, for a batch
    whose row ``b`` holds ``lengths[b]`` new tokens of sequence ``caches[b]`` padded to a
    common width ``n``.

    ``update`` stores each row's real new keys/values in its own cache (padding is never
    stored) and returns ``[B, H, kv_len, D]``: row ``b`` holds its cached prefix, then its
    ``n`` new entries from ``starts[b]`` on; the caller's mask (:func:`batch_causal_mask`)
    hides everything a row's query must not see, so the rest is never read.
    """

    def __init__(self, caches: list[StaticKVCache], lengths: list[int], width: int) -> None:
        try:
            super().__init__(layers=[])
        except TypeError:
            super().__init__()
        self.caches, self.lengths, self.width = caches, lengths, width
        self.starts = [c.position for c in caches]
        self.kv_len = max(s + width for s in self.starts)
        self.num_layers = caches[0].num_layers

    def __len__(self) -> int:
        return self.num_layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        batch, heads, _, dim = key_states.shape
        out = key_states.new_zeros(2, batch, heads, self.kv_len, dim)
        for b, (cache, start, n) in enumerate(zip(self.caches, self.starts, self.lengths)):
            if start + n > cache.max_len:
                raise ValueError(f"KV cache overflow: {start + n} positions, room for {cache.max_len}")
            for i, new in enumerate((key_states, value_states)):
                stored = cache.storage[layer_idx, i, 0]  # [H, max_len, D]
                stored[:, start:start + n] = new[b, :, :n]
                out[i, b, :, :start] = stored[:, :start]
                out[i, b, :, start:start + self.width] = new[b]
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return min(self.starts)

    def get_max_length(self) -> int:
        return self.kv_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.kv_len


def batch_causal_mask(starts: list[int], width: int, kv_len: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """Additive mask ``[B, 1, width, kv_len]``: row ``b``'s query ``i`` (at position
    ``starts[b] + i``) sees keys ``0 .. starts[b] + i``, as :func:`causal_mask` for one."""
    query_pos = torch.tensor(starts, device=device)[:, None] + torch.arange(width, device=device)  # [B, n]
    key_pos = torch.arange(kv_len, device=device)  # [kv_len]
    visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, n, kv_len]
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    mask = mask.masked_fill(~visible, torch.finfo(dtype).min)
    return mask[:, None]
