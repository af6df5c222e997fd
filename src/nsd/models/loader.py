"""Loading a model to run: which backend, which weight format, which tokenizer.

A model argument is resolved (:mod:`nsd.models.registry`), converted when the backend
needs another form (:mod:`nsd.models.hf_convert`, :mod:`nsd.models.weights`,
:mod:`nsd.models.draft_vocab`) and opened on the llama.cpp or transformers backend;
``--weights auto`` measures the formats side by side (:mod:`nsd.calibrate`) and keeps
the cheapest.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from nsd import options as optspec
from nsd.backends.base import ModelBackend
from nsd.calibrate import (CONTEXT_TOKENS, Calibration, calibrate, calibrate_batched,
                           compare_step_costs, fitting_context, measure)
from nsd.errors import NSDError
from nsd.backends.embedding_input import VocabMap
from nsd.models.draft_vocab import ensure_reduced_draft, open_reduced_draft
from nsd.models.hf_convert import ensure_hf_folder, ensure_tokenizer_folder
from nsd.models.registry import resolve_model
from nsd.models.weights import DERIVED_FORMATS, check_weights, gguf_for

BACKENDS = optspec.ALL["backend"].choices


@dataclass(frozen=True)
class BackendOptions:
    """How models are run (the ``backend`` options of :mod:`nsd.options`, where each is
    defined with its default, choices and help). ``auto`` picks llama.cpp for GGUF files
    when it is installed and the device is the CPU (the fastest CPU path measured),
    transformers otherwise."""

    backend: str = optspec.default("backend")
    dtype: str = optspec.default("dtype")
    threads: int | None = optspec.default("threads")
    n_ctx: int = optspec.default("n_ctx")
    device: str = optspec.default("device")
    compile: str = optspec.default("compile")
    weights: str = optspec.default("weights")
    draft_weights: str | None = optspec.default("draft_weights")  # None: as ``weights``
    draft_vocab: int | str = optspec.default("draft_vocab")  # 0: full; "auto": where it pays

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> BackendOptions:
        """From any mapping holding some of the options (parsed flags, a JSON object)."""
        return cls(**optspec.pick(values, optspec.BACKEND))

    def __post_init__(self) -> None:
        optspec.check_fields(self, optspec.BACKEND)
        from nsd.backends.hf import graph_mode, resolve_device, resolve_dtype

        resolve_dtype(self.dtype, resolve_device(self.device))  # fail before any model loads
        graph_mode(self.compile)


def llama_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


@dataclass
class LoadedModel:
    """One loaded model: its backend, the file it came from, its tokenizer folder, the
    weight format in use and, once measured, its step costs."""

    backend: ModelBackend
    file: str | None  # None: not from a file (costs are then measured, not cached)
    tokenizer_dir: str | None
    weights: str = "original"
    vocab_map: VocabMap | None = None
    calibration: Calibration | None = None
    candidates: dict[str, float] = field(default_factory=dict)  # format -> c(1) seconds
    source_file: str | None = None  # a reduced draft's full-vocabulary GGUF
    vocab_costs: dict[str, float] = field(default_factory=dict)  # full/reduced -> c(1) seconds

    def step_costs(self, n_max: int) -> tuple[float, ...]:
        """``c(1..n_max)`` for this backend on this machine (measured once, cached)."""
        if self.calibration is None or len(self.calibration.costs) < n_max:
            if self.file is None:
                context = fitting_context([self.backend], CONTEXT_TOKENS, n_max)
                self.calibration = Calibration(measure(self.backend, n_max, context), {}, cached=False)
            else:
                self.calibration = calibrate(self.backend, self.file, n_max)
        return self.calibration.costs[:n_max]

    def batched_costs(self, seqs: Sequence[int], widths: Sequence[int]) -> tuple[tuple[float, ...], ...]:
        """Seconds of one batched forward of ``seqs[i]`` sequences of ``widths[j]`` tokens
        each (:func:`nsd.calibrate.measure_batched`; measured once, cached)."""
        return calibrate_batched(self.backend, self.file, seqs, widths)


# A derived format must beat the original file's measured step by this much to be picked
# by --weights auto: requantizing costs some quality, a wash in speed is not worth it.
_AUTO_MARGIN = 0.05


def pick_format(costs: Mapping[str, float], verify_costs: Mapping[str, float] | None = None,
                tokens_per_pass: float = 1.0) -> str:
    """The weight format ``--weights auto`` keeps, from measured c(1) seconds per format.

    For a target that verifies drafts, ``verify_costs`` (seconds of one verification
    forward per format) and ``tokens_per_pass`` (the tokens one such forward is expected
    to yield) make the score the cheaper of the two ways the file can produce a token:
    a plain step, or its share of a verification. A file whose one-token step is a little
    dearer but whose verification is far cheaper (Q4_0 with nsd's VNNI kernels against
    Q4_K_M on Zen 4: c(1) 35 against 32 ms, c(5) 49 against 115 ms) is then the faster
    target. The draft's cost is the same whichever target file runs, so it does not
    change the ranking."""
    def score(fmt: str) -> float:
        if verify_costs is None:
            return costs[fmt]
        return min(costs[fmt], verify_costs[fmt] / tokens_per_pass)

    faster = [f for f in costs if f != "original" and score(f) < score("original") * (1.0 - _AUTO_MARGIN)]
    return min(faster, key=score) if faster else "original"


# --draft-vocab auto: the kept vocabulary, offered only to drafts with more than twice as
# many tokens, and kept only when its step is this much cheaper. At 32,768 tokens about 4%
# of the drafts the full vocabulary would have made are lost (BENCHMARKS.md, "Cheaper
# draft"), so a smaller saving could cost more acceptance than it saves time.
AUTO_DRAFT_VOCAB = 32768
_AUTO_VOCAB_MARGIN = 0.10


def keeps_reduced_head(costs: Mapping[str, float]) -> bool:
    """Whether ``--draft-vocab auto`` keeps the reduced draft, from measured c(1) seconds
    of the ``full`` and ``reduced`` drafts."""
    return costs["reduced"] <= costs["full"] * (1.0 - _AUTO_VOCAB_MARGIN)


def backend_kind(model: str, options: BackendOptions, resolved: Any = None) -> str:
    """``llama`` or ``hf``: the backend ``options.backend`` gives ``model`` (``auto``:
    llama.cpp for a GGUF on the CPU when it is installed, else transformers). ``resolved``:
    the model's :func:`resolve_model`, where the caller has it."""
    if options.backend != "auto":
        return options.backend
    from nsd.backends.hf import resolve_device

    on_cpu = resolve_device(options.device).type == "cpu"
    gguf = (resolved or resolve_model(model)).gguf_path is not None
    return "llama" if gguf and llama_available() and on_cpu else "hf"


