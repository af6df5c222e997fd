"""nsd.bench.speed: one tokens/s for the runner and every reading (visible tokens over
wall time), paired ratios per prompt, decode rates, and paired_speedup.py's lines."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from nsd.bench import speed
from nsd.bench.schedule import method_order, missing
from nsd.errors import NSDError


def record(prompt: str, method: str, visible: int, generated: int, wall: float, prefill: float = 0.5) -> dict:
    return {"prompt": prompt, "method": method, "output_ids": [1] * visible,
            "tokens_per_s": speed.tokens_per_s(visible, wall),
            "stats": {"new_tokens": generated, "wall_s": wall, "prefill_s": prefill}}


def test_tokens_per_s_counts_visible_tokens() -> None:
    assert speed.tokens_per_s(10, 2.0) == 5.0
    assert speed.tokens_per_s(10, 0.0) == 0.0


def test_paired_ratio_is_a_median_of_per_prompt_ratios() -> None:
    rows = [record("a", "ar", 10, 10, 1.0), record("a", "sd", 10, 14, 0.5),  # 2.0 (overshoot ignored)
            record("b", "ar", 10, 10, 1.0), record("b", "sd", 10, 10, 2.0),  # 0.5
            record("c", "ar", 10, 10, 1.0), record("c", "sd", 30, 30, 2.0),  # 1.5
            record("d", "sd", 10, 10, 1.0)]  # no AR: unpaired
    assert speed.paired_ratio(rows, "sd", "ar") == pytest.approx(1.5)
    assert math.isnan(speed.paired_ratio(rows, "nsd", "ar"))
    skip_b = lambda r: None if r["prompt"] == "b" else r["tokens_per_s"]  # noqa: E731
    assert speed.paired_ratio(rows, "sd", "ar", rate=skip_b) == pytest.approx(1.75)


def test_decode_rate_and_paired_speedup_lines() -> None:
    assert speed.decode_rate({"new_tokens": 11, "wall_s": 1.5, "prefill_s": 0.5}, False) == 11.0
    assert speed.decode_rate({"new_tokens": 11, "wall_s": 1.5, "prefill_s": 0.5}, True) == 10.0
    assert speed.decode_rate({"new_tokens": 1, "wall_s": 1.5, "prefill_s": 0.5}, True) is None
    rows = [record("a", "ar", 10, 10, 1.5), record("a", "sd/draft", 10, 13, 1.0),
            record("a", "llama-generate", 10, 10, 1.5)]
    lines = speed.paired_speedup_lines(Path("j.jsonl"), rows)
    assert lines[0] == "\nj.jsonl (1 prompts): paired median tok/s ratio to AR"
    assert lines[1] == f"  {'sd/draft':28s} 1.500"  # 10 visible tokens, not 13 generated
    assert lines[3] == "  AR per decode step vs llama-generate: 10.00 / 9.00 tok/s = 1.111"


def test_method_order_and_missing() -> None:
    assert method_order(("a", "b", "c"), 4) == ["b", "c", "a"]
    assert missing([("p", "a"), ("p", "b"), ("q", "a")], {("p", "a"): {}}) == 2


def test_prompt_rates_and_the_pair_lines() -> None:
    rows = [record("a", "ar", 10, 10, 1.0), record("a", "topk_delta@K10,d0.4/draft", 10, 10, 0.5),
            record("b", "ar", 10, 10, 1.0), record("b", "topk_delta@K10,d0.4/draft", 10, 10, 2.0)]
    assert speed.prompt_rates(rows) == {"a": {"ar": 10.0, "topk_delta@K10,d0.4/draft": 20.0},
                                        "b": {"ar": 10.0, "topk_delta@K10,d0.4/draft": 5.0}}
    lines = speed.paired_interval_lines(Path("j.jsonl"), rows, [("topk_delta@K10,d0.4/draft", "ar")])
    assert lines[0] == "\nj.jsonl: paired median tok/s ratio [bootstrap 95 % interval] (prompts)"
    # Ratios 2 and 0.5: median 1.25; a resample of two is (0.5, 0.5), mixed or (2, 2).
    assert lines[1] == "  topk_delta@K10,d0.4/draft / ar: 1.250 [0.500, 2.000] (2)"
    with pytest.raises(NSDError, match=r"j.jsonl has no method sd/draft \(it has ar, topk"):
        speed.paired_interval_lines(Path("j.jsonl"), rows, [("sd/draft", "ar")])
