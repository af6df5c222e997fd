"""Every user-facing option, defined once: its name, default, range or choices, and help.

An option's spelling is its field name (``theta``, ``typical_epsilon``, ``k_max``); the
command line writes it with dashes (``--typical-epsilon``), the server's ``nsd`` object and
vLLM's ``nsd`` section exactly as here. The front ends never restate a default or a
range: the CLI flags are generated from these specs (:mod:`nsd.cli_args`), the server
checks its request fields with :func:`check`, the bench's grid defaults and the vLLM
section read :func:`default`, and the frozen configs (:class:`nsd.api.GenerationConfig`,
:class:`nsd.api.BackendOptions`, :class:`nsd.rules.verify.RuleConfig`, …) validate themselves
against them on construction.

The options fall into three concerns, one frozen config each:

- :data:`DECODING` — the verification rule and the sampling settings of one generation;
- :data:`DRAFT_LENGTH` — how many tokens are drafted before each target pass;
- :data:`BACKEND` — how models are loaded and run.

This module imports nothing else of nsd but its error type: every layer may use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping

from nsd.errors import NSDError


@dataclass(frozen=True)
class Option:
    """One option. ``low``/``high`` bound numbers (inclusive unless ``*_open``);
    ``choices`` bound strings; ``auto`` also allows the string ``"auto"`` (draft length);
    ``optional`` allows ``None`` (meaning "not set": the documented fallback applies)."""

    name: str
    default: Any
    type: type
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    finite: bool = False  # refuse inf (NaN is always refused)
    choices: tuple[str, ...] | None = None
    optional: bool = False
    auto: bool = False
    metavar: str | None = None
    short: str | None = None  # one-letter CLI alias, e.g. -k
    long: str | None = None  # a CLI spelling other than --name-with-dashes
    words: str | None = None  # the accepted values in words, where the bounds read badly
    methods: tuple[str, ...] | None = None  # the methods it acts on (None: every method)

    def acts_on(self, methods: Iterable[str]) -> bool:
        """Whether setting it changes anything when ``methods`` run."""
        return self.methods is None or not set(self.methods).isdisjoint(methods)

    @property
    def flag(self) -> str:
        """The command-line spelling."""
        return self.long or "--" + self.name.replace("_", "-")

    def range_text(self) -> str:
        """The accepted values in words, as error messages and help show them."""
        if self.words is not None:
            return self.words
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        if self.type is bool:
            return "true or false"
        parts = []
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            parts.append(f"in {left}{self.low:g}, {self.high:g}{right}")
        elif self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        elif self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        kind = "a whole number" if self.type is int else "a number"
        text = f"{kind} {parts[0]}" if parts else kind
        if self.type is float and not self.finite and self.high is None:
            text += " (inf for none)"
        if self.auto:
            text += " or 'auto'"
        return text

    def check(self, value: Any, label: str | None = None) -> Any:
        """``value`` if it is acceptable (ints widened to float where a float is wanted),
        else an NSDError naming the option (as ``label``, e.g. its flag) and what it takes."""
        if value is None and self.optional:
            return None
        if self.auto and value == "auto":
            return value
        bad = NSDError(f"{label or self.name} must be {self.range_text()}, got {value!r}")
        if self.type is bool:
            if not isinstance(value, bool):
                raise bad
            return value
        if self.type is str:
            if not isinstance(value, str) or (self.choices is not None and value not in self.choices):
                raise bad
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        if self.type is int:
            if isinstance(value, float):
                if not value.is_integer():
                    raise bad
                value = int(value)
        else:
            value = float(value)
            if math.isnan(value) or (self.finite and math.isinf(value)):
                raise bad
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            raise bad
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            raise bad
        return value


def k_max_acts(k: int | str, adaptive_k: bool) -> bool:
    """Whether ``k_max`` changes anything: it bounds ``-k auto`` and ``--adaptive-k``; a
    fixed k without ``--adaptive-k`` drafts exactly k."""
    return k == "auto" or bool(adaptive_k)


def inert_options(given: Mapping[str, Any], methods: Iterable[str], k: int | str = "auto",
                  adaptive_k: bool = False, proposer: str | None = None) -> list[tuple[str, str]]:
    """The options set in ``given`` that would change nothing when ``methods`` run, each
    as ``(name, why)``: ``why`` is ``"method"`` for one that acts on none of ``methods``
    (``theta`` with ``sd``), ``"fixed_k"`` for ``k_max`` with a fixed ``k`` (see
    :func:`k_max_acts`), ``"proposer"`` for one that only a draft model reads
    (:data:`DRAFT_MODEL_OPTIONS`) where ``proposer`` drafts without one (None: not known).
    The one rule the CLI's notes and the server's refusals apply."""
    methods = list(methods)
    out = [(name, "method") for name in given if not _KNOWN[name].acts_on(methods)]
    if "k_max" in given and _KNOWN["k_max"].acts_on(methods) and not k_max_acts(k, adaptive_k):
        out.append(("k_max", "fixed_k"))
    if proposer is not None and proposer not in NEEDS_DRAFT:
        out += [(name, "proposer") for name in given
                if name in DRAFT_MODEL_OPTIONS and (name, "method") not in out]
    return out


def _opts(*options: Option) -> dict[str, Option]:
    return {o.name: o for o in options}


# The lossy verification rules other engines ship (nsd.rules.lossy): each method is named
# for its rule. topk_delta: TensorRT-LLM's / Modular MAX's; threshold: SGLang's; fly: vLLM's.
LOSSY_METHODS = ("topk_delta", "threshold", "fly")
METHODS = ("ar", "sd", "nsd", "typical", *LOSSY_METHODS)
# The verification rule each method runs (nsd.rules.verify.RuleConfig.kind): the one table that
# maps methods to rules, read both ways (RuleConfig.for_method, nsd.rules.verify.method_of_rule).
METHOD_RULE = {"ar": "exact", "sd": "exact", "nsd": "nucleus", "typical": "typical",
               **{m: m for m in LOSSY_METHODS}}
SPECULATIVE = ("sd", "nsd", "typical", *LOSSY_METHODS)  # the methods that draft
# The methods whose rule can relax, and those that take --budget/--cap (every one) and
# --smooth (not fly: a deferral is all or nothing).
RELAXED_METHODS = ("nsd", "typical", *LOSSY_METHODS)
SMOOTH_METHODS = ("nsd", "typical", "topk_delta", "threshold")
# The rules defined for argmax (deterministic) drafts only: with a draft model they draft
# argmaxes at any temperature (as SGLang's EAGLE and MAX's drafts do).
ARGMAX_DRAFT_METHODS = ("topk_delta", "threshold")
# The methods whose D is a derived upper bound on the deviation, not its exact value (FLy's
# relaxation reads later positions: nsd.rules.lossy); reports write it "D ≤".
DEVIATION_BOUND_METHODS = ("fly",)

# Where drafts come from. draft: the draft model; ngram: prompt lookup alone; hybrid: both,
# the -k auto policy choosing the cheaper one per block (with a fixed k, lookup takes a
# block it covers whole after a match of 3 tokens).
PROPOSERS = ("draft", "ngram", "hybrid")
NEEDS_DRAFT = ("draft", "hybrid")
# The options only a draft model reads: with prompt lookup alone they change nothing.
DRAFT_MODEL_OPTIONS = ("draft_context",)
DEFAULT_PROPOSER = "hybrid"  # with a draft model whose lookup estimates are measured


def default_proposer(has_draft: bool, lookup_measured: bool = False) -> str:
    """The proposer every front end uses when none is named: without a draft model, ngram.

    With one, hybrid only where starting acceptance estimates for prompt lookup beside it
    are stored (``lookup_measured``, see :func:`nsd.draftlen.priors.lookup_measured`; the built-in
    pair): that is where it was measured at par on code and ahead on documents. With the
    generic estimates it lost to the draft model alone on code (BENCHMARKS.md), so any
    other draft model drafts alone unless hybrid is asked for."""
    if not has_draft:
        return "ngram"
    return DEFAULT_PROPOSER if lookup_measured else "draft"

# Verification rule and sampling: what one generation does.
DECODING = _opts(
    Option("method", "nsd", str, choices=METHODS,
           help="ar: autoregressive; sd: exact speculative sampling; nsd: nucleus speculative "
                "decoding; typical: Medusa-style typical acceptance; topk_delta: TensorRT-LLM's / "
                "Modular MAX's relaxed top-K/δ acceptance; threshold: SGLang's acceptance "
                "thresholds; fly: vLLM's FLy (deferred rejection)"),
    Option("theta", 0.9, float, low=0.0, high=1.0, methods=("nsd",),
           help="NSD nucleus mass θ in [0, 1]: also accept a draft token inside the target's "
                "smallest set of tokens with mass >= θ (0 = exactly SD)"),
    Option("budget", math.inf, float, low=0.0, methods=RELAXED_METHODS,
           help="hard fidelity budget B: cap on the summed deviation D of one sequence "
                "(default: none; 0 = exactly SD)"),
    Option("cap", math.inf, float, low=0.0, methods=RELAXED_METHODS,
           help="per-position cap δ: positions with E_t > δ are verified exactly"),
    Option("smooth", False, bool, methods=SMOOTH_METHODS,
           help="spend the last remainder of the budget with a partial relaxation (sampling "
                "only: greedy relaxes all-or-nothing, so it stays seed-free)"),
    # Medusa's defaults: ε = posterior_threshold, δ = posterior_alpha.
    Option("typical_epsilon", 0.09, float, low=0.0, low_open=True, methods=("typical",),
           help="typical acceptance ε: accept p(x) > min(ε, δ·exp(−H)) (Medusa's "
                "posterior_threshold)"),
    Option("typical_delta", 0.3, float, low=0.0, low_open=True, methods=("typical",),
           help="typical acceptance δ (Medusa's posterior_alpha)"),
    # The lossy rules' knobs (nsd.rules.lossy), each with the default of the engine that
    # ships it.
    # Modular MAX's SpeculativeConfig defaults (TensorRT-LLM's own are 1 and 0: off).
    Option("relaxed_topk", 10, int, low=1, methods=("topk_delta",),
           help="top-K/δ acceptance (TensorRT-LLM MTP, Modular MAX): also accept a draft token "
                "among the target's K most likely (MAX's default 10)"),
    Option("relaxed_delta", 0.6, float, low=0.0, high=1.0, methods=("topk_delta",),
           help="top-K/δ acceptance: a top-K token is accepted only if its probability is at "
                "least the top token's minus δ (MAX's default 0.6)"),
    # SGLang's server defaults: 1 and 1 leave its rule exact.
    Option("threshold_single", 1.0, float, low=0.0, high=1.0, methods=("threshold",),
           help="SGLang's speculative_accept_threshold_single: accept a draft token whose target "
                "probability is at least this (1 = off)"),
    Option("threshold_acc", 1.0, float, low=0.0, high=1.0, low_open=True, methods=("threshold",),
           help="SGLang's speculative_accept_threshold_acc: raise a draft token's acceptance "
                "probability from p to min(1, p / this) (1 = off)"),
    # vLLM's FLy defaults (fly_window_size: min(6, k - 1) there; here a block shorter than
    # the window plus one simply defers nothing).
    Option("fly_window_size", 6, int, low=1, high=63, methods=("fly",),
           help="FLy: defer a rejection only when the next W draft tokens pass the exact test"),
    Option("fly_entropy_threshold", 0.3, float, low=0.0, methods=("fly",),
           help="FLy: defer only where the entropy of the target's top tokens is at least this "
                "(inf = never: exactly SD)"),
    Option("fly_entropy_top_k", 3, int, low=1, methods=("fly",),
           help="FLy: how many of the target's most likely tokens the entropy gate reads"),
    Option("temperature", 0.0, float, low=0.0, finite=True, help="sampling temperature; 0 = greedy"),
    Option("top_k", 0, int, low=0, help="keep the k most likely tokens (0 disables)"),
    Option("top_p", 1.0, float, low=0.0, high=1.0, low_open=True,
           help="keep the smallest set of tokens with mass >= top-p (1 disables)"),
    Option("min_p", 0.0, float, low=0.0, high=1.0, high_open=True,
           help="drop tokens below min-p times the most likely one's probability (0 disables)"),
    # OpenAI's ranges; the count is of generated tokens only (see nsd.rules.sampling.adjust_logits).
    Option("presence_penalty", 0.0, float, low=-2.0, high=2.0,
           help="subtract this from the logit of every token already generated (OpenAI's "
                "presence_penalty; target and draft alike)"),
    Option("frequency_penalty", 0.0, float, low=-2.0, high=2.0,
           help="subtract this times its count so far from the logit of every generated token "
                "(OpenAI's frequency_penalty; target and draft alike)"),
    # torch seeds its generator with a 64-bit integer (a negative one taken modulo 2^64), so
    # the signed 64-bit range is every seed that means something, each a different stream.
    Option("seed", 0, int, low=-2 ** 63, high=2 ** 63, high_open=True,
           words="a whole number in [-2^63, 2^63 - 1] (a signed 64-bit integer)",
           help="random seed: the same seed, prompt and settings give the same tokens on the "
                "same machine, with -k auto too"),
    Option("max_new_tokens", 128, int, low=1, help="most tokens to generate"),
)

# How drafting runs: how many tokens are drafted before each target pass, from how much
# of the prompt.
DRAFT_LENGTH = _opts(
    # Up to 64: every drafted position's acceptance compounds, so blocks far longer than
    # k_max's default never pay, and k sizes per-position bookkeeping and the measured
    # step-cost table (c(1..k_max+1), timed once per machine).
    Option("k", "auto", int, low=1, high=64, auto=True, short="-k", long="--draft-length",
           methods=SPECULATIVE,
           metavar="K|auto",
           help="draft tokens per block, or auto: before each block the cost model picks the k "
                "(0 = a plain step) with the most expected tokens per second"),
    Option("k_max", 8, int, low=1, high=64, methods=SPECULATIVE, help="largest k for -k auto and --adaptive-k"),
    Option("adaptive_k", False, bool, methods=SPECULATIVE, help="grow k by 2 after a fully accepted block, shrink by 1 "
                                           "otherwise (up to --k-max)"),
    # A draft model reads the prompt before its first block: a once-per-request cost the
    # target's verification does not repay (on a 2-core AVX2 CPU about a third of the
    # target's own prefill for the 0.5B/1.5B pair). Bounding it trades some acceptance.
    Option("draft_context", 0, int, low=0, methods=SPECULATIVE, metavar="N",
           help="the draft model reads at most N prompt tokens it does not hold cached: a "
                "longer prompt is drafted from its last N tokens (the target reads it all, so "
                "SD stays exact; prompt lookup sees it all too). 0: the whole prompt"),
)

# How models are loaded and run.
WEIGHT_FORMATS = ("auto", "original", "q4_0", "q8_0")
BACKEND = _opts(
    Option("backend", "auto", str, choices=("auto", "llama", "hf"),
           help="model engine: llama.cpp for GGUF (auto picks it when installed) or transformers"),
    Option("dtype", "auto", str, choices=("auto", "float32", "bfloat16", "float16"),
           help="weights dtype for the transformers backend (auto: bfloat16 on CUDA, float32 on CPU)"),
    # More threads than cores only slows llama.cpp down (its threads spin while they wait);
    # the bound catches a typo that would start thousands of them.
    Option("threads", None, int, low=1, high=1024, optional=True, help="CPU threads (default: all cores)"),
    Option("n_ctx", 4096, int, low=16,
           help="context length (llama.cpp; the transformers backend's static KV cache)"),
    Option("device", "auto", str, metavar="auto|cpu|cuda[:N]",
           help="where the transformers backend runs (auto: CUDA when torch sees a GPU; then "
                "--backend auto picks transformers)"),
    Option("compile", "none", str, choices=("none", "torch", "cudagraph"),
           help="transformers backend: graph the short forwards with torch.compile (CUDA graphs "
                "on CUDA), or capture plain CUDA graphs (cudagraph; CUDA only)"),
    Option("weights", "auto", str, choices=WEIGHT_FORMATS,
           help="GGUF weight format: the file as given, a Q4_0/Q8_0 copy derived from it once, "
                "or auto: the one that makes a token cheapest on this machine (for the target: "
                "by its one-token step and its share of a verification forward, both measured)"),
    Option("draft_weights", None, str, choices=WEIGHT_FORMATS, optional=True,
           help="weight format of the draft (default: as --weights)"),
    Option("draft_vocab", "auto", int, low=0, auto=True, metavar="N|auto",
           help="draft over a reduced output vocabulary: the N tokens most frequent in a local "
                "corpus plus the special ones (llama.cpp drafts; the draft still sees every "
                "context token; SD stays exact). 0: the full vocabulary. auto: 32768 for a "
                "llama.cpp draft of over 65,536 tokens when its step measures at least 10% "
                "cheaper on this machine, else the full vocabulary"),
)

# How `nsd serve` schedules requests.
SERVING = _opts(
    Option("parallel", 4, int, low=1, high=64, metavar="N",
           help="requests the server decodes at once, their model forwards batched (each holds a "
                "sequence of --n-ctx tokens in the KV caches; 1: one request at a time)"),
    Option("prefill_chunk", 64, int, low=0, metavar="N",
           help="with --parallel: a long forward beside other requests (a prompt's prefill) "
                "runs N tokens per batched step, so their tokens keep coming meanwhile "
                "(0: in one step)"),
    Option("max_stop", 4, int, low=1, metavar="N",
           help="most stop strings one request may give (OpenAI allows 4; each is searched "
                "for in the text after every block)"),
)


# The options every front end takes (the server's own, SERVING, only `nsd serve` does).
ALL: dict[str, Option] = {**DECODING, **DRAFT_LENGTH, **BACKEND}
_KNOWN: dict[str, Option] = {**ALL, **SERVING}
# The decoding options that pick and shape the verification rule (the rest of DECODING is
# sampling): what the server's ``nsd`` object and vLLM's ``nsd`` section take. Derived, so a
# new rule knob joins them by being declared: the method, then every option that acts only
# on relaxing methods (a knob that changes nothing for ar or sd can only shape a rule that
# relaxes; sampling acts on every method).
RULE: tuple[str, ...] = ("method", *(name for name, opt in DECODING.items()
                                      if opt.methods is not None and set(opt.methods) <= set(RELAXED_METHODS)))
# Each rule's main knobs, the ones a frontier sweeps (nsd bench takes each as a list).
SWEEP_KNOBS = {"nsd": ("theta",), "topk_delta": ("relaxed_topk", "relaxed_delta"),
               "threshold": ("threshold_single", "threshold_acc"),
               "fly": ("fly_entropy_threshold",)}
LOSSY_SWEEP_KNOBS = tuple(n for m in LOSSY_METHODS for n in SWEEP_KNOBS[m])


def default(name: str) -> Any:
    """The documented default of option ``name``."""
    return _KNOWN[name].default


def check(name: str, value: Any) -> Any:
    """``value`` checked against option ``name`` (see :meth:`Option.check`)."""
    return _KNOWN[name].check(value)


def check_fields(config: Any, options: Mapping[str, Option]) -> None:
    """Validate every field of a frozen config that is one of ``options``; frozen configs
    call this from ``__post_init__`` so that a config that exists is a valid one."""
    for f in fields(config):
        if f.name in options:
            value = getattr(config, f.name)
            checked = options[f.name].check(value)
            if type(checked) is not type(value):  # 1 -> 1.0 where a float is wanted
                object.__setattr__(config, f.name, checked)


def pick(values: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """The entries of ``values`` (e.g. parsed flags) that are options in ``names``."""
    return {n: values[n] for n in names if n in values}
