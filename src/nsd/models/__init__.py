"""Model files: finding, fetching, checking, converting and loading them.

Modules, lowest first: :mod:`~nsd.backends.files` (header checks of GGUF files and Hugging
Face folders, before any loader), :mod:`~nsd.models.markers` (completion markers: cached
artefacts checked before use), :mod:`~nsd.models.registry` (the registry: fetch, join,
verify, resolve a model argument), :mod:`~nsd.models.hf_convert` (GGUF → Hugging Face
folder), :mod:`~nsd.models.weights` (Q4_0 / Q8_0 copies of a GGUF),
:mod:`~nsd.models.draft_vocab` (reduced-vocabulary drafts) and :mod:`~nsd.models.loader`
(a model opened on a backend, with its tokenizer).

The names below are importable from ``nsd.models`` itself. Each is imported from its
module on first use, so that importing one module of the package (the backends import
:mod:`~nsd.backends.files`) loads no other, and listing or fetching models needs no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nsd.backends.embedding_input import VocabMap
    from nsd.models.draft_vocab import ensure_reduced_draft
    from nsd.backends.files import GGUFInfo, check_gguf, check_hf_folder
    from nsd.models.hf_convert import ensure_hf_folder, ensure_tokenizer_folder
    from nsd.models.loader import (BACKENDS, BackendOptions, LoadedModel, llama_available,
                                   load_backend, load_tokenizer, pick_format)
    from nsd.models.registry import (REGISTRY, ModelSpec, ResolvedModel, cache_dir, fetch_gguf,
                                     list_models, model_path, resolve_model, verify_model)
    from nsd.models.weights import DERIVED_FORMATS, WEIGHT_CHOICES, check_weights, gguf_for

_HOME = {  # public name -> the module that defines it (the header checks live in backends)
    "VocabMap": "nsd.backends.embedding_input",
    "ensure_reduced_draft": "nsd.models.draft_vocab",
    **dict.fromkeys(("GGUFInfo", "check_gguf", "check_hf_folder"), "nsd.backends.files"),
    **dict.fromkeys(("ensure_hf_folder", "ensure_tokenizer_folder"), "nsd.models.hf_convert"),
    **dict.fromkeys(("BACKENDS", "BackendOptions", "LoadedModel", "llama_available", "load_backend",
                     "load_tokenizer", "pick_format"), "nsd.models.loader"),
    **dict.fromkeys(("REGISTRY", "ModelSpec", "ResolvedModel", "cache_dir", "fetch_gguf", "list_models",
                     "model_path", "resolve_model", "verify_model"), "nsd.models.registry"),
    **dict.fromkeys(("DERIVED_FORMATS", "WEIGHT_CHOICES", "check_weights", "gguf_for"),
                    "nsd.models.weights"),
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
