"""Damaged model files: every kind of damage gives one NSDError naming the file and the
problem, found from the header alone, before any loader runs."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from gguf_files import metadata_end, write_tiny_gguf
from nsd.models import registry
from nsd.errors import NSDError
from nsd.backends.files import (check_gguf, check_hf_folder, check_safetensors,
                             check_transformers_support, require_tokenizer)


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "good.gguf")


def _cut(src: Path, n: int, name: str = "cut.gguf") -> Path:
    dst = src.with_name(name)
    dst.write_bytes(src.read_bytes()[:n])
    return dst


def test_valid_gguf_header_is_read(good: Path) -> None:
    info = check_gguf(good)
    assert info.architecture == "llama" and info.has_tokenizer and info.version == 3
    assert [t.name for t in info.tensors] == ["token_embd.weight", "output.weight"]
    assert info.data_end == good.stat().st_size  # the declared data ends exactly at EOF


@pytest.mark.parametrize("where", ["magic", "header", "metadata", "tensor_table", "data_start",
                                   "data_middle", "last_byte"])
def test_gguf_cut_anywhere_is_truncated(good: Path, where: str) -> None:
    size, meta = good.stat().st_size, metadata_end(good)
    cut = {"magic": 2, "header": 12, "metadata": meta // 2, "tensor_table": meta + 12,
           "data_start": size - 8192 + 1, "data_middle": size // 2 + 2000, "last_byte": size - 1}[where]
    path = _cut(good, cut)
    with pytest.raises(NSDError) as err:
        check_gguf(path)
    message = str(err.value)
    assert str(path) in message and "\n" not in message
    # Two bytes of magic cannot even be recognised as a GGUF; every other cut is named.
    assert ("not a GGUF" if where == "magic" else "truncated") in message


def test_truncated_data_says_how_much_is_missing(good: Path) -> None:
    path = _cut(good, good.stat().st_size - 1000)
    with pytest.raises(NSDError, match=r"declares tensor data up to byte \d+ but the file has "
                                       r"\d+ bytes \(1000 missing"):
        check_gguf(path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(NSDError, match=r"empty.gguf is empty \(0 bytes\)"):
        check_gguf(path)


@pytest.mark.parametrize("content", [b"PK\x03\x04" + bytes(5000), os.urandom(5000).replace(b"G", b"x"),
                                     b"<html>Not found</html>"])
def test_not_a_gguf(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(NSDError, match=r"model.gguf is not a GGUF file: it starts with"):
        check_gguf(path)


def _patched(src: Path, offset: int, data: bytes) -> Path:
    raw = bytearray(src.read_bytes())
    raw[offset:offset + len(data)] = data
    dst = src.with_name("patched.gguf")
    dst.write_bytes(bytes(raw))
    return dst


def test_unsupported_version(good: Path) -> None:
    with pytest.raises(NSDError, match="unsupported GGUF version 9"):
        check_gguf(_patched(good, 4, struct.pack("<I", 9)))


def test_absurd_counts_are_corruption(good: Path) -> None:
    with pytest.raises(NSDError, match="corrupt GGUF header: it declares"):
        check_gguf(_patched(good, 8, struct.pack("<Q", 1 << 60)))


def test_unknown_quantization_type(good: Path) -> None:
    raw = good.read_bytes()
    name = b"output.weight"
    type_at = raw.index(name) + len(name) + 4 + 2 * 8  # after n_dims and two dims
    with pytest.raises(NSDError, match=r"unsupported quantization: tensor 'output.weight' has ggml type 250"):
        check_gguf(_patched(good, type_at, struct.pack("<I", 250)))


def test_unknown_value_type(good: Path) -> None:
    raw = good.read_bytes()
    key = b"general.architecture"
    with pytest.raises(NSDError, match="corrupt metadata: unknown value type 77"):
        check_gguf(_patched(good, raw.index(key) + len(key), struct.pack("<I", 77)))


def test_missing_tokenizer_and_architecture_support(tmp_path: Path) -> None:
    bare = write_tiny_gguf(tmp_path / "bare.gguf", tokenizer=False)
    with pytest.raises(NSDError, match=r"bare.gguf has no tokenizer"):
        require_tokenizer(check_gguf(bare))
    pytest.importorskip("transformers")
    odd = check_gguf(write_tiny_gguf(tmp_path / "odd.gguf", arch="nosucharch"))
    with pytest.raises(NSDError, match=r"odd.gguf: unsupported architecture 'nosucharch'"):
        check_transformers_support(odd, weights=False)
    check_transformers_support(check_gguf(tmp_path / "bare.gguf"), weights=True)  # llama, f32


# --- Hugging Face folders --------------------------------------------------------------


def _safetensors(path: Path, n_bytes: int = 64) -> Path:
    header = json.dumps({"w": {"dtype": "F32", "shape": [n_bytes // 4], "data_offsets": [0, n_bytes]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(n_bytes))
    return path


def _hf_folder(root: Path, *, weights: bool = True, tokenizer: bool = True) -> Path:
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "llama"}')
    if tokenizer:
        (root / "tokenizer.json").write_text("{}")
        (root / "tokenizer_config.json").write_text("{}")
    if weights:
        _safetensors(root / "model.safetensors")
    return root


def test_hf_folder_checks(tmp_path: Path) -> None:
    check_hf_folder(_hf_folder(tmp_path / "ok"))
    with pytest.raises(NSDError, match=r"no-weights has no model weights"):
        check_hf_folder(_hf_folder(tmp_path / "no-weights", weights=False))
    check_hf_folder(tmp_path / "no-weights", weights=False)  # enough for a tokenizer
    with pytest.raises(NSDError, match=r"no-tok has no tokenizer"):
        check_hf_folder(_hf_folder(tmp_path / "no-tok", tokenizer=False))


def test_hf_folder_damaged_files(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path / "m")
    raw = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(raw[:-10])
    with pytest.raises(NSDError, match=r"model.safetensors is truncated: its header declares"):
        check_hf_folder(folder)
    (folder / "model.safetensors").write_bytes(raw[:5])
    with pytest.raises(NSDError, match=r"model.safetensors is truncated or not a safetensors"):
        check_safetensors(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(NSDError, match=r"missing weights: model-00001-of-00002.safetensors"):
        check_hf_folder(folder)
    (folder / "config.json").write_text('{"model_type": "lla')
    with pytest.raises(NSDError, match=r"config.json is corrupt: not valid JSON"):
        check_hf_folder(folder)


def test_resolve_model_checks_what_it_is_given(tmp_path: Path) -> None:
    with pytest.raises(NSDError, match="truncated"):
        registry.resolve_model(str(_cut(write_tiny_gguf(tmp_path / "a.gguf"), 100)))
    with pytest.raises(NSDError, match="no tokenizer"):
        registry.resolve_model(str(write_tiny_gguf(tmp_path / "b.gguf", tokenizer=False)))
    with pytest.raises(NSDError, match="no model weights"):
        registry.resolve_model(str(_hf_folder(tmp_path / "hf", weights=False)))


def test_llama_backend_refuses_a_damaged_file_before_loading(good: Path) -> None:
    from nsd.backends.llama_cpp import LlamaCppBackend

    with pytest.raises(NSDError, match="truncated"):  # no llama_cpp import needed to say so
        LlamaCppBackend(_cut(good, 300))
