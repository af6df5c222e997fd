"""The vLLM plugin's per-request ledger, without vLLM: when each request's line is written."""

from __future__ import annotations

import json

import torch

from nsd.integrations.vllm.ledger import FidelityLedger, external_request_id
from nsd.rules.ragged import RaggedVerifyResult


def step(ledger: FidelityLedger, step_no: int, rows: dict[str, int]) -> None:
    """One verification step: request -> tokens emitted (k = 4 drafts each, stock rule)."""
    out = torch.full((len(rows), 5), -1, dtype=torch.int32)
    for i, n in enumerate(rows.values()):
        out[i, :n] = 7
    ledger.record(list(rows), [4] * len(rows), out, step=step_no)


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_scheduler_close_reports_at_once_and_ignores_steps_run_ahead(tmp_path) -> None:
    report = tmp_path / "r.jsonl"
    ledger = FidelityLedger(report=str(report), log_requests=False)
    step(ledger, 1, {"0-0a1b2c3d": 5, "1-deadbeef": 2})
    step(ledger, 2, {"0-0a1b2c3d": 3, "1-deadbeef": 5})  # async scheduling ran step 2 ahead
    ledger.close("1-deadbeef", upto=1, output_tokens=3)  # the scheduler applies step 1
    (line,) = lines(report)
    assert line["request_id"] == "1-deadbeef" and line["external_request_id"] == "1"
    assert (line["steps"], line["tokens"], line["accepted"], line["output_tokens"]) == (1, 2, 1, 3)
    step(ledger, 3, {"0-0a1b2c3d": 1, "1-deadbeef": 4})
    ledger.finish({"1-deadbeef"})  # the worker's notice: no second line
    assert len(lines(report)) == 1
    ledger.close("0-0a1b2c3d", upto=3)
    assert [x["tokens"] for x in lines(report)] == [2, 9]
    assert ledger.requests == {} and ledger._pending == []


def test_worker_notice_reports_when_no_scheduler_in_process(tmp_path) -> None:
    report = tmp_path / "r.jsonl"
    ledger = FidelityLedger(report=str(report), log_requests=False)
    step(ledger, 1, {"a-0a1b2c3d": 5})
    ledger.finish({"a-0a1b2c3d", "b-0a1b2c3d"})  # b never verified a draft: still one line
    by_id = {x["external_request_id"]: x for x in lines(report)}
    assert by_id["a"]["steps"] == 1 and by_id["b"]["steps"] == 0


def test_ledger_charges_deviations_left_to_right_as_the_budget_scan_does() -> None:
    # 0.159 spent, then a step charging 0.074 and 0.067: the scan's running total is
    # (0.159 + 0.074) + 0.067 = 0.3 exactly, which B = 0.3 admits; adding the step's pairwise
    # sum instead, 0.159 + (0.074 + 0.067), gives 0.30000000000000004.
    ledger = FidelityLedger(log_requests=False)
    for step_no, charges in enumerate([[0.159, 0.0], [0.074, 0.067]], start=1):
        deviation = torch.tensor([charges], dtype=torch.float64)
        out = torch.tensor([[7, 7, 7]], dtype=torch.int32)
        result = RaggedVerifyResult(output_token_ids=out, num_accepted=torch.tensor([2]),
                                    relaxed=torch.tensor([[True, True]]), deviation=deviation,
                                    spent=torch.zeros(1, dtype=torch.float64))
        ledger.record(["a"], [2], out, result, step=step_no)
    d = ledger.spent(["a"], torch.device("cpu")).item()
    assert d == (0.159 + 0.074) + 0.067 and d <= 0.3


def test_external_request_id(monkeypatch) -> None:
    assert external_request_id("cmpl-abc-12-0a1b2c3d") == "cmpl-abc-12"
    assert external_request_id("7") == "7"
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    assert external_request_id("x-0a1b2c3d") == "x-0a1b2c3d"
