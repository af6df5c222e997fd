"""Load generator for ``nsd serve``: requests/s, time to first token and per-token latency
percentiles at several client counts, for AR, SD and NSD on one server.

One server serves every method (each request picks it in its ``nsd`` body field), so the
methods share the loaded model; they run one after another at each concurrency level.
Every client streams chat completions back to back; TTFT is measured at the client from
sending the request to the first text chunk, the per-token latency (time per output
token) as (last chunk - first chunk) / (tokens - 1), the latency as sending to the last
byte. Loopback only.

With ``--rounds R`` the levels run R times, every other round in reverse order, and the
summary gives each level's aggregate tokens/s against one client's, paired by round (the
median over rounds of the ratio within a round), so that a drift of the machine's speed
moves both sides of a ratio alike. ``agree`` is the share of a level's answers equal to
the one-client answer to the same prompt and method (at temperature 0, where the answer is
fixed, batched forwards change it only where rounding flips an argmax). The server's
``/metrics`` give each level's mean batch: sequences per batched forward.

    # start a server itself (flags after -- go to `nsd serve`)
    python benchmarks/serve_load.py --requests 4 -- --target smollm2-135m-instruct --proposer ngram
    # or load a running one
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model smollm2-135m-instruct
"""
# The figures for batched serving (Zen 4; docs/lab-notes.md) came from
#   python benchmarks/serve_load.py --methods ar,nsd --concurrency 1,4,16 --rounds 2 \
#     --requests 1 --max-tokens 48 --json J -- --target qwen2.5-coder-1.5b-instruct \
#     --draft qwen2.5-coder-0.5b-instruct --parallel 16 --n-ctx 1024 --proposer draft

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import httpx

from nsd.bench.serve_report import scaling_table

PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a hash map is.",
    "List five fruits, one per line.",
    "Write a haiku about the sea.",
)


@dataclass
class Sample:
    status: int
    ttft_s: float = 0.0
    per_token_s: float | None = None  # None when fewer than two chunks arrived
    total_s: float = 0.0
    tokens: int = 0
    tau: float | None = None  # the server's mean accepted length for this request
    text: str = ""


