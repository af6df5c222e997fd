"""nsd's own work per pass, measured once per machine, so ``-k auto`` prices it.

The model steps are not all a pass costs. Between them nsd turns logits into
distributions (:func:`nsd.rules.sampling.logits_to_probs` on every verified row), runs the
acceptance rule and draws; the draft transforms and draws each token it proposes. A
plain step does only one row's worth of it. On two Zen 4 cores that was 2–3 ms per
verification pass against ~0.4 ms per plain step at T = 0, and more when sampling: small
beside a 35 ms target step, but not beside the few percent a marginal draft block gains,
and the cost model, pricing only the forwards, drafted where drafting lost (SD predicted
at 33.3 decode tok/s on Spec-Bench, measured at 29.6, AR 30.3).

:func:`measure_host_costs` times the decoding loop's own functions on synthetic, peaked
logits (real next-token distributions put most of their mass on a few dozen tokens; flat
rows would send top-p to its slow full-sort path far more often than text does) and fits
``fixed + per_row · rows`` to a speculative pass. :func:`host_costs` caches the result
beside the step costs, keyed by what changes it (CPU, torch and its thread count, the
vocabularies, which filters are on, the rule): like them, it is measured once and then
read (provisionally while the machine stays busy), so a seeded generation chooses the
same draft lengths from one run to the next.
"""

from __future__ import annotations

import functools
import hashlib
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from nsd.draftlen.costmodel import StepCosts
from nsd.rules.sampling import SamplingConfig, adjust_logits, logits_to_probs, plausibility_probs, sample_from
from nsd.rules.entry import verify
from nsd.rules.lossy import topk_delta_inputs
from nsd.rules.verify import RuleConfig

REPEATS = 21
_PEAK_TOKENS = 32  # tokens carrying most of a synthetic row's mass
_VERSION = 1  # part of the cache key: what is timed


@dataclass(frozen=True)
class HostCosts:
    """Seconds of nsd's own work: ``plain`` per plain step, ``fixed + per_row · n`` per
    speculative pass verifying ``n`` target rows, ``draft_token`` per token a draft model
    proposes (0 for prompt lookup, which transforms nothing)."""

    plain: float
    fixed: float
    per_row: float
    draft_token: float

    def __post_init__(self) -> None:
        for name in ("plain", "fixed", "per_row", "draft_token"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"host cost {name} must be >= 0 and finite, got {value}")

    def pass_cost(self, rows: int) -> float:
        return self.plain if rows <= 1 else self.fixed + self.per_row * rows

    def apply(self, target: Sequence[float], draft: float, draft_model: bool = True) -> StepCosts:
        """Step costs with this work added: ``target[n − 1]`` (a forward over ``n``
        tokens) gains what a pass verifying ``n`` rows adds (a plain step's for n = 1),
        the draft's per-token cost what its transform adds."""
        table = tuple(c + self.pass_cost(n) for n, c in enumerate(target, start=1))
        return StepCosts(table, draft + (self.draft_token if draft_model else 0.0))


def _peaked(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=gen) * 2.0
    peak = torch.randint(0, vocab, (rows, _PEAK_TOKENS), generator=gen)
    return logits.scatter_add(-1, peak, torch.full(peak.shape, 12.0))


def _medians_s(fns: Sequence[Callable[[], Any]], repeats: int) -> list[float]:
    """Median seconds of each function, timed round-robin so drift hits them alike (the
    per-row slope is a difference of two of them)."""
    for fn in fns:
        fn()  # untimed: first-call allocations
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(s) for s in samples]


def _spec_pass(logits: torch.Tensor, draft_rows: torch.Tensor, sampling: SamplingConfig,
               rule: RuleConfig, gen: torch.Generator) -> Callable[[], Any]:
    """The host half of one verification pass over ``logits`` ``[n, V]`` (what
    :func:`nsd.decode.decode` runs between the target forward and the next block)."""
    n = logits.shape[0] - 1
    if sampling.greedy or rule.argmax_drafts:  # as the proposer drafts for this rule
        q = None
        tokens = draft_rows.argmax(-1)
    else:
        q = logits_to_probs(draft_rows, sampling)
        tokens = sample_from(q, torch.rand(n, dtype=torch.float64, generator=gen))
    spent = torch.zeros(1, dtype=torch.float64)

    def run() -> Any:
        probs = logits_to_probs(logits, sampling)
        plaus = plausibility_probs(logits[:n], sampling, probs[:n]) if rule.relaxes else probs[:n]
        accept_uniforms = torch.rand(1, n, dtype=torch.float64, generator=gen)
        sample_uniforms = torch.rand(1, dtype=torch.float64, generator=gen)
        relaxed, mix = topk_delta_inputs(rule, sampling, logits[:n], gen)  # as decode's order
        return verify(rule, probs.unsqueeze(0), plaus.unsqueeze(0), tokens.unsqueeze(0),
                      None if q is None else q.unsqueeze(0), accept_uniforms, sample_uniforms,
                      spent, greedy=sampling.greedy, relaxed_probs=relaxed, mix_uniforms=mix)

    return run


