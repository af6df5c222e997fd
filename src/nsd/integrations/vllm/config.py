"""Reading and checking the ``nsd`` section of vLLM's ``--additional-config``.

``--additional-config '{"nsd": {"method": "nsd", "theta": 0.9, "budget": 2.0}}'`` turns
NSD on; without an ``nsd`` key the plugin leaves vLLM's stock sampler alone. The
environment variable ``NSD_VLLM_CONFIG`` (the same JSON object) is a fallback for
launchers that cannot pass ``--additional-config``.

The keys are the options of :mod:`nsd.options`, spelled as there and as in the server's
``nsd`` object (``method``, ``theta``, ``budget``, ``cap``, ``smooth``, ``typical_epsilon``,
``typical_delta``), with the same defaults and ranges; ``method`` is ``nsd``, ``sd`` or
``typical`` (vLLM itself decides whether to speculate). The spellings of earlier releases
(``rule``: nucleus/exact/typical, ``epsilon``, ``delta``) are still read.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from nsd import options as optspec
from nsd.errors import NSDError
from nsd.verify import RuleConfig

ENV_VAR = "NSD_VLLM_CONFIG"
# The sampler internals the plugin replaces were read from this release line only.
SUPPORTED_VLLM = ((0, 32, 0), (0, 33, 0))  # [min, max)
SUPPORTED_TEXT = ">=0.32.0,<0.33"
_RULE_KEYS = ("method", "theta", "budget", "cap", "smooth", "typical_epsilon", "typical_delta")
_KEYS = {*_RULE_KEYS, "report", "log_requests"}
# Earlier spellings -> the option they name (and, for ``rule``, its values -> methods).
_LEGACY = {"rule": "method", "epsilon": "typical_epsilon", "delta": "typical_delta"}
_LEGACY_RULES = {"nucleus": "nsd", "exact": "sd", "nsd": "nsd", "sd": "sd", "typical": "typical"}


@dataclass(frozen=True)
class NSDVllmConfig:
    """The rule, plus where per-request fidelity reports go."""

    rule: RuleConfig
    report: str | None = None  # JSONL file: one line per finished request
    log_requests: bool = True  # one log line per finished request


def parse_version(text: str) -> tuple[int, int, int]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) or "0"
        parts.append(int(digits))
    return tuple((parts + [0, 0, 0])[:3])  # type: ignore[return-value]


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM release whose sampler internals the plugin was not written for."""
    low, high = SUPPORTED_VLLM
    if not (low <= parse_version(version) < high):
        raise NSDError(f"nsd's vLLM plugin supports vllm{SUPPORTED_TEXT}, found vllm {version}; "
                       "install a supported vLLM or remove the 'nsd' configuration")


def raw_config(additional_config: Any) -> Mapping[str, Any] | None:
    """The ``nsd`` section from vLLM's additional config, else from the environment."""
    section = None
    if isinstance(additional_config, Mapping):
        section = additional_config.get("nsd")
    if section is None and os.environ.get(ENV_VAR):
        try:
            section = json.loads(os.environ[ENV_VAR])
        except json.JSONDecodeError as err:
            raise NSDError(f"{ENV_VAR} is not valid JSON: {err}") from None
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise NSDError(f"the 'nsd' configuration must be a JSON object, got {section!r}")
    return section


def build_config(section: Mapping[str, Any]) -> NSDVllmConfig:
    """Validate the section against the option specs; every problem is one clear NSDError."""
    section = dict(section)
    for old, new in _LEGACY.items():
        if old in section:
            if new in section:
                raise NSDError(f"'nsd.{old}' is the old spelling of 'nsd.{new}': give one of them")
            value = section.pop(old)
            if old == "rule":
                if value not in _LEGACY_RULES:
                    raise NSDError(f"unknown NSD rule {value!r}; use nucleus, typical or exact")
                value = _LEGACY_RULES[value]
            section[new] = value
    unknown = set(section) - _KEYS
    if unknown:
        raise NSDError(f"unknown 'nsd' setting(s) {sorted(unknown)}; known: {sorted(_KEYS)}")
    method = section.get("method", optspec.default("method"))
    if method == "ar":
        raise NSDError("'nsd.method' must be nsd, sd or typical (vLLM decides whether to speculate)")
    knobs = {}
    for key in _RULE_KEYS[1:]:
        if section.get(key) is not None:
            try:
                knobs[key] = optspec.check(key, section[key])
            except NSDError as err:
                raise NSDError(f"'nsd.{err}") from None  # "'nsd.theta must be ..."
    try:
        rule = RuleConfig.for_method(method, theta=knobs.pop("theta", optspec.default("theta")), **knobs)
    except NSDError as err:
        raise NSDError(f"'nsd.{err}") from None
    report = section.get("report")
    if report is not None and not isinstance(report, str):
        raise NSDError(f"'nsd.report' must be a file path, got {report!r}")
    return NSDVllmConfig(rule=rule, report=report, log_requests=bool(section.get("log_requests", True)))


def config_from_vllm(additional_config: Any, vllm_version: str) -> NSDVllmConfig | None:
    """None when NSD is not asked for; else the checked configuration (or NSDError)."""
    section = raw_config(additional_config)
    if section is None:
        return None
    check_vllm_version(vllm_version)
    return build_config(section)
