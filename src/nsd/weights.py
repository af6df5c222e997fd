"""Weight formats derived from a GGUF file: Q4_0 and Q8_0 copies made with llama.cpp.

Step costs on a CPU depend on the weight format as much as on the model: ggml has
repacked AVX-512 and AMX kernels for Q4_0 and Q8_0 that the K-quants do not get, and a
Q4_0 target can be far cheaper per step than the official Q4_K_M file (see BENCHMARKS.md
for what it costs in quality). So nsd can derive those formats from the original file,
once, with llama.cpp's own quantizer (requantizing: the source is already quantized).

Cache layout (under the nsd cache root)::

    derived/<stem>-<key>/<stem>.<fmt>.gguf          the derived file
    derived/<stem>-<key>/<stem>.<fmt>.gguf.sha256   its SHA-256 and size, written last

``key`` hashes the source's path, size and modification time, so an edited source gets
new derived files. A derived file is used only if its record exists and its size matches;
otherwise it is rebuilt (a killed quantization leaves only a temporary file behind).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
from pathlib import Path

from nsd.errors import NSDError

WEIGHT_CHOICES = ("auto", "original", "q4_0", "q8_0")
DERIVED_FORMATS = ("q4_0", "q8_0")
# llama.cpp's llama_ftype values (llama.h): LLAMA_FTYPE_MOSTLY_Q4_0 and _Q8_0.
_FTYPES = {"q4_0": 2, "q8_0": 7}


def check_weights(choice: str) -> str:
    if choice not in WEIGHT_CHOICES:
        raise NSDError(f"unknown weight format {choice!r}; choose one of {', '.join(WEIGHT_CHOICES)}")
    return choice


def _derived_dir(source: Path) -> Path:
    from nsd.models import cache_dir

    st = source.stat()
    ident = f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()
    return cache_dir() / "derived" / f"{source.stem}-{hashlib.sha256(ident).hexdigest()[:12]}"


def derived_path(source: Path, fmt: str) -> Path:
    """Where the ``fmt`` copy of ``source`` lives (whether or not it exists yet)."""
    return _derived_dir(source) / f"{source.stem}.{fmt}.gguf"


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _is_complete(path: Path) -> bool:
    record = _record_path(path)
    if not (path.is_file() and record.is_file()):
        return False
    try:
        info = json.loads(record.read_text())
        return int(info["size"]) == path.stat().st_size
    except (ValueError, KeyError, OSError):
        return False


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(4 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_for(source: Path, fmt: str, threads: int | None = None) -> Path:
    """The GGUF file to load for weight format ``fmt`` (``original`` or a derived one),
    making the derived file first if needed."""
    check_weights(fmt)
    if fmt in ("original", "auto"):
        return source
    target = derived_path(source, fmt)
    if _is_complete(target):
        return target
    return _quantize(source, target, fmt, threads)


def _quantize(source: Path, target: Path, fmt: str, threads: int | None) -> Path:
    from nsd.backends.llama_cpp import _import_llama_cpp

    lib = _import_llama_cpp()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    print(f"nsd: deriving {fmt.upper()} weights from {source.name} (once; cached)", file=sys.stderr)
    params = lib.llama_model_quantize_default_params()
    params.ftype = _FTYPES[fmt]
    params.allow_requantize = True  # the source is itself quantized (e.g. Q4_K_M)
    params.nthread = threads or (os.cpu_count() or 1)
    try:
        status = lib.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
        if status != 0 or not tmp.is_file():
            raise NSDError(f"llama.cpp could not derive {fmt} weights from {source} (status {status})")
        record = {"sha256": _sha256(tmp), "size": tmp.stat().st_size, "source": source.name, "format": fmt}
        os.replace(tmp, target)
        # The record goes last: a file without it is treated as unfinished and rebuilt.
        rec_tmp = _record_path(tmp)
        rec_tmp.write_text(json.dumps(record, indent=1))
        os.replace(rec_tmp, _record_path(target))
    finally:
        for leftover in (tmp, _record_path(tmp)):
            if leftover.exists():
                leftover.unlink()
    return target


def recorded_sha256(path: Path) -> str | None:
    """The SHA-256 recorded when a derived file was made (None for other files)."""
    try:
        return json.loads(_record_path(path).read_text())["sha256"]
    except (OSError, ValueError, KeyError):
        return None
