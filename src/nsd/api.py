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
from typing import Generator, Mapping, Sequence

from nsd.backends.base import ModelBackend
from nsd.decode import DecodeConfig, DecodeStats, decode
from nsd.draft_vocab import VocabMap, ensure_reduced_draft
from nsd.errors import NSDError
from nsd.models import ensure_hf_folder, ensure_tokenizer_folder, resolve_model
from nsd.proposers.base import Proposer
from nsd.proposers.draft_model import DraftModelProposer
from nsd.proposers.ngram import NgramConfig, NgramProposer
from nsd.sampling import SamplingConfig
from nsd.verify import RuleConfig

METHODS = ("ar", "sd", "nsd", "typical")
BACKENDS = ("auto", "llama", "hf")
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class BackendOptions:
    """How models are run. ``auto`` picks llama.cpp for GGUF files when it is installed
    (the fastest CPU path measured), transformers otherwise."""

    backend: str = "auto"
    dtype: str = "float32"  # transformers backend only
    threads: int | None = None
    n_ctx: int = 4096

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise NSDError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.threads is not None and self.threads < 1:
            raise NSDError(f"threads must be >= 1, got {self.threads}")


@dataclass(frozen=True)
class GenerationConfig:
    """User-level settings of one generation; turned into a :class:`DecodeConfig`."""

    method: str = "nsd"
    theta: float = 0.9
    budget: float = math.inf
    cap: float = math.inf
    smooth: bool = False
    typical_epsilon: float = 0.3
    typical_delta: float = 0.09
    k: int = 4
    adaptive_k: bool = False
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise NSDError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")

    def rule(self) -> RuleConfig:
        kind = {"ar": "exact", "sd": "exact", "nsd": "nucleus", "typical": "typical"}[self.method]
        return RuleConfig(kind=kind, theta=self.theta, budget=self.budget, cap=self.cap,
                          smooth=self.smooth, epsilon=self.typical_epsilon,
                          typical_delta=self.typical_delta)

    def decode_config(self) -> DecodeConfig:
        sampling = SamplingConfig(self.temperature, self.top_k, self.top_p, self.min_p)
        return DecodeConfig(speculative=self.method != "ar", rule=self.rule(), sampling=sampling,
                            k=self.k, adaptive_k=self.adaptive_k, max_new_tokens=self.max_new_tokens,
                            seed=self.seed)


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: DecodeStats

    def to_dict(self) -> dict:
        return {"text": self.text, "stats": self.stats.to_dict()}


def llama_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def load_backend(model: str, options: BackendOptions, reduced_vocab: int | None = None
                 ) -> tuple[ModelBackend, str, VocabMap | None]:
    """Load one model; returns the backend, the folder its tokenizer loads from, and the
    id map when ``reduced_vocab`` asks for a reduced-vocabulary copy (drafts only)."""
    resolved = resolve_model(model)
    backend = options.backend
    if backend == "auto":
        backend = "llama" if resolved.gguf_path is not None and llama_available() else "hf"
    if reduced_vocab is not None and backend != "llama":
        raise NSDError("a reduced draft vocabulary (--draft-vocab) needs a GGUF draft on the "
                       "llama.cpp backend")
    if backend == "llama":
        if resolved.gguf_path is None:
            raise NSDError(f"the llama.cpp backend needs a GGUF file; {model} is a Hugging Face "
                           "folder (use --backend hf)")
        from nsd.backends.llama_cpp import LlamaCppBackend

        tokenizer_dir = ensure_tokenizer_folder(model)
        path, vocab_map = resolved.gguf_path, None
        if reduced_vocab is not None:
            path, vocab_map = ensure_reduced_draft(resolved.gguf_path, reduced_vocab)
        return LlamaCppBackend(path, n_threads=options.threads, n_ctx=options.n_ctx), \
            str(tokenizer_dir), vocab_map
    from nsd.backends.hf import HFBackend

    hf_dir = resolved.hf_dir or ensure_hf_folder(model)
    return HFBackend(hf_dir, dtype=options.dtype, n_threads=options.threads), str(hf_dir), None


def _load_tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


class Engine:
    """A target model, optionally a draft model, and their shared tokenizer."""

    def __init__(self, target: str, draft: str | None = None, proposer: str | None = None,
                 options: BackendOptions = BackendOptions(), ngram: NgramConfig = NgramConfig(),
                 draft_vocab: int | None = None) -> None:
        proposer = proposer or ("draft" if draft else "ngram")
        if proposer not in ("draft", "ngram"):
            raise NSDError(f"unknown proposer {proposer!r}; choose draft or ngram")
        if proposer == "draft" and not draft:
            raise NSDError("the draft proposer needs a draft model (--draft NAME or path)")
        self.proposer_kind = proposer
        self.ngram = ngram
        self.target, tok_dir, _ = load_backend(target, options)
        self.tokenizer = _load_tokenizer(tok_dir)
        self.draft: ModelBackend | None = None
        self.draft_vocab_map: VocabMap | None = None
        if proposer == "draft":
            self.draft, draft_tok_dir, self.draft_vocab_map = load_backend(draft, options, draft_vocab)
            _check_same_tokenizer(self.tokenizer, _load_tokenizer(draft_tok_dir), target, draft)
            if self.draft_vocab_map is None and self.draft.vocab_size != self.target.vocab_size:
                raise NSDError(f"draft {draft} has {self.draft.vocab_size} logits per token but the "
                               f"target {target} has {self.target.vocab_size}: they must share a vocabulary")
        self.eos_token_ids = self._eos_ids()

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

    def stream(self, prompt_ids: Sequence[int], config: GenerationConfig
               ) -> Generator[str, None, GenerationResult]:
        """Yield text as it is produced; return the full :class:`GenerationResult`."""
        decode_config = config.decode_config()
        stops = tuple(s for s in config.stop if s)
        tail = max((len(s) for s in stops), default=0) + 16

        def stop_check(generated: list[int]) -> bool:
            return any(s in self.tokenizer.decode(generated[-tail:]) for s in stops)

        gen = decode(self.target, list(prompt_ids), decode_config, self.make_proposer(decode_config),
                     self.eos_token_ids, stop_check if stops else None)
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


def _check_same_tokenizer(target_tok, draft_tok, target: str, draft: str) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise NSDError(f"draft {draft} and target {target} use different tokenizers; speculative "
                       "decoding needs a draft that shares the target's vocabulary")
