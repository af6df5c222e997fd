"""nsd's own per-pass work, priced for ``-k auto``: the fit, the cache, and the engine
handing it to the cost model. Timing-free: fake clocks and fixed costs."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from nsd.draftlen import host_costs as hc
from nsd.draftlen.calibrate import Calibration
from nsd.engine import Engine
from nsd.generation import GenerationConfig
from nsd.rules.sampling import SamplingConfig
from nsd.rules.verify import RuleConfig
from mock import CharTokenizer, MockLM


def test_apply_adds_a_plain_steps_work_to_c1_and_a_passes_to_each_verification() -> None:
    host = hc.HostCosts(plain=0.001, fixed=0.002, per_row=0.0005, draft_token=0.0003)
    costs = host.apply((0.030, 0.040, 0.045), draft=0.010)
    assert costs.target == pytest.approx((0.031, 0.043, 0.0485))
    assert costs.draft == pytest.approx(0.0103)
    # Prompt lookup transforms nothing per proposed token.
    assert host.apply((0.030, 0.040), draft=0.0, draft_model=False).draft == 0.0
    with pytest.raises(ValueError, match="per_row"):
        hc.HostCosts(plain=0.0, fixed=0.0, per_row=-1.0, draft_token=0.0)


def test_the_fit_recovers_fixed_and_per_row_work(monkeypatch) -> None:
    # Every spec pass of n rows 'costs' 1 ms + 0.25 ms per row on a fake clock; a plain
    # step 0.3 ms, a draft token 0.2 ms. The round-robin medians and the two-point fit
    # must give exactly those back.
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(hc.time, "perf_counter", lambda: clock.now)

    def spend(seconds):
        def run():
            clock.now += seconds
        return run

    monkeypatch.setattr(hc, "_spec_pass", lambda logits, *rest: spend(0.001 + 0.00025 * logits.shape[0]))
    monkeypatch.setattr(hc, "logits_to_probs", lambda *a, **k: spend(0.0)())
    monkeypatch.setattr(hc, "adjust_logits", lambda row, *a: (spend(0.0003)(), row)[1])
    got = hc.measure_host_costs(64, SamplingConfig(), RuleConfig(), n_max=9, repeats=3)
    assert got.fixed == pytest.approx(0.001) and got.per_row == pytest.approx(0.00025)
    assert got.plain == pytest.approx(0.0003) and got.draft_token == pytest.approx(0.0003)


def test_real_measurement_is_positive_and_cheap_on_a_small_vocabulary() -> None:
    got = hc.measure_host_costs(2000, SamplingConfig(temperature=0.8, top_p=0.9),
                                RuleConfig(kind="nucleus", theta=0.9), n_max=5, repeats=3,
                                draft_vocab=500)
    assert 0 < got.plain < 0.1 and 0 < got.draft_token < 0.1
    assert got.pass_cost(5) > 0


@pytest.fixture
def counted(monkeypatch, tmp_path: Path):
    busy = {"flag": False}

    @contextlib.contextmanager
    def measure():
        yield SimpleNamespace(sample=SimpleNamespace(flagged=busy["flag"], other_cpu=0.9))

    calls = []

    def fake(vocab, sampling, rule, n_max, draft_vocab=None, repeats=hc.REPEATS):
        calls.append((vocab, sampling.greedy, rule.kind))
        return hc.HostCosts(0.001, 0.002, 0.0001 * len(calls), 0.0)

    monkeypatch.setattr("nsd.draftlen.cpu_load.LoadMonitor", lambda: SimpleNamespace(measure=measure))
    monkeypatch.setattr("nsd.cache_dir.cache_dir", lambda: tmp_path)
    monkeypatch.setattr(hc, "measure_host_costs", fake)
    return SimpleNamespace(calls=calls, busy=busy, dir=tmp_path)


def test_host_costs_are_cached_per_configuration_and_provisionally_when_busy(counted) -> None:
    greedy, sampled, rule = SamplingConfig(), SamplingConfig(temperature=0.7, top_p=0.9), RuleConfig()
    counted.busy["flag"] = True
    provisional = hc.host_costs(100, greedy, rule, 5)
    # Busy again: measured again and discarded; the provisional costs serve.
    assert hc.host_costs(100, greedy, rule, 5) == provisional and len(counted.calls) == 2
    counted.busy["flag"] = False
    first = hc.host_costs(100, greedy, rule, 5)  # idle: replaces them
    assert first != provisional and len(counted.calls) == 3
    assert hc.host_costs(100, greedy, rule, 5) == first and len(counted.calls) == 3  # read back
    # Another temperature with the same filters on is the same measurement ...
    hc.host_costs(100, SamplingConfig(temperature=0.3, top_p=0.5), rule, 5)
    assert len(counted.calls) == 4
    assert hc.host_costs(100, sampled, rule, 5) == hc.host_costs(100, SamplingConfig(temperature=0.3, top_p=0.5), rule, 5)
    # ... another rule or vocabulary is not; persist=False always measures and never stores.
    hc.host_costs(100, greedy, RuleConfig(kind="nucleus", theta=0.9), 5)
    hc.host_costs(200, greedy, rule, 5, persist=False)
    assert len(counted.calls) == 6
    assert len(list(counted.dir.glob("calibration/host-*.json"))) == 3


def test_the_engine_prices_host_work_into_the_auto_k_policy(counted) -> None:
    engine = Engine.from_backends(MockLM(seed=2), CharTokenizer(), MockLM(seed=3), eos_token_ids=())
    engine.target_model.calibration = Calibration((0.030, 0.040, 0.045, 0.050, 0.055), {}, False)
    engine.draft_model.calibration = Calibration((0.004,), {}, False)
    config = GenerationConfig(method="nsd", theta=0.9, max_new_tokens=8, k_max=4).decode_config()
    policy = engine.k_policy(config)
    # From a model not loaded from a file: measured once per engine, never stored.
    assert counted.calls and not list(counted.dir.glob("calibration/host-*.json"))
    assert policy.costs.target == pytest.approx((0.031, 0.0422, 0.0473, 0.0524, 0.0575))
    assert policy.costs.draft == pytest.approx(0.004)
    engine.k_policy(config)
    assert len(counted.calls) == 1  # the same configuration: measured once per engine


def test_a_target_on_an_accelerator_gets_no_cpu_host_costs(counted) -> None:
    # Its transform and rule run on the accelerator: CPU timings would only mislead.
    target = MockLM(seed=2)
    target.device = "cuda:0"
    engine = Engine.from_backends(target, CharTokenizer(), MockLM(seed=3), eos_token_ids=())
    engine.target_model.calibration = Calibration((0.030, 0.040, 0.045), {}, False)
    engine.draft_model.calibration = Calibration((0.004,), {}, False)
    policy = engine.k_policy(GenerationConfig(method="sd", max_new_tokens=8, k_max=2).decode_config())
    assert not counted.calls
    assert policy.costs.target == pytest.approx((0.030, 0.040, 0.045))
