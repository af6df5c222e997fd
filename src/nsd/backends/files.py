"""Cheap structural checks of model files, run before any loader touches them.

Loaders report a damaged file badly: gguf-py dies in ``struct.unpack`` on a truncated
header, transformers in the middle of a conversion, llama.cpp with a log line. These
checks read only a GGUF's header and metadata (never its tensor data) and turn every
problem into an :class:`NSDError` that names the file and says what is wrong:

* not a GGUF (wrong magic, empty file), an unsupported GGUF version;
* truncated: the file ends inside the header or metadata, or before the end of the
  tensor data the header declares (the tensor table gives every tensor's offset, type
  and shape, so the byte where the data must end is known without reading it);
* an unknown value or quantization type, no architecture, no tokenizer;
* for a Hugging Face folder: no weights, a missing weight shard, a truncated
  safetensors file, no tokenizer, an unreadable JSON file.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from nsd.errors import NSDError

GGUF_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)  # version 1 used 32-bit counts and is long gone
_DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format of a scalar of that type (8 = string, 9 = array).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_RECOVER = "download it again (registry models: `nsd models fetch NAME`)"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the tensor data region
    n_bytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n


@dataclass(frozen=True)
class GGUFInfo:
    """What the header of a structurally sound GGUF declares."""

    path: Path
    version: int
    metadata: dict[str, object]  # scalar and string values; arrays appear in array_lengths
    array_lengths: dict[str, int]
    tensors: tuple[TensorInfo, ...]
    data_end: int  # the byte where the declared tensor data ends

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    @property
    def has_tokenizer(self) -> bool:
        return self.array_lengths.get("tokenizer.ggml.tokens", 0) > 0


class _Truncated(Exception):
    """The parser ran past the end of the file."""


class _Cursor:
    """Reads little-endian GGUF values from a buffer, refusing to run past its end."""

    def __init__(self, buf: mmap.mmap | bytes) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise _Truncated
        self.pos = start + n
        return start

    def scalar(self, fmt: str) -> object:
        start = self.take(struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.buf, start)[0]

    def string(self) -> str:
        n = int(self.scalar("<Q"))
        start = self.take(n)
        return bytes(self.buf[start:start + n]).decode("utf-8", errors="replace")


_checked: dict[tuple[str, int, int], GGUFInfo] = {}  # (path, size, mtime) -> info


def check_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    """Check a GGUF's structure and return its header; raise NSDError naming the problem.

    Reads the header and metadata only (well under a second even for a 150k-token
    vocabulary) and remembers the answer per (path, size, mtime) in this process.
    """
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as exc:
        raise NSDError(f"cannot read model file {path}: {exc.strerror}") from exc
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _checked:
        _checked[key] = _parse_gguf(path, stat.st_size)
    return _checked[key]


def _parse_gguf(path: Path, size: int) -> GGUFInfo:
    if size == 0:
        raise NSDError(f"{path} is empty (0 bytes), not a model; {_RECOVER}")
    with open(path, "rb") as f:
        head = f.read(4)
        if head != GGUF_MAGIC:
            raise NSDError(f"{path} is not a GGUF file: it starts with {head!r} instead of "
                           f"b'GGUF'; {_RECOVER}")
        if size < 24:
            raise NSDError(f"{path} is truncated: {size} bytes, too short even for a GGUF "
                           f"header; {_RECOVER}")
        # mmap reads only the pages the parser touches: the metadata, not the weights.
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cur = _Cursor(buf)
            cur.take(4)
            try:
                return _parse_after_magic(path, cur, size)
            except _Truncated:
                raise NSDError(f"{path} is truncated: the file ends at byte {size} inside its "
                               f"header or metadata; {_RECOVER}") from None


def _parse_after_magic(path: Path, cur: _Cursor, size: int) -> GGUFInfo:
    version = int(cur.scalar("<I"))
    if version not in _SUPPORTED_VERSIONS:
        raise NSDError(f"{path}: unsupported GGUF version {version} (nsd reads versions 2 "
                       f"and 3; a huge number means a big-endian or corrupt file)")
    n_tensors, n_kv = int(cur.scalar("<Q")), int(cur.scalar("<Q"))
    # The parse loops below stop at the end of the file anyway; this only names absurd
    # counts (no real model has 2^32 tensors) as corruption rather than truncation.
    if n_tensors >= 1 << 32 or n_kv >= 1 << 32:
        raise NSDError(f"{path} has a corrupt GGUF header: it declares {n_tensors} tensors "
                       f"and {n_kv} metadata keys in a {size}-byte file; {_RECOVER}")
    metadata: dict[str, object] = {}
    array_lengths: dict[str, int] = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = int(cur.scalar("<I"))
        if vtype == _ARRAY:
            item_type, count = int(cur.scalar("<I")), int(cur.scalar("<Q"))
            _skip_array(path, cur, key, item_type, count)
            array_lengths[key] = count
        else:
            metadata[key] = _value(path, cur, key, vtype)
    tensors = _tensor_table(path, cur, n_tensors)
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT) or _DEFAULT_ALIGNMENT)
    data_start = -(-cur.pos // alignment) * alignment
    data_end = max((data_start + t.offset + t.n_bytes for t in tensors), default=cur.pos)
    if data_end > size:
        missing = data_end - size
        raise NSDError(f"{path} is truncated: its header declares tensor data up to byte "
                       f"{data_end} but the file has {size} bytes ({missing} missing, "
                       f"{100 * missing / data_end:.0f}%); {_RECOVER}")
    if "general.architecture" not in metadata:
        raise NSDError(f"{path} is not a model GGUF: its metadata has no general.architecture")
    return GGUFInfo(path, version, metadata, array_lengths, tensors, data_end)


def _value(path: Path, cur: _Cursor, key: str, vtype: int) -> object:
    if vtype == _STRING:
        return cur.string()
    if vtype not in _SCALARS:
        raise NSDError(f"{path} has corrupt metadata: unknown value type {vtype} for key "
                       f"{key!r}; {_RECOVER}")
    return cur.scalar(_SCALARS[vtype])


def _skip_array(path: Path, cur: _Cursor, key: str, item_type: int, count: int) -> None:
    if item_type == _STRING:
        # Strings carry their own lengths, so they must be walked; a vocabulary has 150k of
        # them, hence this tight loop rather than cur.take per string.
        buf, pos, end, unpack = cur.buf, cur.pos, len(cur.buf), _U64.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise _Truncated
            pos += 8 + unpack(buf, pos)[0]
        cur.pos = pos
        cur.take(0)  # raises if the last string ran past the end
    elif item_type in _SCALARS:
        cur.take(count * struct.calcsize(_SCALARS[item_type]))
    else:  # nested arrays are legal GGUF but no model key uses them
        raise NSDError(f"{path} has corrupt metadata: array {key!r} of value type "
                       f"{item_type}; {_RECOVER}")


def _tensor_table(path: Path, cur: _Cursor, n_tensors: int) -> tuple[TensorInfo, ...]:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = int(cur.scalar("<I"))
        if n_dims > 8:
            raise NSDError(f"{path} has a corrupt tensor table: tensor {name!r} has {n_dims} "
                           f"dimensions; {_RECOVER}")
        shape = tuple(int(cur.scalar("<Q")) for _ in range(n_dims))
        ggml_type, offset = int(cur.scalar("<I")), int(cur.scalar("<Q"))
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise NSDError(f"{path} uses an unsupported quantization: tensor {name!r} has ggml "
                           f"type {ggml_type}, unknown to this nsd (and its gguf package)") from None
        n_elements = 1
        for dim in shape:
            n_elements *= dim
        tensors.append(TensorInfo(name, shape, ggml_type, offset, n_elements // block * type_size))
    return tuple(tensors)


def require_tokenizer(info: GGUFInfo) -> None:
    """nsd tokenizes with the tokenizer stored in the GGUF; refuse a file without one."""
    if not info.has_tokenizer:
        raise NSDError(f"{info.path} has no tokenizer: its metadata lacks tokenizer.ggml.tokens "
                       "(nsd needs the tokenizer stored in the GGUF)")


def check_transformers_support(info: GGUFInfo, *, weights: bool) -> None:
    """Refuse, before minutes of work, a GGUF that transformers cannot convert."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:  # layout of another transformers version: let it decide itself
        return
    arch = info.architecture
    supported = set(GGUF_SUPPORTED_ARCHITECTURES)
    if arch not in supported and arch.replace("-", "") not in supported:
        known = ", ".join(sorted(supported))
        if weights:
            raise NSDError(f"{info.path}: unsupported architecture {arch!r} for the transformers "
                           f"backend (it converts: {known}); use --backend llama")
        # Even on llama.cpp, nsd reads a GGUF's tokenizer through transformers.
        raise NSDError(f"{info.path}: unsupported architecture {arch!r}: transformers, which "
                       f"reads the tokenizer for nsd, supports GGUF files of: {known}")
    if weights:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import _type_traits  # the types gguf-py can dequantize

        plain = {GGMLQuantizationType.F32, GGMLQuantizationType.F16}
        for tensor in info.tensors:
            qtype = GGMLQuantizationType(tensor.ggml_type)
            if qtype not in plain and qtype not in _type_traits:
                raise NSDError(f"{info.path}: unsupported quantization {qtype.name} (tensor "
                               f"{tensor.name!r}) for the transformers backend; use --backend llama")


