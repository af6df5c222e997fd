"""Starting acceptance estimates for ``-k auto``, per proposer, measured on held-out prompts.

The draft-length policy (:class:`nsd.draftlen.costmodel.CostModelK`) learns each proposer's
acceptance online within a generation, starting from a prior. With one prior for every
source, prompt lookup and the draft model started level at 0.6 per position, although on
the same models the draft model is accepted far more often than a copy after a one-token
match; in answers of a few dozen tokens the estimates had not separated before the answer
ended, and lookup blocks displaced draft-model blocks that would have been accepted
whole (HumanEval, BENCHMARKS.md).

So each model pair may have stored estimates, made from the acceptance counts of
:class:`nsd.decode.DecodeStats` on calibration prompts that are not a benchmark
(``benchmarks/acceptance_priors.py`` writes ``acceptance_priors.json`` beside this
module, with the command and the machine it came from). They are kept per rule family
(``sd``, ``nsd``) and per greedy or sampled decoding, which change acceptance most; a
setting or pair with no stored entry starts from :data:`DEFAULT_PRIOR` everywhere, as
before. A prior only starts the estimate: two pseudo-counts, overtaken by what the
generation shows within a few blocks.

``NSD_ACCEPTANCE_PRIORS=default`` ignores the stored values; the calibration itself runs
so, so that what it measures does not depend on the estimates it is about to replace.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping

from nsd.errors import NSDError

DEFAULT_PRIOR = 0.6
PRIORS_FILE = "acceptance_priors.json"
PRIORS_ENV = "NSD_ACCEPTANCE_PRIORS"
# An estimate is stored only from at least this many tests (a position whose test ran):
# with fewer, a Beta posterior's spread is over ±0.1 and the default serves as well.
MIN_TESTS = 30


@dataclass(frozen=True)
class AcceptancePriors:
    """Per-position acceptance a generation starts from: ``draft`` for the draft model
    (or the only proposer), ``lookup[m − 1]`` for prompt lookup after an ``m``-token match
    (the last entry serves longer matches; empty: ``draft``'s value)."""

    draft: float = DEFAULT_PRIOR
    lookup: tuple[float, ...] = ()
    source: str = "default"  # where the values come from, for reports

    def __post_init__(self) -> None:
        for value in (self.draft, *self.lookup):
            if not (0.0 < value < 1.0 and math.isfinite(value)):
                raise NSDError(f"an acceptance prior must lie strictly between 0 and 1, got {value}")

    def for_lookup(self, match: int) -> float:
        if not self.lookup:
            return self.draft
        return self.lookup[min(max(match, 1), len(self.lookup)) - 1]


def pair_key(target: str | None, draft: str | None) -> str:
    """The stored pair a generation falls under: ``target+draft`` by registry names, or
    ``target+lookup`` with no draft model (prompt lookup alone)."""
    return f"{target}+{draft or 'lookup'}"


def setting_key(method: str, greedy: bool) -> str:
    """The stored setting a generation falls under: ``sd/greedy``, ``nsd/sampled``, ..."""
    return f"{method}/{'greedy' if greedy else 'sampled'}"


def priors_from_counts(counts: Mapping[str, tuple[int, int] | list[int]], source: str,
                       max_match: int = 3) -> AcceptancePriors | None:
    """Estimates from summed ``{"draft": [tests, accepts], "lookup:N": [...]}`` counts.

    A source with fewer than :data:`MIN_TESTS` tests takes its neighbour's value (a lookup
    match length the next shorter one's, the shortest the draft model's); None when the
    draft model itself has too few."""
    def rate(tests: int, accepts: int) -> float | None:
        if tests < MIN_TESTS:
            return None
        # Clamped away from 0 and 1: a prior of exactly 0 or 1 could never be moved.
        return min(max(accepts / tests, 0.02), 0.98)

    draft = rate(*counts.get("draft", (0, 0)))
    if draft is None:
        return None
    by_match = [[0, 0] for _ in range(max_match)]  # longer matches pooled into the last
    for key, (tests, accepts) in counts.items():
        if key.startswith("lookup:"):
            pooled = by_match[min(int(key[len("lookup:"):]), max_match) - 1]
            pooled[0] += tests
            pooled[1] += accepts
    lookup, previous = [], draft
    for tests, accepts in by_match:
        value = rate(tests, accepts)
        previous = previous if value is None else value
        lookup.append(previous)
    return AcceptancePriors(round(draft, 3), tuple(round(v, 3) for v in lookup), source)


@lru_cache(maxsize=1)
def _stored() -> dict[str, Any]:
    try:
        text = resources.files("nsd").joinpath(PRIORS_FILE).read_text()
    except FileNotFoundError:
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:  # a damaged file must not pass for "no priors"
        raise NSDError(f"the stored acceptance priors ({PRIORS_FILE}) are not valid JSON: {err}")


def lookup_measured(target: str | None, draft: str | None) -> bool:
    """Whether starting estimates of prompt lookup beside this draft model are stored (for
    any setting): the hybrid proposer is the default only for such pairs
    (:func:`nsd.options.default_proposer`). Registry names; a file given by path has none."""
    if target is None or draft is None:
        return False
    return bool(_stored().get("pairs", {}).get(pair_key(target, draft)))


def stored_priors(target: str | None, draft: str | None, method: str, greedy: bool,
                  table: Mapping[str, Any] | None = None) -> AcceptancePriors:
    """The stored estimates for this model pair and setting, else the default.

    ``target`` and ``draft`` are registry names (files given by path have none stored);
    with no draft model (prompt lookup alone) the pair is ``(target, None)``."""
    if table is None:
        choice = os.environ.get(PRIORS_ENV, "stored")
        if choice not in ("stored", "default"):
            raise NSDError(f"{PRIORS_ENV} must be 'stored' or 'default', got {choice!r}")
        table = _stored() if choice == "stored" else {}
    pair = pair_key(target, draft)
    entry = table.get("pairs", {}).get(pair, {}).get(setting_key(method, greedy))
    if entry is None:
        return AcceptancePriors()
    return AcceptancePriors(float(entry["draft"]), tuple(float(v) for v in entry["lookup"]),
                            f"{pair} {setting_key(method, greedy)}")
