"""Weight formats derived from a GGUF file: Q4_0 and Q8_0 copies made with llama.cpp.

Step costs on a CPU depend on the weight format as much as on the model: ggml has
repacked AVX-512 and AMX kernels for Q4_0 and Q8_0 that the K-quants do not get, and a
Q4_0 target can be far cheaper per step than the official Q4_K_M file (see BENCHMARKS.md
for what it costs in quality). So nsd can derive those formats from the original file,
once, with llama.cpp's own quantizer (requantizing: the source is already quantized).

Cache layout (under the nsd cache root)::

    derived/<stem>-<key>/<stem>.<tag>.gguf   the derived file, with a completion marker

``tag`` names the recipe: ``q8_0``, and ``q4_0-q8head`` for Q4_0 with a Q8_0 output head
(llama.cpp's quantizer would give the head Q6_K where its rows allow, and on an AMX
Sapphire Rapids a Q6_K head made every Q4_0 step of Qwen2.5-Coder-1.5B 8-17 ms slower than
a Q8_0 one: 50.0 against 42.5 ms for one token, side by side, benchmarks/head_format.py;
Q8_0 also rounds the head less). A new recipe gets a new tag, so a file of the old one is
never taken for it.

``key`` hashes the source's path, size and modification time, so an edited source gets
new derived files. The file is built under a temporary name, renamed into place and only
then marked (:mod:`nsd.models.markers`); a damaged or unmarked one is rebuilt with a notice.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from nsd.errors import NSDError
from nsd.models.markers import ensure_artefact

WEIGHT_CHOICES = ("auto", "original", "q4_0", "q8_0")
DERIVED_FORMATS = ("q4_0", "q8_0")
_GGML_TYPE_Q8_0 = 8  # ggml.h's enum ggml_type


@dataclass(frozen=True)
class _Recipe:
    tag: str  # names the file: a new recipe gets a new tag
    ftype: int  # llama.h's llama_ftype: LLAMA_FTYPE_MOSTLY_Q4_0 = 2, _Q8_0 = 7
    head: int | None = None  # ggml_type of the output head; None: the quantizer's default


_RECIPES = {"q4_0": _Recipe("q4_0-q8head", 2, _GGML_TYPE_Q8_0), "q8_0": _Recipe("q8_0", 7)}


def check_weights(choice: str) -> str:
    if choice not in WEIGHT_CHOICES:
        raise NSDError(f"unknown weight format {choice!r}; choose one of {', '.join(WEIGHT_CHOICES)}")
    return choice


def _derived_dir(source: Path) -> Path:
    from nsd.models.registry import cache_dir

    st = source.stat()
    ident = f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()
    return cache_dir() / "derived" / f"{source.stem}-{hashlib.sha256(ident).hexdigest()[:12]}"


def derived_path(source: Path, fmt: str) -> Path:
    """Where the ``fmt`` copy of ``source`` lives (whether or not it exists yet)."""
    return _derived_dir(source) / f"{source.stem}.{_RECIPES[fmt].tag}.gguf"


def gguf_for(source: Path, fmt: str, threads: int | None = None) -> Path:
    """The GGUF file to load for weight format ``fmt`` (``original`` or a derived one),
    making the derived file first if needed."""
    check_weights(fmt)
    if fmt in ("original", "auto"):
        return source
    target = derived_path(source, fmt)
    return ensure_artefact(target, lambda tmp: _quantize(source, tmp, fmt, threads),
                           f"derived {fmt} weights")


def _quantize(source: Path, out: Path, fmt: str, threads: int | None) -> None:
    from nsd.backends.llama_cpp import import_llama_cpp

    lib = import_llama_cpp()
    print(f"nsd: deriving {fmt.upper()} weights from {source.name} (once; cached)", file=sys.stderr)
    params = lib.llama_model_quantize_default_params()
    recipe = _RECIPES[fmt]
    params.ftype = recipe.ftype
    if recipe.head is not None:
        params.output_tensor_type = recipe.head
    params.allow_requantize = True  # the source is itself quantized (e.g. Q4_K_M)
    params.nthread = threads or (os.cpu_count() or 1)
    status = lib.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if status != 0 or not out.is_file():
        raise NSDError(f"llama.cpp could not derive {fmt} weights from {source} (status {status})")