def one_request(client: httpx.Client, url: str, model: str, prompt: str, method: str,
                max_tokens: int, temperature: float = 0.0) -> Sample:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "temperature": temperature, "nsd": {"method": method}}
    start = time.perf_counter()
    first = last = tau = None
    tokens = 0
    pieces = []
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return Sample(r.status_code)
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return Sample(500)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
                tau = event["usage"]["nsd"]["tau"]
            elif event["choices"] and event["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
                pieces.append(event["choices"][0]["delta"]["content"])
    end = time.perf_counter()
    if first is None:
        return Sample(200, end - start, None, end - start, tokens, tau, "".join(pieces))
    per_token = (last - first) / (tokens - 1) if tokens > 1 and last > first else None
    return Sample(200, first - start, per_token, end - start, tokens, tau, "".join(pieces))


def run_level(url: str, model: str, method: str, clients: int, requests: int,
              max_tokens: int, temperature: float = 0.0) -> tuple[list[tuple[str, Sample]], float]:
    """``clients`` threads, each sending ``requests`` requests back to back; returns
    (prompt, sample) pairs and the wall time."""
    def client_loop(i: int) -> list[tuple[str, Sample]]:
        with httpx.Client(timeout=600) as client:
            prompts = [PROMPTS[(i + j) % len(PROMPTS)] for j in range(requests)]
            return [(p, one_request(client, url, model, p, method, max_tokens, temperature))
                    for p in prompts]

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        samples = [s for batch in pool.map(client_loop, range(clients)) for s in batch]
    return samples, time.perf_counter() - start


def metric_values(url: str, names: tuple[str, ...], timeout: float = 30.0) -> dict[str, float]:
    """The current values of the server's unlabelled metrics ``names`` (those it exports)."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=timeout).text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[name] = float(value)
    return values


def batch_counters(url: str) -> tuple[float, float]:
    """The server's (batched forwards, sequences they carried) so far."""
    values = metric_values(url, ("nsd_batch_forwards_total", "nsd_batch_sequences_total"))
    return values.get("nsd_batch_forwards_total", 0.0), values.get("nsd_batch_sequences_total", 0.0)


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summarize(method: str, clients: int, samples: list[Sample], wall_s: float) -> dict:
    ok = [s for s in samples if s.status == 200]
    ttft = [s.ttft_s for s in ok]
    tpot = [s.per_token_s for s in ok if s.per_token_s is not None]
    row = {"method": method, "clients": clients, "requests": len(samples), "ok": len(ok),
           "wall_s": wall_s, "tokens": sum(s.tokens for s in ok),
           "rejected_429": sum(s.status == 429 for s in samples),
           "failed": sum(s.status not in (200, 429) for s in samples),
           "requests_per_s": len(ok) / wall_s, "tokens_per_s": sum(s.tokens for s in ok) / wall_s,
           "tau_median": statistics.median(s.tau for s in ok) if ok else None}
    for name, values in (("ttft_s", ttft), ("per_token_s", tpot), ("latency_s", [s.total_s for s in ok])):
        for q in (50, 90, 95, 99):
            row[f"{name}_p{q}"] = percentile(values, q) if values else None
    return row


def table(rows: list[dict]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1e3 * v:.0f}"
    out = ["| method | clients | ok / sent | 429 | req/s | tok/s | τ | mean batch | "
           "TTFT p50 / p95 (ms) | per-token p50 / p95 (ms) | latency p50 / p95 (ms) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        batch = r.get("mean_batch")
        out.append(f"| {r['method']} | {r['clients']} | {r['ok']} / {r['requests']} | "
                   f"{r['rejected_429']} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
                   f"{'-' if r['tau_median'] is None else format(r['tau_median'], '.2f')} | "
                   f"{'-' if batch is None else format(batch, '.1f')} | "
                   f"{ms(r['ttft_s_p50'])} / {ms(r['ttft_s_p95'])} | "
                   f"{ms(r['per_token_s_p50'])} / {ms(r['per_token_s_p95'])} | "
                   f"{ms(r['latency_s_p50'])} / {ms(r['latency_s_p95'])} |")
    return "\n".join(out)


@contextlib.contextmanager
def started_server(serve_args: list[str]) -> Iterator[tuple[str, str]]:
    """Run ``nsd serve SERVE_ARGS --port 0``; yield (URL, model id); SIGTERM at the end."""
    proc = subprocess.Popen([sys.executable, "-m", "nsd.cli", "serve", *serve_args, "--port", "0",
                             "--log-level", "warning"], stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if line.startswith("nsd serve: "):
                model, url = line.removeprefix("nsd serve: ").strip().split(" at ")
                break
            sys.stderr.write(line)
        else:
            raise SystemExit(f"nsd serve exited with status {proc.wait()}")
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # never block its pipe
        yield url, model
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def main() -> None:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (else one is started with the args after --)")
    p.add_argument("--model", help="model id on --url (default: the first of /v1/models)")
    p.add_argument("--methods", default="ar,sd,nsd")
    p.add_argument("--concurrency", default="1,4,16", help="client counts, comma-separated")
    p.add_argument("--requests", type=int, default=4, help="requests per client at each level")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1, help="times to run every level (see above)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--json", help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    if not args.url and not serve_args:
        p.error("give --url, or `-- --target MODEL ...` to start a server")

    with (contextlib.nullcontext((args.url, args.model)) if args.url else started_server(serve_args)) as (url, model):
        model = model or httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        rows = []
        levels = [int(c) for c in args.concurrency.split(",")]
        reference: dict[tuple[str, str], str] = {}  # (method, prompt) -> its one-client answer
        for r in range(args.rounds):
            for clients in (levels if r % 2 == 0 else levels[::-1]):
                for method in args.methods.split(","):
                    before = batch_counters(url)
                    pairs, wall = run_level(url, model, method, clients, args.requests,
                                            args.max_tokens, args.temperature)
                    after = batch_counters(url)
                    row = summarize(method, clients, [s for _, s in pairs], wall)
                    forwards, sequences = after[0] - before[0], after[1] - before[1]
                    row["round"] = r
                    row["mean_batch"] = sequences / forwards if forwards else None
                    if clients == 1:
                        for prompt, sample in pairs:
                            reference.setdefault((method, prompt), sample.text)
                    row["texts"] = [[prompt, sample.text] for prompt, sample in pairs]
                    rows.append(row)
                    print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        for row in rows:  # every level's answers against the one-client answers
            same = [text == reference[(row["method"], prompt)] for prompt, text in row["texts"]
                    if (row["method"], prompt) in reference]
            row["agree"] = sum(same) / len(same) if same else None
    print(table(rows))
    if args.rounds > 1 or "1" in args.concurrency.split(","):
        print()
        print("\n".join(scaling_table(rows)))
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"settings": vars(args) | {"serve_args": serve_args}, "rows": rows}, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
