"""The library entry point: load a target (and a draft), then generate.

>>> from nsd.api import Engine, GenerationConfig
>>> engine = Engine("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct")
>>> result = engine.generate("def quicksort(arr):", GenerationConfig(method="nsd", theta=0.9))
>>> result.text, result.stats.tau, result.stats.deviation
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any, Generator, Mapping, Sequence

from nsd import options as optspec
from nsd.backends.base import ModelBackend
from nsd.calibrate import Calibration, calibrate, compare_step_costs, measure
from nsd.costmodel import AcceptanceTracker, CostModelK, StepCosts
from nsd.decode import DecodeConfig, DecodeStats, decode
from nsd.draft_vocab import VocabMap, ensure_reduced_draft, open_reduced_draft
from nsd.errors import NSDError
from nsd.hf_convert import ensure_hf_folder, ensure_tokenizer_folder
from nsd.models import resolve_model
from nsd.proposers.base import Proposer
from nsd.proposers.draft_model import DraftModelProposer
from nsd.proposers.ngram import NgramConfig, NgramProposer
from nsd.sampling import SamplingConfig
from nsd.verify import RuleConfig
from nsd.weights import DERIVED_FORMATS, check_weights, gguf_for

METHODS = optspec.METHODS
CHAT_ROLES = ("system", "user", "assistant")


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

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> BackendOptions:
        """From any mapping holding some of the options (parsed flags, a JSON object)."""
        return cls(**optspec.pick(values, optspec.BACKEND))

    def __post_init__(self) -> None:
        optspec.check_fields(self, optspec.BACKEND)
        from nsd.backends.hf import graph_mode, resolve_device, resolve_dtype

        resolve_dtype(self.dtype, resolve_device(self.device))  # fail before any model loads
        graph_mode(self.compile)


@dataclass(frozen=True)
class GenerationConfig:
    """User-level settings of one generation: the decoding rule and sampling options and
    the draft-length options of :mod:`nsd.options` (defined there once, with default,
    range and help), plus stop strings. Validated whole on construction; turned into a
    :class:`DecodeConfig` for the loop."""

    method: str = optspec.default("method")
    theta: float = optspec.default("theta")
    budget: float = optspec.default("budget")
    cap: float = optspec.default("cap")
    smooth: bool = optspec.default("smooth")
    typical_epsilon: float = optspec.default("typical_epsilon")  # Medusa's posterior_threshold
    typical_delta: float = optspec.default("typical_delta")  # Medusa's posterior_alpha
    k: int | str = optspec.default("k")  # drafts per block, or "auto": the cost model picks (0..k_max)
    k_max: int = optspec.default("k_max")
    adaptive_k: bool = optspec.default("adaptive_k")
    max_new_tokens: int = optspec.default("max_new_tokens")
    temperature: float = optspec.default("temperature")
    top_k: int = optspec.default("top_k")
    top_p: float = optspec.default("top_p")
    min_p: float = optspec.default("min_p")
    seed: int = optspec.default("seed")
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        optspec.check_fields(self, optspec.DECODING)
        optspec.check_fields(self, optspec.DRAFT_LENGTH)
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            raise NSDError(f"stop must be a sequence of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        self.decode_config()  # the combined checks (k_max >= k with adaptive k, ...)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], **overrides: Any) -> GenerationConfig:
        """From any mapping holding some of the options (parsed flags, a JSON object)."""
        picked = optspec.pick(values, [*optspec.DECODING, *optspec.DRAFT_LENGTH, "stop"])
        if "stop" in picked:
            picked["stop"] = tuple(picked["stop"] or ())
        return cls(**{**picked, **overrides})

    @property
    def auto_k(self) -> bool:
        # --adaptive-k keeps its own heuristic, starting from 4 when k is left to auto.
        return self.k == "auto" and not self.adaptive_k

    def rule(self) -> RuleConfig:
        return RuleConfig.for_method(self.method, theta=self.theta, budget=self.budget,
                                     cap=self.cap, smooth=self.smooth,
                                     typical_epsilon=self.typical_epsilon,
                                     typical_delta=self.typical_delta)

    def decode_config(self) -> DecodeConfig:
        sampling = SamplingConfig(self.temperature, self.top_k, self.top_p, self.min_p)
        k = 4 if self.k == "auto" else self.k
        return DecodeConfig(speculative=self.method != "ar", rule=self.rule(), sampling=sampling,
                            k=k, adaptive_k=self.adaptive_k, auto_k=self.auto_k, k_max=self.k_max,
                            max_new_tokens=self.max_new_tokens, seed=self.seed)


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: DecodeStats

    def to_dict(self) -> dict:
        return {"text": self.text, "stats": self.stats.to_dict()}


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

    def step_costs(self, n_max: int) -> tuple[float, ...]:
        """``c(1..n_max)`` for this backend on this machine (measured once, cached)."""
        if self.calibration is None or len(self.calibration.costs) < n_max:
            if self.file is None:
                self.calibration = Calibration(measure(self.backend, n_max), {}, cached=False)
            else:
                self.calibration = calibrate(self.backend, self.file, n_max)
        return self.calibration.costs[:n_max]


# A derived format must beat the original file's measured step by this much to be picked
# by --weights auto: requantizing costs some quality, a wash in speed is not worth it.
_AUTO_MARGIN = 0.05


def pick_format(costs: Mapping[str, float]) -> str:
    """The weight format ``--weights auto`` keeps, from measured c(1) seconds per format."""
    faster = [f for f in costs if f != "original" and costs[f] < costs["original"] * (1.0 - _AUTO_MARGIN)]
    return min(faster, key=costs.__getitem__) if faster else "original"


def load_backend(model: str, options: BackendOptions, reduced_vocab: int | None = None,
                 weights: str | None = None, calibrate_n: int = 2) -> LoadedModel:
    """Load one model (``weights`` overrides ``options.weights``); a reduced-vocabulary
    copy when ``reduced_vocab`` asks for one (drafts only). ``auto`` weights load
    every format, measure their single steps side by side and keep the cheapest (a
    derived format must win by a margin); then ``c(1..calibrate_n)`` of the one kept."""
    weights = check_weights(weights or options.weights)
    resolved = resolve_model(model)
    backend = options.backend
    if backend == "auto":
        from nsd.backends.hf import resolve_device

        on_cpu = resolve_device(options.device).type == "cpu"
        backend = "llama" if resolved.gguf_path is not None and llama_available() and on_cpu else "hf"
    if reduced_vocab is not None and backend != "llama":
        raise NSDError("a reduced draft vocabulary (--draft-vocab) needs a GGUF draft on the "
                       "llama.cpp backend")
    if backend == "llama":
        if resolved.gguf_path is None:
            raise NSDError(f"the llama.cpp backend needs a GGUF file; {model} is a Hugging Face "
                           "folder (use --backend hf)")
        from nsd.backends.llama_cpp import LlamaCppBackend

        tokenizer_dir = str(ensure_tokenizer_folder(model))

        def open_format(fmt: str) -> LoadedModel:
            path = gguf_for(resolved.gguf_path, fmt, options.threads)
            if reduced_vocab is not None:
                reduced = ensure_reduced_draft(path, reduced_vocab)
                return LoadedModel(open_reduced_draft(reduced, n_threads=options.threads, n_ctx=options.n_ctx),
                                   str(reduced.model), tokenizer_dir, fmt, reduced.vocab_map)
            return LoadedModel(LlamaCppBackend(path, n_threads=options.threads, n_ctx=options.n_ctx),
                               str(path), tokenizer_dir, fmt)

        if weights != "auto":
            return open_format(weights)
        # Every format loaded at once (weights are memory-mapped) and measured side by side:
        # measuring them one after another let warm-up and drift decide the pick.
        loaded = {fmt: open_format(fmt) for fmt in ("original",) + DERIVED_FORMATS}
        costs = compare_step_costs({fmt: (m.backend, m.file) for fmt, m in loaded.items()})
        pick = pick_format(costs)
        for fmt, m in loaded.items():
            if fmt != pick:
                m.backend.close()
        best = loaded[pick]
        best.candidates = costs
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


def _load_tokenizer(folder: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # the folder's files were checked; this is what is left
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise NSDError(f"could not load the tokenizer in {folder}: {reason}") from exc


class Engine:
    """A target model, optionally a draft model, and their shared tokenizer."""

    def __init__(self, target: str, draft: str | None = None, proposer: str | None = None,
                 options: BackendOptions = BackendOptions(), ngram: NgramConfig = NgramConfig(),
                 draft_vocab: int | None = None, k_max: int = GenerationConfig.k_max) -> None:
        proposer = proposer or ("draft" if draft else "ngram")
        if proposer not in ("draft", "ngram"):
            raise NSDError(f"unknown proposer {proposer!r}; choose draft or ngram")
        if proposer == "draft" and not draft:
            raise NSDError("the draft proposer needs a draft model (--draft NAME or path)")
        self.proposer_kind = proposer
        self.ngram = ngram
        if proposer == "draft":
            resolve_model(draft)  # a damaged draft is reported before the target's slow load
        # The target's costs are measured up to k_max + 1 tokens at once (verification).
        self.target_model = load_backend(target, options, calibrate_n=k_max + 1)
        self.target = self.target_model.backend
        self.tokenizer = _load_tokenizer(self.target_model.tokenizer_dir)
        self.draft_model: LoadedModel | None = None
        self.draft: ModelBackend | None = None
        self.draft_vocab_map: VocabMap | None = None
        if proposer == "draft":
            self.draft_model = load_backend(draft, options, draft_vocab,
                                            weights=options.draft_weights or options.weights)
            self.draft, self.draft_vocab_map = self.draft_model.backend, self.draft_model.vocab_map
            _check_same_tokenizer(self.tokenizer, _load_tokenizer(self.draft_model.tokenizer_dir),
                                  target, draft)
            if self.draft_vocab_map is None and self.draft.vocab_size != self.target.vocab_size:
                raise NSDError(f"draft {draft} has {self.draft.vocab_size} logits per token but the "
                               f"target {target} has {self.target.vocab_size}: they must share a vocabulary")
        self.eos_token_ids = self._eos_ids()

    @classmethod
    def from_backends(cls, target: ModelBackend, tokenizer, draft: ModelBackend | None = None,
                      proposer: str | None = None, ngram: NgramConfig = NgramConfig(),
                      eos_token_ids: Sequence[int] | None = None) -> Engine:
        """An engine over backends already loaded (any :class:`ModelBackend`, e.g. a test's
        mock LM) and a tokenizer with ``encode``/``decode``. Their step costs, if ``-k
        auto`` needs them, are measured in place and not cached."""
        engine = cls.__new__(cls)
        engine.proposer_kind = proposer or ("draft" if draft is not None else "ngram")
        engine.ngram = ngram
        engine.target_model = LoadedModel(target, None, None)
        engine.target = target
        engine.tokenizer = tokenizer
        engine.draft_model = LoadedModel(draft, None, None) if draft is not None else None
        engine.draft = draft
        engine.draft_vocab_map = None
        engine.eos_token_ids = tuple(eos_token_ids) if eos_token_ids is not None else engine._eos_ids()
        return engine

    @classmethod
    def from_models(cls, target_model: Any, tokenizer: Any, draft_model: Any = None,
                    proposer: str | None = None, ngram: NgramConfig = NgramConfig(),
                    max_len: int = 4096, compile: bool | str = False) -> Engine:
        """An engine around models already in memory, like transformers' ``assistant_model``.

        ``target_model`` and ``draft_model`` are transformers causal LMs (run where they
        are, in their dtype, with nsd's static KV cache; not modified) or ready
        :class:`ModelBackend` objects; ``tokenizer`` is the one tokenizer they share.
        """
        proposer = proposer or ("draft" if draft_model is not None else "ngram")
        if proposer not in ("draft", "ngram"):
            raise NSDError(f"unknown proposer {proposer!r}; choose draft or ngram")
        if proposer == "draft" and draft_model is None:
            raise NSDError("the draft proposer needs a draft model (draft_model=...)")

        def wrap(model: Any) -> ModelBackend:
            if isinstance(model, ModelBackend):
                return model
            from nsd.backends.hf import HFBackend

            return HFBackend.from_model(model, max_len=max_len, compile=compile)

        target = wrap(target_model)
        draft = wrap(draft_model) if proposer == "draft" else None
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise NSDError(f"the draft model has {draft.vocab_size} logits per token but the target "
                           f"has {target.vocab_size}: they must share a vocabulary")
        return cls.from_backends(target, tokenizer, draft, proposer=proposer, ngram=ngram)

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(getattr(self.target, "eos_token_ids", ()))
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    @property
    def context_length(self) -> int | None:
        """Tokens the loaded models can hold (prompt + generation), or None when unbounded."""
        limits = [getattr(m, attr) for m in (self.target, self.draft) if m is not None
                  for attr in ("n_ctx", "max_positions") if isinstance(getattr(m, attr, None), int)]
        return min(limits) if limits else None

    def encode(self, prompt: str | Sequence[Mapping[str, str]], chat: bool = False,
               system: str | None = None) -> list[int]:
        """Token ids of ``prompt``; with ``chat``, wrapped in the model's chat template.

        ``prompt`` may also be a conversation: a list of ``{"role", "content"}`` messages
        with roles ``system``, ``user`` and ``assistant``, always wrapped in the template.
        """
        if not isinstance(prompt, str):
            return self._encode_messages(list(prompt))
        if not prompt or not prompt.strip():
            raise NSDError("the prompt is empty")
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": prompt}]
            return self._encode_messages(messages)
        return self.tokenizer.encode(prompt)

    def _encode_messages(self, messages: list[Mapping[str, str]]) -> list[int]:
        for i, message in enumerate(messages):
            if message.get("role") not in CHAT_ROLES:
                raise NSDError(f"message {i} has role {message.get('role')!r}; roles are "
                               f"{', '.join(CHAT_ROLES)}")
            if not isinstance(message.get("content"), str):
                raise NSDError(f"message {i} has no text content")
        if not any(m["content"].strip() for m in messages):
            raise NSDError("the prompt is empty")
        if not getattr(self.tokenizer, "chat_template", None):
            raise NSDError("this model's tokenizer has no chat template: use a plain prompt (no --chat)")
        clean = [{"role": m["role"], "content": m["content"]} for m in messages]
        text = self.tokenizer.apply_chat_template(clean, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def make_proposer(self, config: DecodeConfig) -> Proposer | None:
        if not config.speculative:
            return None
        if self.proposer_kind == "ngram":
            return NgramProposer(self.ngram)
        return DraftModelProposer(self.draft, config.sampling, self.target.vocab_size,
                                  self.draft_vocab_map)

    def k_policy(self, config: DecodeConfig) -> CostModelK | None:
        """The cost-model policy for ``-k auto`` (None for fixed or adaptive k, and AR).

        Costs: the target's stored ``c(1..k_max+1)`` and the draft's ``c(1)`` (0 for n-gram
        lookups). Acceptance is learnt online within the generation, starting from the
        same prior every time, and the policy's draws are seeded from ``config.seed``: a
        seeded generation is therefore reproducible, whatever ran before it on this engine
        and however busy the machine is.
        """
        if not (config.speculative and config.auto_k):
            return None
        target_costs = self.target_model.step_costs(config.k_max + 1)
        draft_cost = 0.0
        if self.proposer_kind == "draft":
            draft_cost = self.draft_model.step_costs(1)[0]
        return CostModelK(StepCosts(target_costs, draft_cost), AcceptanceTracker(config.k_max),
                          config.k_max, seed=config.seed)

    def stream(self, prompt_ids: Sequence[int], config: GenerationConfig
               ) -> Generator[str, None, GenerationResult]:
        """Yield text as it is produced; return the full :class:`GenerationResult`."""
        decode_config = config.decode_config()
        stops = tuple(s for s in config.stop if s)
        tail = max((len(s) for s in stops), default=0) + 16  # characters held back on display
        stop_check = _StopScanner(self.tokenizer, stops) if stops else None
        gen = decode(self.target, list(prompt_ids), decode_config, self.make_proposer(decode_config),
                     self.eos_token_ids, stop_check, self.k_policy(decode_config))
        tokens: list[int] = []
        shown = ""
        while True:
            try:
                tokens.extend(next(gen))
            except StopIteration as done:
                stats: DecodeStats = done.value
                break
            text = self._visible_text(tokens, stops)
            # Hold back a trailing partial UTF-8 character and a possible stop-string prefix.
            safe = text.rstrip("\ufffd")
            if stops:
                safe = safe[:max(len(shown), len(safe) - tail)]
            if len(safe) > len(shown) and safe.startswith(shown):
                yield safe[len(shown):]
                shown = safe
        text = self._visible_text(tokens, stops)
        if len(text) > len(shown) and text.startswith(shown):
            yield text[len(shown):]
        return GenerationResult(text=text, token_ids=tokens, stats=stats)

    def generate(self, prompt: str | Sequence[int], config: GenerationConfig = GenerationConfig(),
                 chat: bool = False) -> GenerationResult:
        ids = self.encode(prompt, chat=chat) if isinstance(prompt, str) else list(prompt)
        gen = self.stream(ids, config)
        while True:
            try:
                next(gen)
            except StopIteration as done:
                return done.value

    def _visible_text(self, tokens: list[int], stops: tuple[str, ...]) -> str:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        for s in stops:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        return text


_REPLACEMENT = "\ufffd"  # what a decoder renders a partial UTF-8 sequence as


class _StopScanner:
    """``stop_check`` for :func:`decode`: does the generated text contain a stop string?

    Called after every target pass with the whole growing token list. Each call decodes the
    tokens added since the previous call — a pass may add any number (k has no upper
    bound) — plus enough earlier tokens to hold a stop string that straddles passes, so
    every character is searched while the cost per pass stays proportional to the pass.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.longest = max(len(s) for s in stops)
        self.checked = 0  # tokens whose text has been searched

    def __call__(self, generated: list[int]) -> bool:
        start, self.checked = self.checked, len(generated)
        back = self.longest + 16  # earlier tokens to re-decode; nearly always ≥ 1 char each
        while True:
            lo = max(0, start - back)
            # Out of context a slice's first token can render differently (a dropped leading
            # space), so it does not count towards the `longest − 1` characters a straddling
            # stop string needs; byte-piece tokens that decode to little make the margin grow.
            # Nor do U+FFFD: a slice that starts or ends inside a UTF-8 sequence renders its
            # stray bytes as one replacement character each, which are not characters of the
            # text, and counting them lets the window start inside a stop string.
            margin = self.tokenizer.decode(generated[lo + 1:start])
            if lo == 0 or len(margin) - margin.count(_REPLACEMENT) >= self.longest:
                break
            back *= 2
        text = self.tokenizer.decode(generated[lo:])
        return any(s in text for s in self.stops)


def _check_same_tokenizer(target_tok, draft_tok, target: str, draft: str) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise NSDError(f"draft {draft} and target {target} use different tokenizers; speculative "
                       "decoding needs a draft that shares the target's vocabulary")
