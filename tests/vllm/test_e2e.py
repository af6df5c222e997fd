"""End to end on vLLM (CPU build) with the real Qwen2.5-Coder 1.5B target / 0.5B draft.

Needs the vLLM venv (scripts/install_vllm.sh) and the models' HF folders
(``nsd models fetch qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct --hf``).
One engine is built with NSD configured; the engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the test switches the plugin's rule between
generations instead of paying for an engine start per rule.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm")

from nsd.integrations.vllm.plugin import ACTIVE  # noqa: E402
from nsd.verify import RuleConfig  # noqa: E402

MODELS = Path(os.environ.get("NSD_CACHE", Path.home() / ".cache" / "nsd")) / "models"
TARGET = MODELS / "qwen2.5-coder-1.5b-instruct" / "hf"
DRAFT = MODELS / "qwen2.5-coder-0.5b-instruct" / "hf"
PROMPTS = ["def fibonacci(n):\n", "def is_palindrome(s: str) -> bool:\n",
           "# Return the n-th prime number\ndef nth_prime(n):\n"]
MAX_TOKENS = 40

if not (TARGET / "config.json").is_file() and (DRAFT / "config.json").is_file():
    pytest.skip("HF folders missing: run `nsd models fetch qwen2.5-coder-0.5b-instruct "
                "qwen2.5-coder-1.5b-instruct --hf`", allow_module_level=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    report = tmp_path_factory.mktemp("nsd") / "requests.jsonl"
    llm = vllm.LLM(model=str(TARGET), dtype="bfloat16", max_model_len=1024, seed=0,
                   kv_cache_memory_bytes=1 << 30, compilation_config={"mode": 0},  # eager: seconds to start, not minutes
                   speculative_config={"method": "draft_model", "model": str(DRAFT),
                                       "num_speculative_tokens": 4},
                   additional_config={"nsd": {"rule": "nucleus", "theta": 0.9, "report": str(report)}})
    assert ACTIVE.config is not None and ACTIVE.ledger is not None, "the nsd plugin did not load"
    return llm, report, ACTIVE.config


def generate(engine, rule: RuleConfig) -> tuple[list[str], list[dict]]:
    llm, report, config = engine
    ACTIVE.config = dataclasses.replace(config, rule=rule)
    start = report.stat().st_size if report.exists() else 0
    outs = llm.generate(PROMPTS, vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    with open(report, encoding="utf-8") as f:
        f.seek(start)
        lines = [json.loads(line) for line in f]
    return [o.outputs[0].text for o in outs], lines


def acceptance_length(lines: list[dict]) -> float:
    return sum(r["tokens"] for r in lines) / sum(r["steps"] for r in lines)


def test_nsd_in_vllm_greedy(engine) -> None:
    stock_text, stock = generate(engine, RuleConfig(kind="exact"))
    zero_text, zero = generate(engine, RuleConfig(kind="nucleus", theta=0.0))
    nsd_text, nsd = generate(engine, RuleConfig(kind="nucleus", theta=0.9))
    budget_text, budget = generate(engine, RuleConfig(kind="nucleus", theta=0.9, budget=1.0))
    print(f"\nacceptance length: stock {acceptance_length(stock):.2f}  nsd θ0.9 "
          f"{acceptance_length(nsd):.2f}  nsd B=1 {acceptance_length(budget):.2f}")
    print("D per request: nsd", [round(r["deviation"], 2) for r in nsd],
          "budget", [round(r["deviation"], 2) for r in budget])
    assert zero_text == stock_text  # θ = 0 is the stock rule
    assert len(stock) == len(nsd) == len(PROMPTS)  # one report line per finished request
    assert all(r["deviation"] == 0 for r in stock + zero)
    assert acceptance_length(nsd) > acceptance_length(stock)
    assert sum(r["relaxed"] for r in nsd) > 0
    assert all(r["deviation"] <= 1.0 + 1e-9 for r in budget)  # the budget holds per request
