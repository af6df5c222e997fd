"""One definition per option: every front end and config takes name, default and range
from nsd.options, so they cannot drift apart."""

from __future__ import annotations

import dataclasses
import math

import pytest

from nsd import options as optspec
from nsd.api import BackendOptions, GenerationConfig
from nsd.cli import build_parser
from nsd.errors import NSDError
from nsd.integrations.vllm.config import build_config
from nsd.rules.sampling import SamplingConfig
from nsd.rules.verify import RuleConfig


def _defaults(config_type: type) -> dict:
    out = {}
    for f in dataclasses.fields(config_type):
        out[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return out


def test_configs_are_exactly_the_options_with_their_defaults() -> None:
    generation = _defaults(GenerationConfig)
    for name in ("stop", "logit_bias", "logprobs"):  # request-level, not options
        generation.pop(name)
    assert generation == {n: o.default for n, o in {**optspec.DECODING, **optspec.DRAFT_LENGTH}.items()}
    assert _defaults(BackendOptions) == {n: o.default for n, o in optspec.BACKEND.items()}
    rule = _defaults(RuleConfig)
    for name in optspec.RULE:
        if name not in ("method", "theta"):  # the rule's kind; θ 0 unless nsd sets it
            assert rule[name] == optspec.default(name)
    assert set(rule) == {"kind", *optspec.RULE} - {"method"}


def test_rule_options_are_exactly_the_rule_configs_knobs_in_order() -> None:
    # RULE is derived from DECODING; RuleConfig and SamplingConfig declare their fields on
    # their own, so this holds only while the derivation splits rule from sampling right.
    knobs = tuple(f.name for f in dataclasses.fields(RuleConfig) if f.name != "kind")
    assert isinstance(optspec.RULE, tuple) and optspec.RULE == ("method", *knobs)
    sampling = {f.name for f in dataclasses.fields(SamplingConfig)} - {"logit_bias"}  # request-level
    assert set(optspec.DECODING) - set(optspec.RULE) == sampling | {"seed", "max_new_tokens"}


@pytest.mark.parametrize("command", ["generate", "compare", "serve", "bench"])
def test_every_cli_flag_defaults_to_its_option(command: str) -> None:
    argv = [command] + (["--target", "x"] if command != "bench" else [])
    args = vars(build_parser().parse_args(argv))
    list_valued = {"theta": [optspec.default("theta")], "budget": [],  # bench: one method each
                   **{n: [] for n in optspec.LOSSY_SWEEP_KNOBS}}  # swept; empty: the default
    bench_own = {"max_new_tokens"}  # bench generations are longer by default (documented)
    for name, option in optspec.ALL.items():
        if name == "method" and command in ("compare", "bench"):
            continue  # these take a list of methods
        assert name in args, f"nsd {command} has no {option.flag}"
        if command == "bench" and name in list_valued:
            assert args[name] == list_valued[name]
        elif not (command == "bench" and name in bench_own):
            assert args[name] == option.default, (command, name)
    for name, option in optspec.SERVING.items():  # the server's own options: serve alone
        assert (name in args) == (command == "serve"), (command, option.flag)
        if command == "serve":
            assert args[name] == option.default


@pytest.mark.parametrize("name, bad", [("theta", 1.5), ("theta", -0.1), ("budget", -1.0),
                                       ("top_p", 0.0), ("min_p", 1.0), ("k", 0), ("k", "four"),
                                       ("k_max", 0), ("temperature", math.inf), ("seed", 2 ** 70),
                                       ("method", "fast"), ("smooth", 1), ("top_k", 2.5)])
def test_every_front_end_refuses_the_same_values_with_the_same_words(name: str, bad) -> None:
    with pytest.raises(NSDError) as direct:
        optspec.check(name, bad)
    words = optspec.ALL[name].range_text()
    assert words in str(direct.value)
    with pytest.raises(NSDError, match=name):
        GenerationConfig(**{name: bad})
    if name in optspec.RULE and name != "method":
        with pytest.raises(NSDError) as vllm:
            build_config({name: bad})
        assert words in str(vllm.value) and f"'nsd.{name}" in str(vllm.value)


def test_values_inside_the_ranges_are_accepted_and_ints_widen_to_floats() -> None:
    config = GenerationConfig(theta=1, budget=2, temperature=0, k=5, seed=-(2 ** 63))
    assert isinstance(config.theta, float) and isinstance(config.budget, float)
    assert config.rule().theta == 1.0
    assert optspec.check("k", "auto") == "auto" and optspec.check("threads", None) is None


def test_vllm_section_takes_the_option_names_and_still_reads_the_old_ones() -> None:
    new = build_config({"method": "nsd", "theta": 0.8, "typical_epsilon": 0.2, "budget": 1})
    old = build_config({"rule": "nucleus", "theta": 0.8, "epsilon": 0.2, "budget": 1})
    assert new == old and new.rule.kind == "nucleus" and new.rule.budget == 1.0
    assert build_config({}).rule.theta == optspec.default("theta")
    assert build_config({"method": "sd"}).rule.kind == "exact"
    with pytest.raises(NSDError, match="old spelling"):
        build_config({"rule": "nucleus", "method": "nsd"})
    with pytest.raises(NSDError, match="vLLM decides"):
        build_config({"method": "ar"})


def test_server_nsd_object_has_exactly_the_rule_and_draft_length_options() -> None:
    from nsd.serve.protocol import ApiError, ChatRequest, NsdOptions, parse_request

    assert set(NsdOptions.model_fields) == {*optspec.RULE, *optspec.DRAFT_LENGTH}
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "nsd": {"theta": 2}}'
    with pytest.raises(ApiError) as err:
        parse_request(body, ChatRequest)
    assert err.value.param == "nsd.theta"
    assert optspec.ALL["theta"].range_text() in err.value.message
