"""The engines' lossy rules (topk_delta, threshold, fly) from every front end: the CLI's
flags and a mock-model run per rule, ``nsd compare``, ``nsd bench``'s method grid and knob
sweeps, the server's ``nsd`` object, and the vLLM section's acceptance and refusal."""

from __future__ import annotations

import json
import math
import re

import httpx
import torch
import pytest

import nsd.cli
from mock import CharTokenizer, MockLM
from nsd import options as optspec
from nsd.api import Engine, GenerationConfig
from nsd.bench.methods import expand_methods
from nsd.cli import build_parser, main
from nsd.errors import NSDError
from nsd.integrations.vllm.config import build_config
from nsd.serve import ServerConfig
from serve_support import mock_engine, running_server

# Each rule with knob values that relax, and a temperature it is defined at.
RUNS = {
    "topk_delta": (["--relaxed-topk", "4", "--relaxed-delta", "0.5"], "0"),
    "threshold": (["--threshold-single", "0.3", "--threshold-acc", "0.6"], "1.0"),
    "fly": (["--fly-window-size", "1", "--fly-entropy-threshold", "0.2"], "0"),
}


def _mock_engine() -> Engine:
    return Engine.from_backends(MockLM(vocab_size=24, seed=1, sharpness=1.2), CharTokenizer(),
                                draft=MockLM(vocab_size=24, seed=2, sharpness=1.2), proposer="draft")


def test_generate_parses_every_rules_knobs_into_its_config() -> None:
    args = build_parser().parse_args(["generate", "--target", "t", "--prompt", "x", "--method", "topk_delta",
                                      "--relaxed-topk", "10", "--relaxed-delta", "0.6"])
    config = GenerationConfig.from_mapping(vars(args))
    rule = config.rule()
    assert (rule.kind, rule.relaxed_topk, rule.relaxed_delta) == ("topk_delta", 10, 0.6)
    args = build_parser().parse_args(["generate", "--target", "t", "--prompt", "x", "--method", "fly",
                                      "--fly-entropy-threshold", "0.5", "--fly-window-size", "2"])
    rule = GenerationConfig.from_mapping(vars(args)).rule()
    assert (rule.kind, rule.fly_entropy_threshold, rule.fly_window_size) == ("fly", 0.5, 2)


@pytest.mark.parametrize("argv,message", [
    (["--method", "topk_delta", "--relaxed-topk", "0"], "--relaxed-topk must be a whole number >= 1"),
    (["--method", "threshold", "--threshold-acc", "0"], "--threshold-acc must be"),
    (["--method", "threshold", "--threshold-acc", "0.5"], "threshold: .*temperature > 0"),
    (["--method", "fly", "--fly-entropy-threshold", "-1"], "--fly-entropy-threshold must be"),
])
def test_generate_refuses_bad_knobs_in_one_line(argv, message, capsys) -> None:
    assert main(["generate", "--target", "t", "--prompt", "abc", *argv]) == 2  # before any model loads
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err) and "Traceback" not in err


