"""End to end on vLLM (CPU build) with the real Qwen2.5-Coder 1.5B target / 0.5B draft.

Needs the vLLM venv (scripts/install_vllm.sh) and the models' HF folders
(``nsd models fetch qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct --hf``).
One engine is built with NSD configured; the engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the test switches the plugin's rule between
generations instead of paying for an engine start per rule.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm")

from nsd.integrations.vllm.plugin import ACTIVE, set_rule  # noqa: E402
from nsd.rules.verify import RuleConfig  # noqa: E402

MODELS = Path(os.environ.get("NSD_CACHE", Path.home() / ".cache" / "nsd")) / "models"
TARGET = MODELS / "qwen2.5-coder-1.5b-instruct" / "hf"
DRAFT = MODELS / "qwen2.5-coder-0.5b-instruct" / "hf"
# Prose, where the 0.5B draft often misses the 1.5B target's argmax but stays in its
# nucleus (stock acceptance length ~3 of 5 here, NSD θ0.9 ~5, D 5-8 over 24 tokens).
PROMPTS = ["The three most important ideas in computer science are", "Dear hiring manager,\n"]
MAX_TOKENS = 24
BUDGET = 2.0

if not ((TARGET / "config.json").is_file() and (DRAFT / "config.json").is_file()):
    pytest.skip("HF folders missing: run `nsd models fetch qwen2.5-coder-0.5b-instruct "
                "qwen2.5-coder-1.5b-instruct --hf`", allow_module_level=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    report = tmp_path_factory.mktemp("nsd") / "requests.jsonl"
    llm = vllm.LLM(model=str(TARGET), dtype="bfloat16", max_model_len=512, seed=0,
                   kv_cache_memory_bytes=1 << 28, compilation_config={"mode": 0},  # eager: seconds to start, not minutes
                   speculative_config={"method": "draft_model", "model": str(DRAFT),
                                       "num_speculative_tokens": 4},
                   additional_config={"nsd": {"method": "nsd", "theta": 0.9, "report": str(report)}})
    assert ACTIVE.config is not None and ACTIVE.ledger is not None, "the nsd plugin did not load"
    return llm, report, ACTIVE.config


def read_report(report: Path) -> dict[str, list[dict]]:
    """Report lines by the caller's request id (RequestOutput.request_id)."""
    by_id: dict[str, list[dict]] = {}
    if report.exists():
        for line in report.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            by_id.setdefault(row["external_request_id"], []).append(row)
    return by_id


def generate(engine, rule: RuleConfig) -> tuple[list[list[int]], list[dict]]:
    """Token ids per prompt, and each request's report line (written before generate returns)."""
    llm, report, _config = engine
    set_rule(rule)
    outs = llm.generate(PROMPTS, vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    by_id = read_report(report)
    lines = []
    for out in outs:
        rows = by_id.get(out.request_id, [])
        assert len(rows) == 1, f"request {out.request_id}: {len(rows)} report lines, want 1"
        assert rows[0]["output_tokens"] == len(out.outputs[0].token_ids)
        lines.append(rows[0])
    return [list(o.outputs[0].token_ids) for o in outs], lines


def acceptance_length(lines: list[dict]) -> float:
    return sum(r["tokens"] for r in lines) / sum(r["steps"] for r in lines)


def test_nsd_in_vllm_greedy(engine) -> None:
    stock_ids, stock = generate(engine, RuleConfig(kind="exact"))
    # θ = 0 would hand straight back to vLLM's stock function; a θ this small runs nsd's own
    # verifier, whose greedy nucleus is then the argmax alone: the stock rule.
    tiny_ids, tiny = generate(engine, RuleConfig(kind="nucleus", theta=1e-9))
    zero_ids, _ = generate(engine, RuleConfig(kind="nucleus", theta=0.0))
    nsd_ids, nsd = generate(engine, RuleConfig(kind="nucleus", theta=0.9))
    budget_ids, budget = generate(engine, RuleConfig(kind="nucleus", theta=0.9, budget=BUDGET))
    print(f"\nacceptance length: stock {acceptance_length(stock):.2f}  nsd θ0.9 "
          f"{acceptance_length(nsd):.2f}  nsd θ0.9 B={BUDGET:g} {acceptance_length(budget):.2f}")
    print("D per request: nsd", [r["deviation"] for r in nsd], "budget", [r["deviation"] for r in budget])
    assert zero_ids == stock_ids and tiny_ids == stock_ids  # greedy with nothing relaxed is stock
    assert all(r["deviation"] == 0 and r["relaxed"] == 0 for r in stock + tiny)
    assert all(r["steps"] > 0 for r in stock + tiny + nsd + budget)
    assert acceptance_length(tiny) == acceptance_length(stock)
    assert acceptance_length(nsd) > acceptance_length(stock)
    assert sum(r["relaxed"] for r in nsd) > 0 and nsd_ids != stock_ids
    # Greedy charges E = 1 per relaxed accept, so D counts them, and the budget holds exactly.
    assert all(r["deviation"] == r["relaxed"] for r in nsd + budget)
    assert max(r["deviation"] for r in nsd) > BUDGET  # unbudgeted NSD goes past B here...
    assert all(r["deviation"] <= BUDGET for r in budget)  # ...and the budget stops it at B
    assert any(r["deviation"] > 0 for r in budget)
