"""Reading and checking the ``nsd`` section of vLLM's ``--additional-config``.

``--additional-config '{"nsd": {"rule": "nucleus", "theta": 0.9, "budget": 2.0}}'`` turns
NSD on; without an ``nsd`` key the plugin leaves vLLM's stock sampler alone. The
environment variable ``NSD_VLLM_CONFIG`` (the same JSON object) is a fallback for
launchers that cannot pass ``--additional-config``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from nsd.errors import NSDError
from nsd.verify import RuleConfig

ENV_VAR = "NSD_VLLM_CONFIG"
# The sampler internals the plugin replaces were read from this release line only.
SUPPORTED_VLLM = ((0, 32, 0), (0, 33, 0))  # [min, max)
SUPPORTED_TEXT = ">=0.32.0,<0.33"
_KEYS = {"rule", "theta", "budget", "cap", "smooth", "epsilon", "delta", "report", "log_requests"}


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
    """Validate the section; every problem is one clear NSDError."""
    unknown = set(section) - _KEYS
    if unknown:
        raise NSDError(f"unknown 'nsd' setting(s) {sorted(unknown)}; known: {sorted(_KEYS)}")
    kind = {"nucleus": "nucleus", "nsd": "nucleus", "typical": "typical", "exact": "exact",
            "sd": "exact"}.get(str(section.get("rule", "nucleus")))
    if kind is None:
        raise NSDError(f"unknown NSD rule {section.get('rule')!r}; use nucleus, typical or exact")

    def number(key: str, default: float) -> float:
        value = section.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise NSDError(f"'nsd.{key}' must be a number, got {value!r}")
        return float(value)

    rule = RuleConfig(kind=kind, theta=number("theta", 0.9 if kind == "nucleus" else 0.0),
                      budget=number("budget", math.inf), cap=number("cap", math.inf),
                      smooth=bool(section.get("smooth", False)),
                      epsilon=number("epsilon", RuleConfig.epsilon),
                      typical_delta=number("delta", RuleConfig.typical_delta))
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