@pytest.mark.parametrize("method", list(RUNS))
def test_generate_runs_each_rule_on_the_mock(method, monkeypatch, capsys) -> None:
    flags, temperature = RUNS[method]
    engine = _mock_engine()
    monkeypatch.setattr(nsd.cli, "make_engine", lambda args, needs_proposer=True: engine)
    assert main(["generate", "--target", "t", "--prompt", "abcabc", "--method", method, "-k", "3",
                 "--temperature", temperature, "--max-new-tokens", "24", "--json", *flags]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["method"] == method and stats["effective_method"] == method
    assert stats["new_tokens"] == 24 and stats["drafted_tokens"] > 0
    assert stats["deviation"] >= 0 and stats.get("deviation_is") == ("bound" if method == "fly" else None)
    # The report names the swept knobs of the rule that ran, and only those.
    assert set(optspec.SWEEP_KNOBS[method]) <= set(stats) and "theta" not in stats


def test_generate_text_summary_labels_flys_d_a_bound(monkeypatch, capsys) -> None:
    engine = _mock_engine()
    monkeypatch.setattr(nsd.cli, "make_engine", lambda args, needs_proposer=True: engine)
    assert main(["generate", "--target", "t", "--prompt", "abcabc", "--method", "fly", "-k", "3",
                 "--max-new-tokens", "12", *RUNS["fly"][0]]) == 0
    assert "| D ≤ " in capsys.readouterr().err


def test_compare_runs_the_rules_side_by_side(monkeypatch, capsys) -> None:
    engine = _mock_engine()
    monkeypatch.setattr(nsd.cli, "make_engine", lambda args, needs_proposer=True: engine)
    assert main(["compare", "--target", "t", "--methods", "ar,sd,topk_delta,fly", "--prompt", "abcabc",
                 "-k", "3", "--max-new-tokens", "8", "--no-warmup", "--relaxed-topk", "4",
                 "--fly-window-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "| topk_delta |" in out and "| fly |" in out and "| ≤ " in out


def test_bench_sweeps_each_rules_knobs_with_stable_labels() -> None:
    specs = expand_methods(["ar", "sd", "nsd", "topk_delta", "threshold", "fly"], [0.5, 0.9], [], ["draft"],
                           sweeps={"relaxed_delta": [0.2, 0.6], "threshold_single": [0.3, 0.7],
                                   "fly_entropy_threshold": [0.1, 0.5]})
    labels = [s.label for s in specs]
    assert labels == ["ar", "sd/draft", "nsd@0.5/draft", "nsd@0.9/draft",
                      "topk_delta@K10,d0.2/draft", "topk_delta@K10,d0.6/draft",
                      "threshold@s0.3,a1/draft", "threshold@s0.7,a1/draft",
                      "fly@h0.1/draft", "fly@h0.5/draft"]
    base = GenerationConfig(method="ar")
    config = specs[5].generation_config(base)
    assert (config.method, config.relaxed_topk, config.relaxed_delta) == ("topk_delta", 10, 0.6)
    assert specs[-1].generation_config(base).fly_entropy_threshold == 0.5
    both = expand_methods(["topk_delta"], [], [], ["ngram"], sweeps={"relaxed_topk": [2, 4], "relaxed_delta": [0.3]})
    assert [s.label for s in both] == ["topk_delta@K2,d0.3/ngram", "topk_delta@K4,d0.3/ngram"]


def test_bench_refuses_a_sweep_without_its_rule_and_bad_values() -> None:
    with pytest.raises(NSDError, match="--fly-entropy-threshold is used only by the fly method"):
        expand_methods(["ar", "nsd"], [0.9], [], ["draft"], sweeps={"fly_entropy_threshold": [0.3]})
    with pytest.raises(NSDError, match="--relaxed-delta must be a number in"):
        expand_methods(["topk_delta"], [], [], ["draft"], sweeps={"relaxed_delta": [1.5]})


def test_bench_parses_the_sweep_flags_as_lists() -> None:
    args = build_parser().parse_args(["bench", "--methods", "ar,fly,threshold", "--fly-entropy-threshold",
                                      "0.1,0.3,0.6,1", "--threshold-single", "0.5,0.9"])
    assert args.fly_entropy_threshold == [0.1, 0.3, 0.6, 1.0] and args.threshold_single == [0.5, 0.9]
    assert args.relaxed_topk == [] and args.fly_window_size == optspec.default("fly_window_size")


@pytest.fixture(scope="module")
def server():
    defaults = GenerationConfig(method="nsd", max_new_tokens=12, k=3)
    with running_server(mock_engine(n_ctx=128), ServerConfig(model_name="mock", defaults=defaults)) as (url, _):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


@pytest.mark.parametrize("nsd_object,temperature", [
    ({"method": "topk_delta", "relaxed_topk": 4, "relaxed_delta": 0.5}, 0.0),
    ({"method": "topk_delta", "relaxed_delta": 0.5}, 1.0),
    ({"method": "threshold", "threshold_single": 0.3, "threshold_acc": 0.6}, 1.0),
    ({"method": "fly", "fly_window_size": 1, "fly_entropy_threshold": 0.2}, 0.0),
])
def test_server_runs_each_rule(server, nsd_object, temperature) -> None:
    r = server.post("/v1/completions", json={"model": "mock", "prompt": "abcabc", "max_tokens": 8,
                                             "temperature": temperature, "nsd": nsd_object})
    assert r.status_code == 200, r.text
    stats = r.json()["usage"]["nsd"]
    assert stats["method"] == nsd_object["method"] and stats["new_tokens"] == 8
    for name in optspec.SWEEP_KNOBS[nsd_object["method"]]:
        assert stats[name] == nsd_object.get(name, optspec.default(name))


@pytest.mark.parametrize("nsd_object,param", [
    ({"method": "nsd", "relaxed_topk": 4}, "nsd.relaxed_topk"),  # acts on topk_delta only
    ({"method": "fly", "theta": 0.5}, "nsd.theta"),
    ({"method": "fly", "smooth": True}, "nsd.smooth"),
    ({"method": "topk_delta", "relaxed_delta": 2.0}, "nsd.relaxed_delta"),
    ({"method": "threshold", "threshold_acc": 0.5}, None),  # greedy: the rule is named
])
def test_server_refuses_knobs_a_rule_does_not_use(server, nsd_object, param) -> None:
    r = server.post("/v1/completions", json={"model": "mock", "prompt": "ab", "nsd": nsd_object})
    assert r.status_code == 400
    error = r.json()["error"]
    if param is not None:
        assert error["param"] == param
    else:
        assert error["message"].startswith("threshold: ")


def test_vllm_section_hosts_the_per_position_rules_and_refuses_fly() -> None:
    config = build_config({"method": "topk_delta", "relaxed_topk": 4, "relaxed_delta": 0.5})
    assert (config.rule.kind, config.rule.relaxed_topk, config.rule.relaxed_delta) == ("topk_delta", 4, 0.5)
    config = build_config({"method": "threshold", "threshold_single": 0.5, "budget": 3})
    assert config.rule.kind == "threshold" and config.rule.relaxes and config.rule.budget == 3.0
    with pytest.raises(NSDError, match="^'nsd.method' fly: the plugin .*cannot host FLy"):
        build_config({"method": "fly", "fly_entropy_threshold": 0.3})
    with pytest.raises(NSDError, match="'nsd.relaxed_delta must be"):
        build_config({"method": "topk_delta", "relaxed_delta": -1})
    assert not build_config({"method": "threshold"}).rule.relaxes  # SGLang's defaults: exact
    assert math.isinf(build_config({"method": "topk_delta"}).rule.budget)


def _ragged(rule, probs, argmax, drafts, greedy, uniforms, spent, recovered=None):
    from nsd.rules.ragged import verify_ragged

    batch, k, vocab = probs.shape[0], drafts.shape[1], probs.shape[-1]
    return verify_ragged(rule, probs[:, :k].reshape(-1, vocab), argmax[:, :k].reshape(-1),
                         drafts.reshape(-1).to(torch.int32), torch.full((batch,), k).cumsum(0).to(torch.int32),
                         k, None, argmax[:, k], greedy, uniforms.reshape(-1), recovered, spent)


@pytest.mark.parametrize("budget", [math.inf, 1.5])
def test_vllm_path_decides_as_the_local_rule(budget) -> None:
    # The plugin's ragged verifier and the local decoder share nsd.rules.lossy.set_stats: on the
    # same inputs they accept, relax and charge alike (greedy topk_delta, sampled threshold).
    from nsd.rules.entry import verify
    from nsd.rules.verify import RuleConfig

    gen = torch.Generator().manual_seed(41)
    batch, k, vocab = 300, 4, 12
    logits = 1.5 * torch.randn(batch, k + 1, vocab, generator=gen)
    plaus = torch.softmax(logits, dim=-1)
    argmax = logits.argmax(dim=-1)
    top3 = logits[:, :k].topk(3, dim=-1).indices
    drafts = top3.gather(-1, torch.randint(0, 3, (batch, k, 1), generator=gen)).squeeze(-1)
    spent = torch.rand(batch, generator=gen, dtype=torch.float64)
    uniforms = torch.rand(batch, k, generator=gen, dtype=torch.float64)
    sample_u = torch.rand(batch, generator=gen, dtype=torch.float64)
    cases = [(RuleConfig("topk_delta", relaxed_topk=3, relaxed_delta=0.5, budget=budget), True),
             (RuleConfig("threshold", threshold_single=0.4, threshold_acc=0.7, budget=budget), False)]
    for rule, greedy in cases:
        target = torch.nn.functional.one_hot(argmax, vocab).float() if greedy else plaus
        local = verify(rule, target, plaus[:, :k], drafts, None, uniforms, sample_u, spent, greedy=greedy)
        ragged = _ragged(rule, plaus, argmax, drafts, torch.full((batch,), greedy), uniforms, spent,
                         None if greedy else torch.zeros(batch * k, dtype=torch.long))
        assert torch.equal(local.num_accepted, ragged.num_accepted), rule.kind
        assert torch.equal(local.relaxed, ragged.relaxed) and int(local.relaxed.sum()) > 20
        assert torch.equal(local.deviation, ragged.deviation) and torch.equal(local.spent, ragged.spent)
        assert torch.all(ragged.spent <= budget)
        # The other kind of row is verified exactly: no relaxation, no deviation.
        other = _ragged(rule, plaus, argmax, drafts, torch.full((batch,), not greedy), uniforms, spent,
                        None if not greedy else torch.zeros(batch * k, dtype=torch.long))
        assert not other.relaxed.any() and not other.deviation.any()
