"""``nsd compare`` on mock models: one row per method, shared metric definitions."""

from __future__ import annotations

from mock import MockLM
from nsd.api import Engine, GenerationConfig
from nsd.compare import run_compare


class _Tok:
    def encode(self, text, **kw):
        return [ord(c) % 16 for c in text]

    def decode(self, ids, **kw):
        return "".join(chr(97 + i) for i in ids)


def test_compare_table_rows_and_tau() -> None:
    # Mock models instead of loading real weights.
    engine = Engine.from_backends(MockLM(seed=1), _Tok(), MockLM(seed=1), eos_token_ids=())
    configs = [GenerationConfig(method=m, max_new_tokens=20, k=4) for m in ("ar", "sd", "nsd")]
    table = run_compare(engine, ["abc", "hello"], configs).splitlines()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table[2:]}
    assert set(rows) == {"ar", "sd", "nsd"}
    assert rows["ar"][0] == "40" and rows["ar"][2] == "1.00" and rows["ar"][5] == "1.00x"
    # Draft = target: every block of 4 drafts + bonus is accepted, 20 tokens in 4 passes.
    assert rows["sd"][2] == "5.00" and rows["sd"][3] == "1.00" and rows["sd"][6] == "1.00x"
    assert rows["nsd"][4] == "0.000"