def measure_host_costs(vocab: int, sampling: SamplingConfig, rule: RuleConfig, n_max: int,
                       draft_vocab: int | None = None, repeats: int = REPEATS) -> HostCosts:
    """Median seconds of each part of nsd's own work, on synthetic peaked logits.

    ``n_max``: the largest pass (k_max + 1 rows); the per-row slope is fitted between 2
    rows and ``n_max``. ``draft_vocab``: the draft's output width if it differs (a
    reduced head, whose ``q`` is then spread back over ``vocab`` as the proposer does).
    """
    gen = torch.Generator().manual_seed(0)
    n_max = max(n_max, 3)
    logits = _peaked(n_max, vocab, gen)
    draft_width = draft_vocab or vocab
    draft_logits = _peaked(n_max - 1, draft_width, gen)

    def plain() -> Any:  # nsd.decode._sample_one, as the plain step runs it
        row = logits[0]
        if sampling.greedy:
            return int(adjust_logits(row, sampling).argmax())
        probs = logits_to_probs(row, sampling).unsqueeze(0)
        return int(sample_from(probs, torch.rand(1, dtype=torch.float64, generator=gen))[0])

    def draft_token() -> Any:  # one draft token, as DraftModelProposer draws it
        row = draft_logits[0]
        if sampling.greedy:
            return int(adjust_logits(row, sampling).argmax())
        probs = logits_to_probs(row, sampling)
        token = int(sample_from(probs.unsqueeze(0), torch.rand(1, dtype=torch.float64, generator=gen))[0])
        if draft_width != vocab:
            probs = torch.zeros(vocab).index_copy_(0, torch.arange(draft_width), probs)
        return token, probs

    # A draft close to the target (its drafts mostly accepted, as where drafting pays); a
    # reduced draft's rows enter verification spread over the full vocabulary, like these.
    full_draft = logits[:-1] + torch.randn(n_max - 1, vocab, generator=gen)
    plain_s, draft_s, small, large = _medians_s(
        [plain, draft_token, _spec_pass(logits[:2], full_draft[:1], sampling, rule, gen),
         _spec_pass(logits, full_draft, sampling, rule, gen)], repeats)
    per_row = max(0.0, (large - small) / (n_max - 2))
    fixed = max(0.0, small - 2 * per_row)
    return HostCosts(plain=plain_s, fixed=fixed, per_row=per_row, draft_token=draft_s)


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """A digest of the code that is timed: a faster transform or rule in a later version
    must not be priced with the old one's cached costs."""
    from nsd.rules import entry, lossy, sampling, verify

    digest = hashlib.sha256()
    for module in (sampling, verify, lossy, entry, sys.modules[__name__]):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


def host_costs_key(vocab: int, sampling: SamplingConfig, rule: RuleConfig, n_max: int,
                   draft_vocab: int | None) -> dict[str, Any]:
    """Everything the measurement depends on (the values of the knobs do not matter, only
    which filters run)."""
    from nsd.draftlen.machine import cpu_description

    return {
        "version": _VERSION, "code": _code_digest(), "cpu": cpu_description(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "vocab": vocab, "draft_vocab": draft_vocab,
        "n_max": max(n_max, 3), "greedy": sampling.greedy, "top_k": sampling.top_k > 0,
        "top_p": sampling.top_p < 1.0, "min_p": sampling.min_p > 0.0,
        "adjusts": sampling.adjusts_logits, "rule": rule.kind, "relaxes": rule.relaxes,
    }


def host_costs(vocab: int, sampling: SamplingConfig, rule: RuleConfig, n_max: int,
               draft_vocab: int | None = None, persist: bool = True) -> HostCosts:
    """:func:`measure_host_costs`, read from the calibration cache when this machine has
    measured it before (``persist=False``: always measured, never stored). Measured
    while other processes kept the cores busy, it is stored provisionally
    (:func:`nsd.draftlen.calibrate.measured_once`)."""
    from nsd.draftlen.calibrate import cache_path, measured_once

    key = host_costs_key(vocab, sampling, rule, n_max, draft_vocab)

    def read(cached: Any) -> HostCosts | None:
        try:
            return HostCosts(**cached)
        except (TypeError, ValueError):
            return None  # unreadable: measured again and overwritten

    if not persist:
        return measure_host_costs(vocab, sampling, rule, n_max, draft_vocab)
    costs, _ = measured_once(cache_path("host", key), key, read,
                              lambda: measure_host_costs(vocab, sampling, rule, n_max, draft_vocab).__dict__,
                              None, busy="nsd's own per-pass costs")
    return costs if isinstance(costs, HostCosts) else HostCosts(**costs)
