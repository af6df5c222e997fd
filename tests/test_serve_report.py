"""The serving benchmarks' tables (nsd.bench.serve_report): paired scaling per round, and
the prompt-reuse speedup of a conversation's second turn."""

from __future__ import annotations

import pytest

from nsd.bench import serve_report


def _row(method: str, clients: int, rnd: int, tps: float, agree: float = 1.0) -> dict:
    return {"method": method, "clients": clients, "round": rnd, "tokens_per_s": tps,
            "latency_s_p95": 0.5 * clients + rnd, "agree": agree}


def test_scaling_is_paired_with_the_one_client_level_of_the_same_round() -> None:
    # Round 1 ran on a slower machine state: unpaired, 4 clients would read 30/15 = 2.0x;
    # paired by round it is 2.0x and 3.0x, median 2.5x.
    rows = [_row("ar", 1, 0, 10.0), _row("ar", 4, 0, 20.0), _row("ar", 1, 1, 5.0), _row("ar", 4, 1, 15.0, 0.5)]
    lines = serve_report.scaling_table(rows)
    four = next(line for line in lines if line.startswith("| ar | 4 |"))
    assert four == "| ar | 4 | 17.5 | 2.50× | 3000 | 75% |"


def test_reuse_speedup_is_the_cold_second_turn_over_the_live_one() -> None:
    rows = [{"label": "A turn 2 (live cache)", "ttft_s": 0.2, "prompt_tokens": 800, "cached_tokens": 780,
             "total_s": 0.3},
            {"label": "A turn 2 (cold)", "ttft_s": 3.0, "prompt_tokens": 800, "cached_tokens": 0, "total_s": 3.1}]
    assert serve_report.reuse_speedup(rows) == pytest.approx(15.0)
    assert "| A turn 2 (cold) | 800 | 0 | 3.00 | 3.10 |" in serve_report.reuse_table(rows)
