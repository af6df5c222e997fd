"""What one generation is asked to do and what it returns.

:class:`GenerationConfig` holds the user-level options of one generation (the decoding
rule and sampling, the draft-length policy: each defined once in :mod:`nsd.options`) and
turns them into the loop's :class:`~nsd.decode.DecodeConfig`; :class:`GenerationResult`
is the text, the token ids and the statistics.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from nsd import options as optspec
from nsd.decode import DecodeConfig, DecodeStats
from nsd.errors import NSDError
from nsd.rules.sampling import SamplingConfig
from nsd.rules.verify import RuleConfig


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
    relaxed_topk: int = optspec.default("relaxed_topk")  # topk_delta (TensorRT-LLM, MAX)
    relaxed_delta: float = optspec.default("relaxed_delta")
    threshold_single: float = optspec.default("threshold_single")  # threshold (SGLang)
    threshold_acc: float = optspec.default("threshold_acc")
    fly_window_size: int = optspec.default("fly_window_size")  # fly (vLLM's FLy)
    fly_entropy_threshold: float = optspec.default("fly_entropy_threshold")
    fly_entropy_top_k: int = optspec.default("fly_entropy_top_k")
    k: int | str = optspec.default("k")  # drafts per block, or "auto": the cost model picks (0..k_max)
    k_max: int = optspec.default("k_max")
    adaptive_k: bool = optspec.default("adaptive_k")
    draft_context: int = optspec.default("draft_context")  # 0: the draft reads the whole prompt
    max_new_tokens: int = optspec.default("max_new_tokens")
    temperature: float = optspec.default("temperature")
    top_k: int = optspec.default("top_k")
    top_p: float = optspec.default("top_p")
    min_p: float = optspec.default("min_p")
    presence_penalty: float = optspec.default("presence_penalty")
    frequency_penalty: float = optspec.default("frequency_penalty")
    seed: int = optspec.default("seed")
    stop: tuple[str, ...] = field(default_factory=tuple)
    # Added to the logits of these token ids, target and draft alike: ((id, bias), ...).
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # Report each generated token's log-probability and the top ``logprobs`` alternatives
    # (None: not computed); see nsd.decode.TokenLogprob.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Each option is checked once, by the config it builds: the rule's knobs (theta,
        # budget, ...) by the RuleConfig, sampling by the SamplingConfig, the draft length,
        # seed and length (and the checks that combine them) by the DecodeConfig, built
        # once and kept for decode_config(). Only a k that is not a number (auto) is here.
        if not isinstance(self.k, int) or isinstance(self.k, bool):
            object.__setattr__(self, "k", optspec.check("k", self.k))
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            raise NSDError(f"stop must be a sequence of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        items = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in items))
        decode = _loop_config(self)
        rule, knobs = decode.rule, [name for name in optspec.RULE if name != "method"]
        checked = {**{name: getattr(rule, name) for name in knobs},
                   **{f.name: getattr(decode.sampling, f.name) for f in fields(decode.sampling)},
                   "k_max": decode.k_max, "max_new_tokens": decode.max_new_tokens, "seed": decode.seed}
        for name, value in checked.items():  # as checked: 1 -> 1.0 where a float is wanted
            object.__setattr__(self, name, value)  # equal, and hashes alike: still cached

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
        return self.decode_config().rule

    def decode_config(self) -> DecodeConfig:
        """The loop's configuration of this generation (built and checked on construction)."""
        return _loop_config(self)

    def _build_decode_config(self) -> DecodeConfig:
        rule = RuleConfig.for_method(self.method, **{name: getattr(self, name) for name in
                                                     optspec.RULE if name != "method"})
        sampling = SamplingConfig(self.temperature, self.top_k, self.top_p, self.min_p,
                                  self.presence_penalty, self.frequency_penalty,
                                  tuple(self.logit_bias))
        k = 4 if self.k == "auto" else self.k
        return DecodeConfig(speculative=self.method != "ar", rule=rule, sampling=sampling,
                            k=k, adaptive_k=self.adaptive_k, auto_k=self.auto_k, k_max=self.k_max,
                            draft_context=self.draft_context,
                            max_new_tokens=self.max_new_tokens, seed=self.seed,
                            logprobs=self.logprobs)


@functools.lru_cache(maxsize=256)
def _loop_config(config: GenerationConfig) -> DecodeConfig:
    """The :class:`DecodeConfig` of a generation, built (and so checked) once per distinct
    configuration: frozen configs that compare equal get the same one."""
    return config._build_decode_config()


@dataclass(frozen=True)
class TokenInfo:
    """A generated token as the text shows it, with its log-probabilities: ``text`` is the
    token's piece of the output (empty for a token that ends inside a UTF-8 character: the
    next one carries the character), ``offset`` where that piece starts, ``logprob`` the
    token's log-probability under the target distribution of its position, and ``top`` the
    most likely tokens there as ``(id, text, logprob)`` (see :class:`nsd.decode.TokenLogprob`).
    """

    token_id: int
    text: str
    offset: int
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


class TextChunk(str):
    """A piece of streamed text carrying the :class:`TokenInfo` of the tokens it completes
    (``logprobs``; None when the generation does not report them)."""

    logprobs: list[TokenInfo] | None = None


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: DecodeStats
    # With GenerationConfig.logprobs: one entry per token of ``text`` (tokens past a stop
    # string are not included), each with the token's text piece.
    logprobs: list[TokenInfo] | None = None

    def to_dict(self) -> dict:
        return {"text": self.text, "stats": self.stats.to_dict()}


def method_report(config: GenerationConfig, effective: str) -> dict[str, Any]:
    """The method as requested, with the knobs that shape it, and the method that ran.

    The library names a run by what it did: a rule that cannot relax (θ = 0, budget 0,
    cap 0) verifies exactly, so it is ``sd``. A client that asked for ``nsd`` with budget 0
    would then read ``sd`` back and not know why; it gets ``method: nsd`` (as asked, and the
    label of its metrics), ``budget: 0`` and ``effective_method: sd``.
    """
    out: dict[str, Any] = {"method": config.method, "effective_method": effective}
    # Those that act on the method asked for: θ, budget and cap, and the swept knobs of
    # the engines' rules (nsd.options.LOSSY_SWEEP_KNOBS).
    for name in ("theta", "budget", "cap", *optspec.LOSSY_SWEEP_KNOBS):
        if optspec.ALL[name].acts_on([config.method]):
            value = getattr(config, name)
            # JSON has no infinity: an unlimited budget or cap is null.
            out[name] = None if isinstance(value, float) and math.isinf(value) else value
    if config.method in optspec.DEVIATION_BOUND_METHODS:
        # FLy's D is a derived bound on the deviation, not its exact value (nsd.rules.lossy).
        out["deviation_is"] = "bound"
    return out