# --- Hugging Face folders ----------------------------------------------------------------

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_hf_folder(folder: Path, *, weights: bool = True, tokenizer: bool = True) -> None:
    """Check that an HF folder has readable JSON, a tokenizer (with ``tokenizer``) and
    weights whose files are all there and not truncated (with ``weights``)."""
    for name in ("config.json", "tokenizer_config.json", "model.safetensors.index.json"):
        if (folder / name).is_file():
            _load_json(folder / name)
    if tokenizer and not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise NSDError(f"{folder} has no tokenizer: none of {', '.join(_TOKENIZER_FILES)} is "
                       "there; copy the tokenizer files of the model into it")
    if weights:
        for shard in _weight_files(folder):
            if shard.suffix == ".safetensors":
                check_safetensors(shard)


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_load_json(index).get("weight_map", {}).values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise NSDError(f"{folder} is missing weights: {', '.join(missing)} (listed in "
                           f"{index.name}) not found; copy or download them again")
        return [folder / n for n in names]
    found = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("pytorch_model*.bin"))
    if not found:
        raise NSDError(f"{folder} has no model weights: no *.safetensors or pytorch_model.bin "
                       "file; copy or download the weights into it")
    return found


def check_safetensors(path: Path) -> None:
    """A safetensors file is an 8-byte header length, a JSON header giving every tensor's
    byte range, then the data; check that the data the header declares is all there."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise NSDError(f"{path} is truncated or not a safetensors file ({size} bytes); "
                           "download or convert it again")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise NSDError(f"{path} is corrupt: its safetensors header is not JSON") from None
    ends = [int(v["data_offsets"][1]) for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v]
    data_end = 8 + n + max(ends, default=0)
    if data_end > size:
        raise NSDError(f"{path} is truncated: its header declares {data_end} bytes but the file "
                       f"has {size}; download or convert it again")


def _load_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise NSDError(f"{path} is corrupt: not valid JSON ({' '.join(str(exc).split())})") from None
    if not isinstance(value, dict):
        raise NSDError(f"{path} is corrupt: expected a JSON object")
    return value
