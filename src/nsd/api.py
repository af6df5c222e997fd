"""The library entry point: load a target (and a draft), then generate.

>>> from nsd.api import GenerationConfig, load_engine
>>> engine = load_engine("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct")
>>> result = engine.generate("def quicksort(arr):", GenerationConfig(method="nsd", theta=0.9))
>>> result.text, result.stats.tau, result.stats.deviation

The names here are the public surface; they live in :mod:`nsd.engine` (the engine),
:mod:`nsd.generation` (what a generation is asked and returns), :mod:`nsd.models.loader`
(how models are loaded) and :mod:`nsd.options` (every option, defined once).
"""

from __future__ import annotations

from nsd.engine import CHAT_ROLES, Engine, load_engine
from nsd.generation import GenerationConfig, GenerationResult, method_report
from nsd.models.loader import BACKENDS, BackendOptions, LoadedModel, llama_available, load_backend, pick_format
from nsd.options import METHODS

__all__ = ["BACKENDS", "BackendOptions", "CHAT_ROLES", "Engine", "GenerationConfig", "GenerationResult",
           "LoadedModel", "METHODS", "llama_available", "load_backend", "load_engine", "method_report",
           "pick_format"]
