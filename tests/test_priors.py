"""Stored starting acceptance estimates for -k auto (nsd.draftlen.priors)."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from nsd.draftlen import priors
from nsd.decode import DecodeConfig
from nsd.engine import Engine
from nsd.errors import NSDError
from nsd.draftlen.priors import AcceptancePriors, priors_from_counts, stored_priors
from nsd.rules.verify import RuleConfig
from nsd.rules.sampling import SamplingConfig
from mock import CharTokenizer, MockLM


def test_priors_from_counts_per_source_with_fallbacks() -> None:
    counts = {"draft": [200, 180], "lookup:1": [100, 30], "lookup:2": [10, 9],
              "lookup:3": [40, 30], "lookup:4": [20, 20]}
    p = priors_from_counts(counts, "test")
    assert p.draft == 0.9
    # lookup:2 has too few tests: it takes lookup:1's value; 3 pools 3 and 4 (50 of 60).
    assert p.lookup == (0.3, 0.3, round(50 / 60, 3))
    assert p.for_lookup(1) == 0.3 and p.for_lookup(7) == p.lookup[-1]
    assert priors_from_counts({"draft": [5, 5]}, "few") is None
    # Never exactly 0 or 1: such a prior could not be moved by what a generation shows.
    clamped = priors_from_counts({"draft": [100, 100], "lookup:1": [100, 0]}, "edges")
    assert clamped.draft == 0.98 and clamped.lookup == (0.02, 0.02, 0.02)


def test_stored_priors_by_pair_and_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    table = {"pairs": {"big+small": {"nsd/greedy": {"draft": 0.9, "lookup": [0.3, 0.5, 0.7]}}}}
    hit = stored_priors("big", "small", "nsd", True, table)
    assert (hit.draft, hit.lookup) == (0.9, (0.3, 0.5, 0.7))
    for miss in (stored_priors("big", "small", "nsd", False, table),
                 stored_priors("big", "other", "nsd", True, table),
                 stored_priors("big", None, "nsd", True, table),
                 stored_priors("big", "small", "typical", True, table)):
        assert miss == AcceptancePriors()
    monkeypatch.setattr(priors, "_stored", lambda: table)
    assert stored_priors("big", "small", "nsd", True).draft == 0.9
    monkeypatch.setenv(priors.PRIORS_ENV, "default")
    assert stored_priors("big", "small", "nsd", True) == AcceptancePriors()
    monkeypatch.setenv(priors.PRIORS_ENV, "sotred")
    with pytest.raises(NSDError, match="NSD_ACCEPTANCE_PRIORS"):
        stored_priors("big", "small", "nsd", True)


def test_out_of_range_priors_are_refused() -> None:
    for bad in (0.0, 1.0, float("nan")):
        with pytest.raises(NSDError, match="strictly between"):
            AcceptancePriors(draft=bad)


def test_the_committed_priors_match_their_counts() -> None:
    """Each stored estimate is what its stored counts give (no hand-edited values), from
    enough tests, and was measured at the θ the file says."""
    path = resources.files("nsd").joinpath(priors.PRIORS_FILE)
    table = json.loads(path.read_text())
    assert table["command"] and table["measured"]
    entries = [(pair, setting, e) for pair, by in table["pairs"].items() for setting, e in by.items()]
    assert entries
    for pair, setting, entry in entries:
        again = priors_from_counts(entry["counts"], pair)
        assert again is not None and (again.draft, list(again.lookup)) == (entry["draft"], entry["lookup"])
        assert setting.split("/")[1] in ("greedy", "sampled") and entry["prompts"] >= 10


def test_engine_starts_from_the_priors_of_its_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    table = {"pairs": {"big+small": {"sd/greedy": {"draft": 0.85, "lookup": [0.25, 0.5, 0.75]}}}}
    monkeypatch.setattr(priors, "_stored", lambda: table)
    engine = Engine.from_backends(MockLM(seed=1), CharTokenizer(), MockLM(seed=2), proposer="hybrid")
    config = DecodeConfig(rule=RuleConfig("exact"), sampling=SamplingConfig(), auto_k=True, k_max=4)
    assert engine.acceptance_priors(config) == AcceptancePriors()  # backends: no names
    engine.model_names = ("big", "small")
    policy = engine.k_policy(config)
    assert policy.tracker.prior == 0.85 and policy._lookup(2).prior == 0.5
    sampled = DecodeConfig(rule=RuleConfig("exact"), sampling=SamplingConfig(temperature=0.8),
                           auto_k=True, k_max=4)
    assert engine.k_policy(sampled).tracker.prior == priors.DEFAULT_PRIOR  # not stored
