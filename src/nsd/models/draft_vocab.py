"""Reduced-vocabulary drafts: a cheaper draft model for a large-vocabulary target.

Qwen2.5's 0.5B draft spends about 40% of the bytes it reads per token on its output head
(151,936 rows of 896 in Q8_0, 145 MB). Most of those rows are rare tokens. We rewrite the
draft GGUF once so its vocabulary — and so its output head — holds only the ``keep``
regular tokens most frequent in a fixed corpus (:mod:`nsd.token_rank`), plus every special
token. The target is untouched.

The draft's *input* is not reduced: the reduced model is fed input embeddings, looked up by
full-vocabulary id in the original draft's ``token_embd`` (kept beside it), through
llama.cpp's embedding input (:mod:`nsd.backends.embedding_input`). So every context token
is seen exactly as the full draft would see it; only the drafted tokens are limited to the
kept set. With the head kept in the source's own format (Q8_0 in Qwen's files) the reduced
draft's logits on the kept tokens are the full draft's, row for row.

What this does to ``q``: the draft samples from a distribution supported on the kept
tokens only; nsd expands it back to the full vocabulary with zeros elsewhere and verifies
against the target's full ``p``. The exact rule stays exact — it only needs the ``q`` the
draft really drew from, and a drafted token always has ``q > 0`` — and E (the NSD
deviation) is computed from that same ``q``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nsd.backends.embedding_input import VocabMap  # the map lives beside the backend that reads it
from nsd.backends.files import check_gguf
from nsd.errors import NSDError
from nsd.models.markers import ensure_artefact

_NORMAL = 1  # GGUF token_type of a regular token; every other type is kept
HEAD_TYPES = ("source", "q8_0", "q4_0")
DEFAULT_HEAD = "source"  # the source's head rows as they are (see BENCHMARKS.md)


@dataclass(frozen=True)
class ReducedDraft:
    """A built reduced draft: the rewritten GGUF, the full input table, the id map."""

    model: Path
    inputs: Path
    vocab_map: VocabMap


def _size_error(keep: int, most: int) -> str:
    """The message for a kept size out of range. It names the flag the size comes from:
    the bound is the draft's own, known only once its file is read, so the option's check
    cannot catch it before."""
    return (f"--draft-vocab must be 0 (the full vocabulary), auto or a size in [1, {most}] "
            f"for this draft, got {keep}")


def kept_ids(token_types, keep: int, counts: np.ndarray | None = None) -> np.ndarray:
    """Ascending ids of the ``keep`` regular tokens ranked first by ``counts`` (most
    frequent first, ties by ascending id; ``None``: the first ``keep`` ids) plus every
    non-regular (special/control) token."""
    from nsd.models.token_rank import rank

    types = np.asarray(token_types)
    if not 1 <= keep <= len(types):
        raise NSDError(_size_error(keep, len(types)))
    order = rank(np.zeros(len(types), np.int64) if counts is None else counts)
    regular = order[types[order] == _NORMAL][:keep]
    return np.union1d(regular, np.flatnonzero(types != _NORMAL))


def build_vocab_map(kept: np.ndarray, target_vocab_size: int) -> VocabMap:
    return VocabMap(draft_to_target=torch.from_numpy(np.sort(kept).astype(np.int64)),
                    target_vocab_size=target_vocab_size)


def reduce_gguf(src: Path, dst: Path, kept: np.ndarray, head: str = DEFAULT_HEAD) -> VocabMap:
    """Write ``dst``: ``src`` with its vocabulary (tokenizer lists, ``token_embd`` and the
    output head) cut to the ascending ids ``kept``. ``head``: the output head's format
    (``source`` keeps the source's rows as they are; a model with a tied head gets an
    explicit one, from ``token_embd``'s rows). Returns the id map."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    if head not in HEAD_TYPES:
        raise NSDError(f"unknown draft head format {head!r}; choose one of {', '.join(HEAD_TYPES)}")
    check_gguf(src)  # gguf-py's reader fails with a bare struct.error on a damaged file
    reader = GGUFReader(src)
    fields = reader.fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    kept = np.sort(np.asarray(kept, dtype=np.int64))
    new_id = {int(old): new for new, old in enumerate(kept)}
    kept_strings = {tokens[i] for i in kept}

    tensors = {t.name: t for t in reader.tensors}
    head_source = tensors.get("output.weight", tensors["token_embd.weight"])
    head_rows, head_type = head_source.data[kept], head_source.tensor_type
    if head != "source" and head_type.name.lower() != head:
        from gguf.quants import dequantize, quantize

        head_type = GGMLQuantizationType[head.upper()]
        head_rows = quantize(dequantize(head_rows, head_source.tensor_type).astype(np.float32), head_type)

    arch = fields["general.architecture"].contents()
    writer = GGUFWriter(str(dst), arch)
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
                # llama.cpp refuses a BPE vocabulary without merges, and GGUF an empty
                # array; the draft's own tokenizer is never used (it is fed embeddings), so
                # where no merge survives a tiny vocabulary, the first one stands in.
                value = [m for m in value if _merge_kept(m, kept_strings)] or value[:1]
            elif key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
                if int(value) not in new_id:
                    continue  # a dropped token: the reduced draft has no such token
                value = new_id[int(value)]
            sub_type = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, field.types[0], sub_type)
        for tensor in reader.tensors:
            if tensor.name == "output.weight":
                continue  # written below, with the head rows
            data = tensor.data
            if tensor.name == "token_embd.weight":
                # Never read (the draft is fed embeddings), but llama.cpp wants one row per token.
                data = np.ascontiguousarray(data[kept])
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
            if tensor.name == "token_embd.weight":
                writer.add_tensor("output.weight", np.ascontiguousarray(head_rows), raw_dtype=head_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return build_vocab_map(kept, len(tokens))


def write_input_table(src: Path, dst: Path) -> None:
    """Write ``dst``: a GGUF holding only ``src``'s full ``token_embd`` (as quantized)."""
    from gguf import GGUFReader, GGUFWriter

    check_gguf(src)
    reader = GGUFReader(src)
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    try:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _merge_kept(merge: str, kept: set[str]) -> bool:
    left, _, right = merge.partition(" ")
    return left in kept and right in kept and (left + right) in kept


def reduced_dir(gguf_path: Path, keep: int, head: str, counts: np.ndarray) -> Path:
    """Named by the counts that ranked it too: new counts give a new draft, never a stale one."""
    digest = hashlib.sha256(np.ascontiguousarray(counts, dtype=np.int64).tobytes()).hexdigest()[:10]
    return gguf_path.with_name(f"{gguf_path.stem}.draft{keep}-{head}-{digest}")


def input_table_path(gguf_path: Path) -> Path:
    return gguf_path.with_name(f"{gguf_path.stem}.token-embd.gguf")


def ensure_reduced_draft(gguf_path: Path, keep: int, head: str = DEFAULT_HEAD,
                         counts: np.ndarray | None = None) -> ReducedDraft:
    """The reduced draft of ``gguf_path`` (built once, cached beside it, rebuilt when its
    completion marker shows it damaged). ``counts``: the token frequencies that rank the
    vocabulary (default: :func:`nsd.token_rank.ensure_token_counts`)."""
    from nsd.models.token_rank import ensure_token_counts

    check_gguf(gguf_path)
    if head not in HEAD_TYPES:
        raise NSDError(f"unknown draft head format {head!r}; choose one of {', '.join(HEAD_TYPES)}")
    if counts is None:
        counts = ensure_token_counts(gguf_path)
    if not 1 <= keep < len(counts):
        raise NSDError(_size_error(keep, len(counts) - 1))
    folder = reduced_dir(gguf_path, keep, head, counts)

    def build(tmp: Path) -> None:
        from gguf import GGUFReader

        types = GGUFReader(gguf_path).fields["tokenizer.ggml.token_type"].contents()
        kept = kept_ids(types, keep, counts)
        tmp.mkdir(parents=True)
        reduce_gguf(gguf_path, tmp / "model.gguf", kept, head)
        np.save(tmp / "kept.npy", kept.astype(np.int64))
        about = {"source": gguf_path.name, "keep": keep, "head": head, "kept_total": int(len(kept)),
                 "vocab_size": int(len(counts)),
                 "corpus_mass_kept": float(counts[kept].sum() / max(int(counts.sum()), 1))}
        (tmp / "about.json").write_text(json.dumps(about, indent=1) + "\n", encoding="utf-8")

    ensure_artefact(folder, build, f"the {keep}-token draft of {gguf_path.name}")
    inputs = ensure_artefact(input_table_path(gguf_path), lambda tmp: write_input_table(gguf_path, tmp),
                             f"the input embeddings of {gguf_path.name}")
    kept = np.load(folder / "kept.npy")
    return ReducedDraft(folder / "model.gguf", inputs, build_vocab_map(kept, len(counts)))


def open_reduced_draft(reduced: ReducedDraft, **backend_kwargs):
    """The reduced draft loaded in llama.cpp, fed full-vocabulary ids (its logits are over
    the kept tokens, in ``reduced.vocab_map`` order)."""
    from nsd.backends.embedding_input import EmbeddingInputBackend, EmbeddingTable
    from nsd.backends.llama_cpp import LlamaCppBackend

    return EmbeddingInputBackend(LlamaCppBackend(reduced.model, **backend_kwargs),
                                 EmbeddingTable(reduced.inputs))
