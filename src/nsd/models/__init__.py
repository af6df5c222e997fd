"""Model files: finding, fetching, checking, converting and loading them.

Modules, lowest first: :mod:`~nsd.models.files` (header checks of GGUF files and Hugging
Face folders, before any loader), :mod:`~nsd.models.markers` (completion markers: cached
artefacts checked before use), :mod:`~nsd.models.registry` (the registry: fetch, join,
verify, resolve a model argument), :mod:`~nsd.models.hf_convert` (GGUF → Hugging Face
folder), :mod:`~nsd.models.weights` (Q4_0 / Q8_0 copies of a GGUF),
:mod:`~nsd.models.draft_vocab` (reduced-vocabulary drafts) and :mod:`~nsd.models.loader`
(a model opened on a backend, with its tokenizer).

The names below are importable from ``nsd.models`` itself. The draft-vocabulary and
loading names are imported on first use: they need torch, and fetching or listing
models does not.
"""

from __future__ import annotations

import importlib
from typing import Any

from nsd.models.files import GGUFInfo, check_gguf, check_hf_folder
from nsd.models.hf_convert import ensure_hf_folder, ensure_tokenizer_folder
from nsd.models.registry import (REGISTRY, ModelSpec, ResolvedModel, cache_dir, fetch_gguf,
                                 list_models, model_path, resolve_model, verify_model)
from nsd.models.weights import DERIVED_FORMATS, WEIGHT_CHOICES, check_weights, gguf_for

_LAZY = {
    "VocabMap": "draft_vocab", "ensure_reduced_draft": "draft_vocab",
    "BACKENDS": "loader", "BackendOptions": "loader", "LoadedModel": "loader",
    "llama_available": "loader", "load_backend": "loader", "load_tokenizer": "loader",
    "pick_format": "loader",
}

__all__ = [
    "DERIVED_FORMATS", "GGUFInfo", "REGISTRY", "WEIGHT_CHOICES", "ModelSpec", "ResolvedModel",
    "cache_dir", "check_gguf", "check_hf_folder", "check_weights", "ensure_hf_folder",
    "ensure_tokenizer_folder", "fetch_gguf", "gguf_for", "list_models", "model_path",
    "resolve_model", "verify_model", *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"nsd.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
