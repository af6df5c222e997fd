"""Reading and checking the ``nsd`` section of vLLM's ``--additional-config``.

``--additional-config '{"nsd": {"method": "nsd", "theta": 0.9, "budget": 2.0}}'`` turns
NSD on; without an ``nsd`` key the plugin leaves vLLM's stock sampler alone. The
environment variable ``NSD_VLLM_CONFIG`` (the same JSON object) is a fallback for
launchers that cannot pass ``--additional-config``.

The keys are the options of :mod:`nsd.options`, spelled as there and as in the server's
``nsd`` object (``method``, ``theta``, ``budget``, ``cap``, ``smooth``, ``typical_epsilon``,
``typical_delta``, ``relaxed_topk``, ``relaxed_delta``, ``threshold_single``,
``threshold_acc``: :data:`nsd.options.RULE`), with the same defaults and ranges; ``method``
is ``nsd``, ``sd``, ``typical`` or one of the engines' per-position rules ``topk_delta``
(TensorRT-LLM's: it relaxes greedy requests; sampled ones are verified exactly, as Modular
MAX's sampled verdict replaces the residual draw, which this per-position verifier does not
host) and ``threshold`` (SGLang's: it relaxes sampled requests; greedy ones are argmax
matching). vLLM itself decides whether to speculate. ``fly`` is refused at start-up: its
deferral needs the whole block's native decisions before any position's verdict (vLLM runs
FLy natively: ``rejection_sample_method: "fly"`` without the ``nsd`` section). The
spellings of earlier releases (``rule``: nucleus/exact/typical, ``epsilon``, ``delta``)
are still read.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from nsd import options as optspec
from nsd.errors import NSDError
from nsd.rules.verify import RuleConfig

ENV_VAR = "NSD_VLLM_CONFIG"
# The sampler internals the plugin replaces were read from these releases (0.32 and 0.33:
# the V1 rejection sampler, Model Runner V2's verifier, the runner and scheduler hooks).
SUPPORTED_VLLM = ((0, 32, 0), (0, 34, 0))  # [min, max)
SUPPORTED_TEXT = ">=0.32.0,<0.34"
V2_SWITCH = "VLLM_USE_V2_MODEL_RUNNER=0"  # what selects the V1 model runner
# FLy's knobs are known keys too: the method itself is refused, by name.
_KEYS = {*optspec.RULE, "report", "log_requests"}
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
        raise NSDError("'nsd.method' must be nsd, sd, typical, topk_delta or threshold (vLLM decides "
                       "whether to speculate)")
    if method == "fly":
        raise NSDError("'nsd.method' fly: the plugin verifies position by position and cannot "
                       "host FLy (a deferral needs the whole block's native decisions); use "
                       "vLLM's own rejection_sample_method 'fly' without the 'nsd' section")
    knobs = {}
    for key in optspec.RULE:
        if key == "method":
            continue
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


def check_engine(vllm_config: Any, runner: str, v2_patched: bool = True) -> None:
    """Refuse, with one line naming the setting to change, an engine NSD would not verify.

    ``runner`` is ``"v1"`` or ``"v2"`` (vLLM's Model Runner V2); ``v2_patched`` says
    whether the plugin replaced V2's verifier in this process. Settings that swap vLLM's
    standard verification for another one (synthetic acceptance, block verification,
    FLy) would leave NSD configured and not applied, so they are refused too.
    """
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "rejection_sample_method", "standard") if spec is not None else "standard"
    if method != "standard":
        raise NSDError(f"NSD replaces vLLM's standard verification, but the speculative config "
                       f"sets rejection_sample_method={method!r}; set it to 'standard' or remove "
                       "the 'nsd' configuration")
    if runner != "v2":
        return
    if not v2_patched:
        raise NSDError("NSD could not be installed in vLLM's Model Runner V2 here; set "
                       f"{V2_SWITCH} to verify with NSD on the V1 model runner")
    if getattr(vllm_config, "watermark_config", None) is not None:
        raise NSDError("NSD does not verify watermarked generation (Model Runner V2 "
                       "watermarking); remove the watermark configuration or the 'nsd' one")
    if spec is not None and getattr(spec, "enable_adaptive_verification", False):
        raise NSDError("NSD does not support vLLM's adaptive draft verification; set "
                       "enable_adaptive_verification to false in the speculative config")
