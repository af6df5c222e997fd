"""Reduced-vocabulary drafts: a cheaper draft model for a large-vocabulary target.

Qwen2.5's 0.5B draft spends about 40% of the bytes it reads per token on its output head
(151,936 rows of 896 in Q8_0, 145 MB of a 469 MB file). Most of those rows are rare
tokens. We rewrite the draft GGUF once so its vocabulary is only the first ``keep`` regular
tokens plus every special token: Qwen's byte-level BPE numbers tokens in merge order, so
low ids are the frequent ones. The target is untouched.

What this does to ``q``: the draft now samples from a distribution supported on the kept
tokens only; nsd expands it back to the full vocabulary with zeros elsewhere and verifies
against the target's full ``p``. The exact rule stays exact — it only needs the ``q`` the
draft really drew from — and E (the NSD deviation) is still computed from that ``q``.
Context tokens outside the kept set are shown to the draft as one placeholder token,
which may lower its acceptance on text with many rare tokens; never the correctness.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nsd.errors import NSDError
from nsd.backends.files import check_gguf
from nsd.models.markers import ensure_artefact

# Rows whose vocabulary dimension is sliced; every other tensor is copied as is.
_VOCAB_TENSORS = ("token_embd.weight", "output.weight")
_PLACEHOLDER = " "  # what the draft sees in place of a dropped context token


@dataclass(frozen=True)
class VocabMap:
    """Maps between target token ids and the reduced draft's ids."""

    draft_to_target: torch.Tensor  # [Vd] int64
    target_to_draft: torch.Tensor  # [V] int64 (placeholder id for dropped tokens)
    target_vocab_size: int

    def to_draft(self, tokens: list[int]) -> list[int]:
        return self.target_to_draft[tokens].tolist()

    def expand(self, probs: torch.Tensor) -> torch.Tensor:
        """Draft probabilities ``[Vd]`` → ``[V]`` with zeros on dropped tokens."""
        full = torch.zeros(self.target_vocab_size, dtype=probs.dtype)
        full[self.draft_to_target] = probs
        return full


def kept_ids(tokens: list[str], token_types: list[int], keep: int) -> np.ndarray:
    """The first ``keep`` regular tokens plus every non-normal (special/control) token."""
    types = np.asarray(token_types)
    ids = np.arange(len(tokens))
    special = ids[types != 1]  # 1 = NORMAL in GGUF's token_type
    regular = ids[types == 1][:keep]
    return np.union1d(regular, special)


def build_vocab_map(kept: np.ndarray, target_vocab_size: int, placeholder: int) -> VocabMap:
    d2t = torch.from_numpy(kept.astype(np.int64))
    t2d = torch.full((target_vocab_size,), int(np.searchsorted(kept, placeholder)), dtype=torch.long)
    t2d[d2t] = torch.arange(len(kept))
    return VocabMap(draft_to_target=d2t, target_to_draft=t2d, target_vocab_size=target_vocab_size)


def reduce_gguf(src: Path, dst: Path, keep: int) -> VocabMap:
    """Write ``dst``: ``src`` with its vocabulary cut to ``kept_ids(..., keep)``.

    Written under a temporary name and renamed into place. Returns the id map.
    """
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    check_gguf(src)  # gguf-py's reader fails with a bare struct.error on a damaged file
    reader = GGUFReader(src)
    fields = reader.fields
    tokens, kept, placeholder, vmap = _plan(fields, keep)
    new_id = {int(old): new for new, old in enumerate(kept)}
    kept_strings = {tokens[i] for i in kept}

    arch = fields["general.architecture"].contents()
    tmp = dst.with_name(f"{dst.name}.partial-{os.getpid()}")
    writer = GGUFWriter(str(tmp), arch)
    try:
        for key, field in fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            value = field.contents()
            if key == "tokenizer.ggml.tokens":
                value = [tokens[i] for i in kept]
            elif key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
                value = [value[i] for i in kept]
            elif key == "tokenizer.ggml.merges":
                value = [m for m in value if _merge_kept(m, kept_strings)]
            elif key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
                value = new_id.get(int(value), new_id[placeholder])
            sub_type = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, field.types[0], sub_type)
        for tensor in reader.tensors:
            data = tensor.data
            if tensor.name in _VOCAB_TENSORS:
                data = np.ascontiguousarray(data[kept])
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, dst)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return vmap


def _merge_kept(merge: str, kept: set[str]) -> bool:
    left, _, right = merge.partition(" ")
    return left in kept and right in kept and (left + right) in kept


def _plan(fields, keep: int) -> tuple[list[str], np.ndarray, int, VocabMap]:
    """Which ids a ``keep``-token draft vocabulary holds, and the placeholder id."""
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    if keep < 1 or keep >= len(tokens):
        raise NSDError(f"draft vocabulary size must be in [1, {len(tokens) - 1}], got {keep}")
    kept = kept_ids(tokens, types, keep)
    placeholder = tokens.index(_PLACEHOLDER) if _PLACEHOLDER in tokens else int(kept[0])
    if placeholder not in set(kept.tolist()):
        placeholder = int(kept[0])
    return tokens, kept, placeholder, build_vocab_map(kept, len(tokens), placeholder)


def ensure_reduced_draft(gguf_path: Path, keep: int) -> tuple[Path, VocabMap]:
    """The reduced GGUF next to ``gguf_path`` (built once, rebuilt when its completion
    marker shows it damaged) and its id map."""
    from gguf import GGUFReader

    check_gguf(gguf_path)
    vmap = _plan(GGUFReader(gguf_path).fields, keep)[3]  # also validates ``keep`` up front
    dst = gguf_path.with_name(f"{gguf_path.stem}.vocab{keep}.gguf")
    ensure_artefact(dst, lambda tmp: reduce_gguf(gguf_path, tmp, keep),
                    f"the {keep}-token draft of {gguf_path.name}", adopt=check_gguf)
    return dst, vmap
