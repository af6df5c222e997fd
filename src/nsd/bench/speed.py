"""One speed definition for every benchmark and every reading of one.

tokens/s is *visible* generated tokens over the call's wall time: a speculative step can
overshoot a stop string by up to k tokens that nobody sees, and counting them would
flatter speculation. ``nsd bench`` stores it per call as ``tokens_per_s``; vLLM rows
(``benchmarks/vllm_bench.py``) store the visible count and the wall time. Speeds of two
methods are compared by the median over prompts of each prompt's own ratio (its length
and prefill cancel).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable, Sequence

from nsd.bench import metrics
from nsd.errors import NSDError


def visible_tokens(tokenizer, tokens: Sequence[int], text: str) -> list[int]:
    """The shortest prefix of ``tokens`` whose text covers ``text`` (the output up to its
    stop string). Overshoot is at most one block, so scan back from the end."""
    n = len(tokens)
    while n > 0 and len(tokenizer.decode(list(tokens[:n - 1]), skip_special_tokens=True)) >= len(text):
        n -= 1
    return list(tokens[:n])


def tokens_per_s(visible: int, wall_s: float) -> float:
    """Visible tokens per second of wall time (0 for a call that took no time)."""
    return visible / wall_s if wall_s > 0 else 0.0


def record_rate(record: dict) -> float:
    """An ``nsd bench`` record's tokens/s, as the runner stored it."""
    return record["tokens_per_s"]


def prompt_rates(records: Iterable[dict], rate: Callable[[dict], float | None] = record_rate
                 ) -> dict[str, dict[str, float]]:
    """``rates[prompt][method]``: each record's ``rate``, a record whose rate is None left
    out. What every paired figure reads (and what a run's summary keeps of its records)."""
    rates: dict[str, dict[str, float]] = defaultdict(dict)
    for r in records:
        value = rate(r)
        if value is not None:
            rates[r["prompt"]][r["method"]] = value
    return dict(rates)


def paired_ratio(records: Iterable[dict], method: str, reference: str,
                 rate: Callable[[dict], float | None] = record_rate) -> float:
    """Median over prompts of rate(method) / rate(reference); a record whose ``rate`` is
    None is left out (NaN when no prompt has both)."""
    return metrics.paired_ratio(prompt_rates(records, rate), method, reference)


def decode_rate(stats: dict, first_token_in_prefill: bool) -> float | None:
    """Tokens per second of decode steps (prefill excluded): a measure of per-step work,
    so every token a step made counts. llama.cpp's generate times its first token with
    the prompt, so its decode covers one step fewer than nsd's (whose prefill ends before
    the first token's step)."""
    steps = stats["new_tokens"] - (1 if first_token_in_prefill else 0)
    seconds = stats["wall_s"] - stats["prefill_s"]
    return steps / seconds if steps > 0 and seconds > 0 else None


def by_prompt(records: Iterable[dict]) -> dict[str, dict[str, dict]]:
    """Records by prompt, then by method label (the run's order)."""
    out: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in records:
        out[r["prompt"]][r["method"]] = r
    return out


def paired_speedup_lines(journal: Path, records: Sequence[dict]) -> list[str]:
    """The paired speed reading of one ``nsd bench`` journal: per method its paired median
    tok/s ratio to AR, and, when the run has the llama.cpp peer, nsd's AR per decode step
    against llama.cpp's generate."""
    prompts = by_prompt(records)
    methods = list(dict.fromkeys(m for rs in prompts.values() for m in rs))
    lines = [f"\n{journal} ({len(prompts)} prompts): paired median tok/s ratio to AR"]
    lines += [f"  {method:28s} {paired_ratio(records, method, 'ar'):.3f}"
              for method in methods if method != "ar"]
    peer = [rs["llama-generate"] for rs in prompts.values() if "llama-generate" in rs]
    if peer:
        ar = [decode_rate(rs["ar"]["stats"], False) for rs in prompts.values() if "ar" in rs]
        lg = [decode_rate(r["stats"], True) for r in peer]
        ar_med = metrics.median(v for v in ar if v)
        lg_med = metrics.median(v for v in lg if v)
        lines.append(f"  AR per decode step vs llama-generate: {ar_med:.2f} / {lg_med:.2f} tok/s = "
                     f"{ar_med / lg_med:.3f}")
    return lines


def paired_interval_lines(journal: Path, records: Sequence[dict], pairs: Sequence[Sequence[str]]) -> list[str]:
    """Per (method, reference) pair: the paired median tokens/s ratio with its bootstrap
    95 % interval over prompts and the number of prompts paired."""
    labels = {r["method"] for r in records}
    missing = sorted({m for pair in pairs for m in pair} - labels)
    if missing:
        raise NSDError(f"{journal} has no method {', '.join(missing)} (it has {', '.join(sorted(labels))})")
    rates = prompt_rates(records)
    lines = [f"\n{journal}: paired median tok/s ratio [bootstrap 95 % interval] (prompts)"]
    for method, reference in pairs:
        centre, low, high, n = metrics.paired_interval(rates, method, reference)
        lines.append(f"  {method} / {reference}: {centre:.3f} [{low:.3f}, {high:.3f}] ({n})")
    return lines
