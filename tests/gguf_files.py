"""Tiny GGUF files written with gguf-py's GGUFWriter, for tests of damaged-file handling."""

from __future__ import annotations

from pathlib import Path

import numpy as np

VOCAB = [f"t{i}" for i in range(14)] + ["<s>", "</s>"]


def write_tiny_gguf(path: Path, *, arch: str = "llama", tokenizer: bool = True,
                    tensor_bytes: int = 4096) -> Path:
    """A structurally valid GGUF: metadata, a 16-token vocabulary and two f32 tensors
    (embedding and output rows per token), ``tensor_bytes`` of data each."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(64)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(VOCAB)
        writer.add_token_types([1] * 14 + [3, 3])
        writer.add_bos_token_id(14)
        writer.add_eos_token_id(15)
    width = max(1, tensor_bytes // (4 * len(VOCAB)))
    rng = np.random.default_rng(0)
    for name in ("token_embd.weight", "output.weight"):
        writer.add_tensor(name, rng.standard_normal((len(VOCAB), width)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def metadata_end(path: Path) -> int:
    """Offset of the first tensor-table entry (the end of the metadata key/values)."""
    return path.read_bytes().index(b"token_embd.weight") - 8  # minus the name's length field
