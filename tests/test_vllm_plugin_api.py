"""The plugin's public configuration functions, without vLLM: ``set_rule`` replaces the
active rule and keeps the report settings; without NSD configured it refuses."""

from __future__ import annotations

import pytest

from nsd.errors import NSDError
from nsd.integrations.vllm import plugin
from nsd.integrations.vllm.config import NSDVllmConfig
from nsd.rules.verify import RuleConfig


def test_set_rule_replaces_the_rule_only(monkeypatch) -> None:
    base = NSDVllmConfig(rule=RuleConfig(kind="nucleus", theta=0.9), report="r.jsonl", log_requests=False)
    monkeypatch.setattr(plugin.ACTIVE, "config", base)
    new = plugin.set_rule(RuleConfig(kind="exact"))
    assert plugin.active_config() is new
    assert new.rule == RuleConfig(kind="exact")
    assert (new.report, new.log_requests) == ("r.jsonl", False)
    assert plugin.set_rule(RuleConfig(kind="nucleus", theta=0.5, budget=1.0)).rule.budget == 1.0


def test_set_rule_needs_nsd_configured(monkeypatch) -> None:
    monkeypatch.setattr(plugin.ACTIVE, "config", None)
    assert plugin.active_config() is None
    with pytest.raises(NSDError, match="NSD is not configured"):
        plugin.set_rule(RuleConfig(kind="exact"))
    monkeypatch.setattr(plugin.ACTIVE, "config", NSDVllmConfig(rule=RuleConfig(kind="exact")))
    with pytest.raises(NSDError, match="needs a RuleConfig"):
        plugin.set_rule({"kind": "exact"})
