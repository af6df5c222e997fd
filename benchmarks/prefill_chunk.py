"""A long prompt arriving in a busy batch: its prefill in one round or in chunks.

One engine is split into slots as ``nsd serve --parallel`` does. Four requests with short
prompts (HumanEval, chat template) stream their answers; once each has streamed
``--after`` pieces, a fifth arrives with a long prompt (the longest Spec-Bench
summarisation question that fits ``--max-prompt`` tokens). Its prefill runs either as one
forward, which every other request's next token waits for, or in chunks of ``--chunks``
tokens, one per round (the server's ``--prefill-chunk``). Modes run one after another, every other round in
reverse order. Reported per mode (medians over rounds): the longest wait between two
streamed pieces of the short requests while the long one was arriving, their 95th
percentile gap, the long request's time to first token, and the short requests' rate.

    python benchmarks/prefill_chunk.py --chunks 0,32,64,128 --rounds 3 \\
        --json benchmarks/results/zen4-host/prefill-chunk.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nsd.api import GenerationConfig, load_engine
from nsd.bench.datasets import DatasetConfig, load_prompts
from nsd.bench.store import write_json_atomic
from nsd.machine import cpu_description
from nsd.models.loader import BackendOptions


def _stream(slot, prompt: list[int], config: GenerationConfig, times: list[float],
            progress: threading.Condition | None = None) -> None:
    for _ in slot.stream(prompt, config):
        times.append(time.perf_counter())
        if progress is not None:
            with progress:
                progress.notify_all()


def run_once(slots, batcher, shorts: list[list[int]], long: list[int], chunk: int,
             short_tokens: int, after: int) -> dict:
    for slot in slots:  # the server's --prefill-chunk
        slot.target.prefill_chunk = chunk
    config = GenerationConfig(method="ar", max_new_tokens=short_tokens, seed=0)
    long_config = GenerationConfig(method="ar", max_new_tokens=16, seed=0)
    stamps: list[list[float]] = [[] for _ in shorts]
    ready = threading.Barrier(len(shorts))
    progress = threading.Condition()
    arrival: list[float] = []
    long_stamps: list[float] = []

    def short(i: int) -> None:
        with batcher.member():
            ready.wait()
            _stream(slots[i], shorts[i], config, stamps[i], progress)

    def late() -> None:
        # Arrive while every short request is decoding (past its own prefill).
        with progress:
            progress.wait_for(lambda: all(len(s) >= after for s in stamps), timeout=120)
        with batcher.member():
            arrival.append(time.perf_counter())
            _stream(slots[len(shorts)], long, long_config, long_stamps)

    start = time.perf_counter()
    with ThreadPoolExecutor(len(shorts) + 1) as pool:
        futures = [pool.submit(short, i) for i in range(len(shorts))] + [pool.submit(late)]
        for future in futures:
            future.result()  # a failure is raised here, not lost in a thread
    wall = time.perf_counter() - start
    # Gaps between consecutive pieces of each short request, from the long one's arrival
    # until its first piece (the time its prefill could hold the others up).
    window = (arrival[0], long_stamps[0] if long_stamps else wall + start)
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if b > window[0] and a < window[1]]
    return {
        "chunk": chunk, "wall_s": wall,
        "max_gap_ms": 1000 * max(gaps, default=0.0),
        "p95_gap_ms": 1000 * statistics.quantiles(gaps, n=20)[-1] if len(gaps) > 1 else None,
        "long_ttft_ms": 1000 * (long_stamps[0] - arrival[0]) if long_stamps else None,
        "short_pieces_per_s": sum(len(s) for s in stamps) / wall,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--chunks", default="0,32,128", help="chunk sizes to compare (0: one forward)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--short-tokens", type=int, default=192)
    p.add_argument("--after", type=int, default=8,
                   help="pieces each short request streams before the long prompt arrives")
    p.add_argument("--max-prompt", type=int, default=800, help="tokens of the long prompt at most")
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--json", help="write the rows here (atomically)")
    args = p.parse_args(argv)
    chunks = [int(x) for x in args.chunks.split(",")]
    engine = load_engine(args.target, options=BackendOptions(n_ctx=args.n_ctx))
    slots, batcher = engine.batched(5)
    shorts = [engine.encode(q.text, chat=True)
              for q in load_prompts(DatasetConfig(names=("humaneval",), limit=4))]
    texts = load_prompts(DatasetConfig(names=("spec-bench",), categories=("summarization",)))
    encoded = [engine.encode(q.text, chat=True) for q in texts]
    long = max((e for e in encoded if len(e) <= args.max_prompt), key=len)
    rows = []
    for r in range(args.rounds):
        for chunk in (chunks if r % 2 == 0 else chunks[::-1]):
            row = run_once(slots, batcher, shorts, long, chunk, args.short_tokens, args.after)
            row["round"] = r
            rows.append(row)
            print(f"round {r} chunk {chunk:4d}: max gap {row['max_gap_ms']:.0f} ms, long TTFT "
                  f"{row['long_ttft_ms']:.0f} ms", flush=True)
    print(f"CPU: {cpu_description()}; long prompt {len(long)} tokens; short prompts "
          f"{[len(s) for s in shorts]} tokens")
    print("| prefill | short requests' longest gap (ms) | their p95 gap (ms) | long request's TTFT (ms) | short pieces/s |")
    print("|---|---|---|---|---|")
    for chunk in chunks:
        mine = [row for row in rows if row["chunk"] == chunk]

        def med(key: str) -> float:
            return statistics.median(m[key] for m in mine if m[key] is not None)

        label = "one step" if chunk == 0 else f"chunks of {chunk}"
        print(f"| {label} | {med('max_gap_ms'):.0f} | {med('p95_gap_ms'):.0f} | "
              f"{med('long_ttft_ms'):.0f} | {med('short_pieces_per_s'):.1f} |")
    if args.json:
        write_json_atomic(Path(args.json), {"cpu": cpu_description(), "args": vars(args),
                                            "long_prompt_tokens": len(long), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
