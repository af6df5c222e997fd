"""The benchmark's method grid: which decoder, which proposer, which θ or budget.

A :class:`MethodSpec` is one column of the results. Labels are stable strings (they key
the journal): ``ar``, ``sd/draft``, ``nsd@0.9/ngram``, ``nsd-budget@B4/draft``,
``typical/draft``, ``topk_delta@K10,d0.6/draft``, ``threshold@s0.5,a1/draft``,
``fly@h0.3/draft`` (the engines' rules, labelled by their swept knobs: see
:data:`KNOB_LABELS`); with several draft lengths (``--ks auto,2,4``) each speculative label
gets a ``/k=…`` suffix, and with several draft contexts (``--draft-contexts 0,64``) a
``/ctx=…`` one (``ctx=all`` for the whole prompt). Outside peers: transformers' ``hf-ar``, ``hf-assisted``,
``hf-pld``, ``llama-generate`` (llama.cpp's own generation of the target file) and
``llama-speculative`` (llama.cpp's own speculative decoding of the same pair; with integer
``--ks`` it runs once per draft length, else at llama.cpp's default).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from nsd import options as optspec
from nsd.api import GenerationConfig
from nsd.errors import NSDError

LLAMA_PEERS = ("llama-generate", "llama-speculative")
FAMILIES = ("ar", "sd", "nsd", "nsd-budget", "typical", *optspec.LOSSY_METHODS, "hf-ar", "hf-assisted",
            "hf-pld") + LLAMA_PEERS
SPECULATIVE_FAMILIES = ("sd", "nsd", "nsd-budget", "typical", *optspec.LOSSY_METHODS)
# How a swept knob of an engine's rule shows in a label (topk_delta@K10,d0.6).
KNOB_LABELS = {"relaxed_topk": "K", "relaxed_delta": "d", "threshold_single": "s",
               "threshold_acc": "a", "fly_entropy_threshold": "h"}


def is_peer_family(family: str) -> bool:
    """A method family run by someone else's generate (transformers, llama.cpp), not nsd's
    engine; summary rows carry only the family, so reports ask this of it."""
    return family.startswith("hf-") or family in LLAMA_PEERS


@dataclass(frozen=True)
class MethodSpec:
    label: str
    family: str
    proposer: str | None = None  # None for AR and the transformers peers
    theta: float | None = None
    budget: float | None = None
    k: int | str | None = None  # None: the run's --draft-length
    knobs: tuple[tuple[str, float], ...] = ()  # an engine rule's swept knobs, (name, value)
    draft_context: int | None = None  # None: the run's --draft-context

    @property
    def is_hf(self) -> bool:
        return self.family.startswith("hf-")

    @property
    def is_llama_peer(self) -> bool:
        return self.family in LLAMA_PEERS

    @property
    def is_peer(self) -> bool:
        """Run by someone else's generate, not nsd's engine."""
        return is_peer_family(self.family)

    @property
    def ar_baseline(self) -> str:
        """The label speedups and agreement are measured against: the AR run on the same
        code path (ours for our methods, transformers' for its peers)."""
        return "hf-ar" if self.is_hf else "ar"

    @property
    def sd_baseline(self) -> str | None:
        """Exact speculative decoding with the same proposer: what relaxation gains."""
        if not self.proposer or self.family == "sd":
            return None
        return f"sd/{self.proposer}" + ("" if self.k is None else f"/k={self.k}") + \
            context_suffix(self.draft_context)

    def generation_config(self, base: GenerationConfig) -> GenerationConfig:
        """``base`` with this method's decoder, θ and budget (transformers peers: AR)."""
        if self.k is not None:
            base = dataclasses.replace(base, k=self.k)
        if self.draft_context is not None:
            base = dataclasses.replace(base, draft_context=self.draft_context)
        if self.is_peer or self.family == "ar":
            return dataclasses.replace(base, method="ar")
        if self.family in ("nsd", "nsd-budget"):
            return dataclasses.replace(base, method="nsd", theta=self.theta,
                                       budget=self.budget if self.budget is not None else math.inf)
        return dataclasses.replace(base, method=self.family, **dict(self.knobs))


def context_suffix(draft_context: int | None) -> str:
    """The label suffix of a draft-context variant ("" where the run's setting applies)."""
    if draft_context is None:
        return ""
    return f"/ctx={draft_context or 'all'}"


def spec_from_record(record: Mapping) -> MethodSpec:
    """The :class:`MethodSpec` a journal record ran, rebuilt from what the record says of its
    method and the label's ``/k=…`` and ``/ctx=…`` suffixes, as :func:`expand_methods` wrote
    them (for re-summarizing a run, whose records predate or outlive the grid it came from)."""
    label = record["method"]
    k: int | str | None = None
    draft_context: int | None = None
    for part in label.split("/")[1:]:
        if part.startswith("k="):
            k = part[2:] if part[2:] == "auto" else int(part[2:])
        elif part.startswith("ctx="):
            draft_context = 0 if part[4:] == "all" else int(part[4:])
    return MethodSpec(label, record["family"], record.get("proposer"), record.get("theta"),
                      record.get("budget"), k, tuple((record.get("knobs") or {}).items()), draft_context)


def _knob_grid(family: str, sweeps: Mapping[str, Sequence[float]]) -> list[tuple[tuple[str, float], ...]]:
    """Every combination of ``family``'s swept knobs (its default where none is given)."""
    names = optspec.SWEEP_KNOBS[family]
    lists = [list(dict.fromkeys(sweeps.get(n) or [optspec.default(n)])) for n in names]
    return [tuple(zip(names, values)) for values in itertools.product(*lists)]


def _check_sweeps(families: Sequence[str], sweeps: Mapping[str, Sequence[float]]) -> None:
    """Each swept value in its option's range; a knob swept only with its rule selected."""
    for name, values in sweeps.items():
        option = optspec.ALL[name]
        for value in values:
            option.check(value, label=option.flag)
        owner = next(m for m in optspec.LOSSY_METHODS if name in optspec.SWEEP_KNOBS[m])
        if values and owner not in families:
            raise NSDError(f"{option.flag} is used only by the {owner} method; add {owner} to --methods")


def expand_methods(families: Sequence[str], thetas: Sequence[float], budgets: Sequence[float],
                   proposers: Sequence[str], budget_theta: float | None = None,
                   ks: Sequence[int | str] = (),
                   sweeps: Mapping[str, Sequence[float]] | None = None,
                   contexts: Sequence[int] = ()) -> tuple[MethodSpec, ...]:
    """Every (family × θ/budget/knobs × proposer × k × draft context) combination, in the
    order given. Without ``ks`` the speculative methods use the run's draft length and carry
    no k suffix; without ``contexts`` its --draft-context, with no ctx suffix.
    ``sweeps``: values per swept knob of the engines' rules (:data:`optspec.LOSSY_SWEEP_KNOBS`); a
    rule runs once per combination of its knobs' values."""
    sweeps = {n: list(v) for n, v in (sweeps or {}).items() if v}
    unknown_knobs = [n for n in sweeps if n not in optspec.LOSSY_SWEEP_KNOBS]
    if unknown_knobs:
        raise NSDError(f"{unknown_knobs[0]!r} is not a swept knob; use {', '.join(optspec.LOSSY_SWEEP_KNOBS)}")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise NSDError(f"unknown method {unknown[0]!r}; choose from {', '.join(FAMILIES)}")
    bad = [p for p in proposers if p not in optspec.PROPOSERS]
    if bad:
        raise NSDError(f"unknown proposer {bad[0]!r}; choose from {', '.join(optspec.PROPOSERS)}")
    if not families:
        raise NSDError("no methods given")
    if not proposers and any(f in SPECULATIVE_FAMILIES for f in families):
        raise NSDError("speculative methods need a proposer (--proposers draft,ngram)")
    # Every value given is checked, whether or not a selected method uses it: a typo in a
    # flag is an error, not something the choice of --methods decides to hide.
    for theta in thetas:
        optspec.ALL["theta"].check(theta, label=optspec.ALL["theta"].flag)
    for b in budgets:  # the option's own range text offers inf, which nsd-budget is not
        try:
            valid = math.isfinite(optspec.check("budget", b))
        except NSDError:
            valid = False
        if not valid:
            raise NSDError(f"--budget values must be finite numbers >= 0 (an unlimited budget is "
                           f"plain nsd), got {b:g}")
    if budget_theta is not None:
        optspec.ALL["theta"].check(budget_theta, label="--budget-theta")
    _check_sweeps(families, sweeps)
    if "nsd" in families and not thetas:
        raise NSDError("nsd needs at least one --theta")
    if "nsd-budget" in families and not budgets:
        raise NSDError("nsd-budget needs --budget B (one or more finite budgets)")
    # --budget and --budget-theta have no default: given, they were meant for a method.
    if (budgets or budget_theta is not None) and "nsd-budget" not in families:
        flag = "--budget" if budgets else "--budget-theta"
        raise NSDError(f"{flag} is used only by the nsd-budget method; add nsd-budget to --methods")
    # The budget caps how much relaxation is spent, so pair it with the most relaxed θ.
    theta_b = budget_theta if budget_theta is not None else max(thetas, default=optspec.default("theta"))
    for k in ks:  # the range of -k itself (nsd.options), checked before any model loads
        if not (k == "auto" or isinstance(k, int)):
            raise NSDError(f"--ks values must be whole numbers or auto, got {k!r}")
        optspec.ALL["k"].check(k, label="--ks")
    for c in contexts:  # the range of --draft-context itself
        optspec.ALL["draft_context"].check(c, label="--draft-contexts")
    k_variants = [(None, "")] if not ks else [(k, f"/k={k}") for k in dict.fromkeys(ks)]
    c_variants = [None] if not contexts else list(dict.fromkeys(contexts))
    variants = [(k, c, s + context_suffix(c)) for k, s in k_variants for c in c_variants]
    specs: list[MethodSpec] = []
    for family in dict.fromkeys(families):
        if family == "ar" or family.startswith("hf-") or family == "llama-generate":
            specs.append(MethodSpec(family, family))
            continue
        if family == "llama-speculative":  # its own drafter; only a whole-number k applies
            fixed = [(k, s) for k, s in k_variants if isinstance(k, int)] or [(None, "")]
            specs += [MethodSpec(f"{family}{s}", family, k=k) for k, s in fixed]
            continue
        for proposer in proposers:
            # Prompt lookup reads no draft model: one variant per k, not per draft context.
            mine = variants if proposer != "ngram" else [(k, None, s) for k, s in k_variants]
            for k, ctx, suffix in mine:
                if family == "nsd":
                    specs += [MethodSpec(f"nsd@{t:g}/{proposer}{suffix}", family, proposer, theta=t, k=k,
                                         draft_context=ctx) for t in dict.fromkeys(thetas)]
                elif family == "nsd-budget":
                    specs += [MethodSpec(f"nsd-budget@B{b:g}/{proposer}{suffix}", family, proposer,
                                         theta=theta_b, budget=b, k=k, draft_context=ctx)
                              for b in dict.fromkeys(budgets)]
                elif family in optspec.LOSSY_METHODS:
                    for knobs in _knob_grid(family, sweeps):
                        tag = ",".join(f"{KNOB_LABELS[n]}{v:g}" for n, v in knobs)
                        specs.append(MethodSpec(f"{family}@{tag}/{proposer}{suffix}", family, proposer,
                                                k=k, knobs=knobs, draft_context=ctx))
                else:
                    specs.append(MethodSpec(f"{family}/{proposer}{suffix}", family, proposer, k=k,
                                            draft_context=ctx))
    return tuple(specs)
