"""``nsd compare`` on mock models: one row per method, shared metric definitions."""

from __future__ import annotations

import pytest

from mock import MockLM
from nsd.api import Engine, GenerationConfig
from nsd.bench.runner import WARMUP_TOKENS
from nsd.bench.compare import run_compare
from nsd.errors import NSDError
from nsd.options import default_proposer


class _Tok:
    def encode(self, text, **kw):
        return [ord(c) % 16 for c in text]

    def decode(self, ids, **kw):
        return "".join(chr(97 + i) for i in ids)


def test_compare_table_rows_and_tau() -> None:
    # Mock models instead of loading real weights.
    engine = Engine.from_backends(MockLM(seed=1), _Tok(), MockLM(seed=1), eos_token_ids=())
    configs = [GenerationConfig(method=m, max_new_tokens=20, k=4) for m in ("ar", "sd", "nsd")]
    text = run_compare(engine, ["abc", "hello"], configs)
    assert text.startswith("CPU: ")
    # Mock models have no stored prompt-lookup estimates: the draft model drafts alone.
    assert engine.proposer_kind == default_proposer(True, lookup_measured=False) == "draft"
    assert text.splitlines()[0].endswith("proposer: draft")
    table = [line for line in text.splitlines() if line.startswith("|")]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table[2:]}
    assert set(rows) == {"ar", "sd", "nsd"}
    # Columns: k, tokens, tok/s, tau, acceptance, D/token, vs AR, vs SD.
    assert rows["ar"][0] == "-" and rows["sd"][0] == "4"
    assert rows["ar"][1] == "40" and rows["ar"][3] == "1.00" and rows["ar"][6] == "1.00x"
    # Draft = target: every block of 4 drafts + bonus is accepted, 20 tokens in 4 passes.
    assert rows["sd"][3] == "5.00" and rows["sd"][4] == "1.00" and rows["sd"][7] == "1.00x"
    assert rows["nsd"][5] == "0.000"
    # -k auto: the column says so, with the mean k the cost model chose.
    auto = run_compare(engine, ["abc"], [GenerationConfig(method="sd", max_new_tokens=10)])
    assert "| sd | auto (mean " in auto


def test_a_generation_that_cannot_fit_the_context_is_refused_before_any_work() -> None:
    target = MockLM(seed=1)
    target.n_ctx = 32  # what the llama.cpp backend reports: the context asked for
    engine = Engine.from_backends(target, _Tok(), MockLM(seed=1), eos_token_ids=())
    prompt = engine.encode("abcdefghij")
    with pytest.raises(NSDError, match=r"the prompt has 10 tokens; with max_new_tokens 23 .* context of 32"):
        engine.generate(prompt, GenerationConfig(method="sd", k=4, max_new_tokens=23))
    assert target.num_cached == 0  # nothing was fed
    done = engine.generate(prompt, GenerationConfig(method="sd", k=4, max_new_tokens=22))
    assert done.stats.new_tokens == 22  # a generation that exactly fills the context is allowed


def _counting_engine() -> tuple[Engine, list[GenerationConfig]]:
    """A mock engine that records the config of every generate call."""
    engine = Engine.from_backends(MockLM(seed=1), _Tok(), MockLM(seed=1), eos_token_ids=())
    calls: list[GenerationConfig] = []
    generate = engine.generate

    def recording_generate(prompt, config=GenerationConfig(), chat=False):
        calls.append(config)
        return generate(prompt, config, chat)

    engine.generate = recording_generate
    return engine, calls


def test_compare_warms_every_method_up_untimed() -> None:
    # The first call of a process pays one-off costs (allocations, host-cost measurements
    # per verification rule): without a warm-up they land on whichever method runs first.
    engine, calls = _counting_engine()
    configs = [GenerationConfig(method=m, max_new_tokens=20, k=4) for m in ("ar", "sd", "nsd")]
    text = run_compare(engine, ["abc", "hello"], configs)
    warm, timed = calls[:3], calls[3:]
    assert [c.method for c in warm] == ["ar", "sd", "nsd"]
    assert all(c.max_new_tokens == WARMUP_TOKENS for c in warm)
    assert [c.max_new_tokens for c in timed] == [20] * 6
    # Which method goes first rotates by prompt, as in nsd bench.
    assert [c.method for c in timed] == ["ar", "sd", "nsd", "sd", "nsd", "ar"]
    # The warm-up's tokens are in no row: AR's 2 prompts x 20 tokens.
    rows = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in text.splitlines()
            if line.startswith("| ") and "method" not in line}
    assert rows["ar"] == "40"
    engine, calls = _counting_engine()
    run_compare(engine, ["abc"], configs, warmup=False)
    assert [c.max_new_tokens for c in calls] == [20] * 3


def test_compare_needs_a_method() -> None:
    engine, calls = _counting_engine()
    with pytest.raises(NSDError, match="no methods"):
        run_compare(engine, ["abc"], [])
    assert calls == []
