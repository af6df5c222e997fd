"""Hugging Face folders for the transformers backend, built from a model's GGUF.

A registry name or a ``.gguf`` path becomes a folder ``transformers`` can load: the full
model dequantized to float32 (:func:`ensure_hf_folder`), or only its tokenizer, for chat
templates and decoding when llama.cpp runs the weights (:func:`ensure_tokenizer_folder`).
A registry model's conversions live next to its GGUF in the cache; a user's file gets a
folder under ``converted/`` keyed by its path, size and mtime. Each folder is built under
a temporary name and marked complete (see :mod:`nsd.models.markers`), as in
:mod:`nsd.models.registry`.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from nsd.errors import NSDError
from nsd.backends.files import (GGUFInfo, check_gguf, check_hf_folder, check_transformers_support,
                              require_tokenizer)
from nsd.models.markers import check_marker, ensure_artefact, notice
from nsd.models.registry import (REGISTRY, cache_dir, check_free_space, disk_full_error, fetch_gguf,
                                 is_hf_dir, model_path, unknown_model_message)


def _gguf_and_home(name_or_path: str | Path, *, progress: bool) -> tuple[Path, Path]:
    """The GGUF to convert and the cache folder that holds its conversions."""
    if isinstance(name_or_path, str) and name_or_path in REGISTRY:
        return fetch_gguf(name_or_path, progress=progress), model_path(name_or_path).parent
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise NSDError(unknown_model_message(str(name_or_path)))
    if not path.is_file() or path.suffix.lower() != ".gguf":
        raise NSDError(f"{path} is not a .gguf file, a Hugging Face folder, or a registry name")
    check_gguf(path)
    # A registry GGUF passed by path keeps its conversions next to it, not in converted/.
    for spec in REGISTRY.values():
        candidate = model_path(spec.name)
        if candidate.is_file() and os.path.samefile(candidate, path):
            return path, candidate.parent
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_mtime_ns}|{stat.st_size}".encode()).hexdigest()
    return path, cache_dir() / "converted" / key[:16]


def _build_atomically(target: Path, build: Callable[[Path], None], what: str,
                      adopt: Callable[[Path], None] | None = None) -> Path:
    """:func:`nsd.models.markers.ensure_artefact`, with a full disk reported as such."""
    try:
        return ensure_artefact(target, build, what, adopt)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise disk_full_error(what, target.parent) from exc
        raise


def _dtype_kwarg() -> str:
    """transformers renamed ``torch_dtype`` to ``dtype`` in 4.56 and deprecated the old name."""
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def _float32_size(info: GGUFInfo) -> int:
    """Bytes the weights take once dequantized to float32 (from the GGUF tensor table)."""
    return 4 * sum(tensor.n_elements for tensor in info.tensors)


def _convert_error(gguf_path: Path, exc: Exception) -> Exception:
    """What a failure inside transformers' GGUF reader becomes: an NSDError naming the
    file, except a full disk, which the caller reports as such."""
    if isinstance(exc, NSDError) or (isinstance(exc, OSError) and exc.errno == errno.ENOSPC):
        return exc
    reason = " ".join(str(exc).split()).rstrip(". ") or type(exc).__name__
    if isinstance(exc, KeyError):  # transformers indexes the GGUF metadata directly
        reason = f"a field it needs is missing ({reason})"
    return NSDError(f"transformers cannot convert {gguf_path}: {reason}. Use a GGUF whose "
                    "architecture and quantization transformers supports, or an HF folder.")


def _save_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # the file was checked; anything left is transformers refusing it
        raise _convert_error(gguf_path, exc) from exc
    tokenizer.save_pretrained(out)


def _save_full(gguf_path: Path, out: Path) -> None:
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM

    # transformers refuses GGUF weights without accelerate; say so before any slow work.
    if importlib.util.find_spec("accelerate") is None:
        raise NSDError("converting a GGUF for the transformers backend needs the 'accelerate' "
                       "package: pip install accelerate")
    kwargs: dict[str, object] = {_dtype_kwarg(): torch.float32}
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantize GGUF weights
        pass
    else:  # newer ones keep them packed when a kernel is installed; we want plain tensors
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     **kwargs)
    except Exception as exc:  # the file was checked; anything left is transformers refusing it
        raise _convert_error(gguf_path, exc) from exc
    # The weights are dense float32 now; a leftover GGUF quantizer would only make
    # save_pretrained refuse ("not serializable").
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    del model  # free the float32 weights before the tokenizer work
    _save_tokenizer(gguf_path, out)


def _given_hf_dir(name_or_path: str | Path, *, weights: bool) -> Path | None:
    """The argument itself when it is a Hugging Face folder (not a registry name), checked
    for what the caller needs (``weights``: the model too, not only its tokenizer)."""
    if isinstance(name_or_path, str) and name_or_path in REGISTRY:
        return None
    path = Path(name_or_path).expanduser()
    if not is_hf_dir(path):
        return None
    check_hf_folder(path, weights=weights)
    return path


def _convertible(gguf_path: Path, *, weights: bool) -> GGUFInfo:
    """The GGUF's header, once it is known to carry a tokenizer and an architecture (and,
    for ``weights``, quantizations) that transformers can convert."""
    info = check_gguf(gguf_path)
    require_tokenizer(info)
    check_transformers_support(info, weights=weights)
    return info


def ensure_hf_folder(name_or_path: str | Path, *, progress: bool = True) -> Path:
    """A Hugging Face folder (config, tokenizer, float32 safetensors) for a model.

    Accepts a registry name, a ``.gguf`` path, or an HF folder (returned as is). The GGUF
    is dequantized and converted once; later calls return the cached folder once its
    marker shows it is complete and unchanged.
    """
    given = _given_hf_dir(name_or_path, weights=True)
    if given is not None:
        return given
    gguf_path, home = _gguf_and_home(name_or_path, progress=progress)
    target = home / "hf"
    if check_marker(target) is None:
        return target
    info = _convertible(gguf_path, weights=True)

    def build(tmp: Path) -> None:
        check_free_space(home, _float32_size(info), f"the float32 conversion of {gguf_path.name}")
        if progress:
            notice(f"converting {gguf_path.name} to a Hugging Face folder (one time)...")
        _save_full(gguf_path, tmp)

    return _build_atomically(target, build, f"the conversion of {gguf_path.name}",
                             adopt=check_hf_folder)


def _check_tokenizer_folder(folder: Path) -> None:
    check_hf_folder(folder, weights=False)
    if not (folder / "tokenizer_config.json").is_file():
        raise NSDError(f"{folder} has no tokenizer_config.json")


def ensure_tokenizer_folder(name_or_path: str | Path, *, progress: bool = True) -> Path:
    """A folder ``AutoTokenizer.from_pretrained`` can load, for chat templates and decoding.

    Reuses the full HF folder when it is complete; otherwise extracts only the tokenizer,
    which takes seconds rather than the minutes a full conversion does.
    """
    given = _given_hf_dir(name_or_path, weights=False)
    if given is not None:
        return given
    gguf_path, home = _gguf_and_home(name_or_path, progress=progress)
    if check_marker(home / "hf") is None:
        return home / "hf"
    target = home / "tokenizer"
    if check_marker(target) is None:
        return target
    _convertible(gguf_path, weights=False)

    def build(tmp: Path) -> None:
        if progress:
            notice(f"extracting the tokenizer of {gguf_path.name} (one time)...")
        _save_tokenizer(gguf_path, tmp)

    return _build_atomically(target, build, f"the tokenizer of {gguf_path.name}",
                             adopt=_check_tokenizer_folder)