def check_transformers_flags(kinds: Sequence[str], options: BackendOptions) -> None:
    """Refuse --compile and --dtype where no model runs on transformers: they would change
    nothing (llama.cpp runs its own kernels on the GGUF's format)."""
    if "hf" in kinds:
        return
    if options.compile != "none":
        raise NSDError(f"--compile {options.compile} is for the transformers backend (--backend hf); "
                       "the llama.cpp backend runs its own compiled kernels")
    if options.dtype != "auto":
        raise NSDError(f"--dtype {options.dtype} is for the transformers backend (--backend hf); "
                       "on llama.cpp the GGUF's format decides (see --weights)")


def load_backend(model: str, options: BackendOptions, draft_vocab: int | str | None = None,
                 weights: str | None = None, calibrate_n: int = 2,
                 verify: tuple[int, float] | None = None) -> LoadedModel:
    """Load one model (``weights`` overrides ``options.weights``); a reduced-vocabulary
    copy when ``draft_vocab`` asks for one (drafts only: N tokens, 0 or None for the full
    vocabulary, ``auto`` where it measures cheaper). ``auto`` weights load every format,
    measure their single steps side by side and keep the cheapest (a derived format must
    win by a margin); then ``c(1..calibrate_n)`` of the one kept. ``verify`` = (tokens of
    one verification forward, tokens it is expected to yield) marks a target that verifies
    drafts: its verification forwards are compared too (see :func:`pick_format`)."""
    weights = check_weights(weights or options.weights)
    auto_vocab = draft_vocab == "auto"
    if auto_vocab or not draft_vocab:
        draft_vocab = None
    resolved = resolve_model(model)
    backend = backend_kind(model, options, resolved)
    if draft_vocab is not None and backend != "llama":
        raise NSDError("a reduced draft vocabulary (--draft-vocab) needs a GGUF draft on the "
                       "llama.cpp backend")
    if backend == "llama":
        # A flag that would change nothing is a mistake to say (an Engine checks its pair
        # as a whole first, and passes these flags only to a model on transformers).
        check_transformers_flags([backend], options)
        if resolved.gguf_path is None:
            raise NSDError(f"the llama.cpp backend needs a GGUF file; {model} is a Hugging Face "
                           "folder (use --backend hf)")
        from nsd.backends.llama_cpp import LlamaCppBackend

        tokenizer_dir = str(ensure_tokenizer_folder(model))

        def open_format(fmt: str, size: int | None = draft_vocab) -> LoadedModel:
            path = gguf_for(resolved.gguf_path, fmt, options.threads)
            if size is not None:
                reduced = ensure_reduced_draft(path, size)
                return LoadedModel(open_reduced_draft(reduced, n_threads=options.threads,
                                                      n_ctx=options.n_ctx),
                                   str(reduced.model), tokenizer_dir, fmt, reduced.vocab_map,
                                   source_file=str(path))
            return LoadedModel(LlamaCppBackend(path, n_threads=options.threads, n_ctx=options.n_ctx),
                               str(path), tokenizer_dir, fmt)

        if weights != "auto":
            chosen = open_format(weights)
            return _reduce_where_cheaper(chosen, open_format) if auto_vocab else chosen
        # Every format loaded at once (weights are memory-mapped) and measured side by side:
        # measuring them one after another let warm-up and drift decide the pick.
        loaded = {fmt: open_format(fmt) for fmt in ("original",) + DERIVED_FORMATS}
        candidates = {fmt: (m.backend, m.file) for fmt, m in loaded.items()}
        costs = compare_step_costs(candidates)
        verify_costs = None if verify is None else compare_step_costs(candidates, n_tokens=verify[0])
        pick = pick_format(costs, verify_costs, verify[1] if verify else 1.0)
        for fmt, m in loaded.items():
            if fmt != pick:
                m.backend.close()
        best = loaded[pick]
        best.candidates = costs
        if auto_vocab:
            best = _reduce_where_cheaper(best, open_format)
        best.step_costs(calibrate_n)  # measured now, not inside the first timed generation
        return best
    if weights not in ("auto", "original"):
        raise NSDError(f"--weights {weights} needs a GGUF model on the llama.cpp backend; the "
                       "transformers backend runs the weights as converted (see --dtype)")
    from nsd.backends.hf import HFBackend

    hf_dir = resolved.hf_dir or ensure_hf_folder(model)
    return LoadedModel(HFBackend(hf_dir, dtype=options.dtype, n_threads=options.threads,
                                 device=options.device, max_len=options.n_ctx, compile=options.compile),
                       str(hf_dir), str(hf_dir))


def _reduce_where_cheaper(full: LoadedModel, open_format: Callable[..., LoadedModel]) -> LoadedModel:
    """``--draft-vocab auto``: the reduced draft of ``full``'s file if its step measures
    cheaper by the margin, side by side with the full one, else ``full``."""
    if full.backend.vocab_size <= 2 * AUTO_DRAFT_VOCAB:
        return full
    try:
        reduced = open_format(full.weights, AUTO_DRAFT_VOCAB)
    except NSDError as exc:  # e.g. a file the rewrite does not support: still a valid draft
        print(f"nsd: keeping the draft's full vocabulary ({exc})", file=sys.stderr)
        return full
    costs = compare_step_costs({"full": (full.backend, full.file), "reduced": (reduced.backend, reduced.file)})
    keep, drop = (reduced, full) if keeps_reduced_head(costs) else (full, reduced)
    drop.backend.close()
    keep.candidates, keep.vocab_costs = full.candidates, costs
    return keep


def load_tokenizer(folder: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # the folder's files were checked; this is what is left
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise NSDError(f"could not load the tokenizer in {folder}: {reason}") from exc
