"""``nsd compare`` on mock models: one row per method, shared metric definitions."""

from __future__ import annotations

import pytest

from mock import MockLM
from nsd.api import Engine, GenerationConfig
from nsd.options import default_proposer
from nsd.compare import run_compare
from nsd.errors import NSDError


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
