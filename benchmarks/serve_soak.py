"""Soak test for ``nsd serve``: N minutes of mixed traffic from several clients on the
loopback, then a verdict.

Traffic, drawn per client from a seeded generator: greedy probes (whose answers are taken
one at a time on the idle server first, then checked on every repeat under load: a lost or
crossed response shows as a mismatch), chat conversations with follow-up turns, streams
the client drops after the first chunk followed at once by the next turn, seeded sampled
requests, streamed or not, and bad inputs (each must get its own 4xx). Every loop is
bounded by the deadline and a request count, so the run stops by itself.

Reported: requests by kind and status, 5xx (must be 0), errors without a status, p50/p95
latency, the greedy mismatches, how many follow-ups after a drop reused their prompt, and
every ``--sample-s`` seconds the server's RSS and prompt-cache bytes (from ``/metrics``);
RSS growth after the warm-up (the first quarter) against the cache's byte limit. The JSON
result is written atomically (a temporary file renamed). Exit status 1 when a check fails.

    # two minutes on the smallest model (flags after -- go to `nsd serve`)
    python benchmarks/serve_soak.py --minutes 2 --json soak.json -- \\
        --target smollm2-135m-instruct --proposer ngram --n-ctx 2048
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import threading
import time
from typing import Any
from urllib.parse import urlparse

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import metric_values, percentile, started_server  # noqa: E402

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_TOKENS = 16
TOPICS = ("the sea", "a hash map", "prime numbers", "the moon", "a binary search", "bread")
# Bad inputs and the status each must get.
BAD = (
    (b"{not json", "application/json", 400),
    (json.dumps({"temperature": 5}), "application/json", 400),
    (json.dumps({"stop": ["a", "b", "c", "d", "e"]}), "application/json", 400),
    (json.dumps({"bogus_field": 1}), "application/json", 400),
    (json.dumps({}), "text/plain", 415),
    (json.dumps({"max_tokens": 0}), "application/json", 400),
)


def probe_bodies(model: str) -> list[dict[str, Any]]:
    """Greedy requests with a fixed answer (a count SmolLM2 continues with a wide margin)."""
    out = []
    for i, method in enumerate(("ar", "sd", "nsd", "nsd", "ar", "sd")):
        n = 7 * i + 3
        out.append({"model": model, "prompt": f"Continue the sequence: {n}, {n + 1}, {n + 2},",
                    "max_tokens": MAX_TOKENS, "temperature": 0.0, "nsd": {"method": method}})
    return out


class Soak:
    def __init__(self, url: str, model: str, deadline: float, max_requests: int) -> None:
        self.url, self.model, self.deadline, self.max_requests = url, model, deadline, max_requests
        self.lock = threading.Lock()
        self.records: list[dict[str, Any]] = []
        self.mismatches: list[dict[str, Any]] = []
        self.reference: dict[int, str] = {}
        self.follow_ups: list[tuple[int, int]] = []  # (cached, prompt tokens) after a drop

    def record(self, kind: str, status: int | None, seconds: float, **extra: Any) -> None:
        with self.lock:
            self.records.append({"kind": kind, "status": status, "seconds": seconds, **extra})

    # ------------------------------------------------------------------ requests
    def post(self, client: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
        return client.post(f"{self.url}{path}", json=body)

    def streamed_text(self, client: httpx.Client, path: str, body: dict[str, Any],
                      drop_after_first: bool = False) -> tuple[int, str]:
        chat = path.endswith("chat/completions")
        text = []
        with client.stream("POST", f"{self.url}{path}", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, ""
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return 599, ""  # an error event inside a 200 stream: counted as a failure
                if event.get("choices"):
                    choice = event["choices"][0]
                    piece = choice["delta"].get("content") if chat else choice.get("text")
                    if piece:
                        text.append(piece)
                        if drop_after_first:
                            return 200, "".join(text)
        return 200, "".join(text)

    def probe(self, client: httpx.Client, rng: random.Random) -> None:
        i = rng.randrange(len(self.reference))
        body = probe_bodies(self.model)[i]
        start = time.perf_counter()
        if rng.random() < 0.5:
            status, text = self.streamed_text(client, "/v1/completions", body)
        else:
            r = self.post(client, "/v1/completions", body)
            status, text = r.status_code, (r.json()["choices"][0]["text"] if r.status_code == 200 else "")
        self.record("greedy", status, time.perf_counter() - start)
        if status == 200 and text != self.reference[i]:
            with self.lock:
                self.mismatches.append({"probe": i, "expected": self.reference[i], "got": text})

    def chat(self, client: httpx.Client, rng: random.Random, drop_first: bool) -> None:
        topic = rng.choice(TOPICS)
        messages = [{"role": "user", "content": f"Tell me about {topic}. " * rng.randint(5, 30)}]
        body = {"model": self.model, "messages": messages, "max_tokens": MAX_TOKENS,
                "temperature": 0.7, "seed": rng.randrange(1 << 30)}
        start = time.perf_counter()
        status, answer = self.streamed_text(client, "/v1/chat/completions", body, drop_first)
        self.record("cancel" if drop_first else "chat", status, time.perf_counter() - start)
        if status != 200:
            return
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Shorter please."}]
        start = time.perf_counter()
        r = self.post(client, "/v1/chat/completions", {**body, "messages": messages})
        self.record("follow_up", r.status_code, time.perf_counter() - start)
        if r.status_code == 200 and drop_first:
            usage = r.json()["usage"]
            with self.lock:
                self.follow_ups.append((usage["prompt_tokens_details"]["cached_tokens"],
                                        usage["prompt_tokens"]))

    def bad(self, client: httpx.Client, rng: random.Random) -> None:
        raw, media, want = rng.choice(BAD)
        if isinstance(raw, str):
            raw = json.dumps({"model": self.model, "prompt": "Hi", **json.loads(raw)}).encode()
        start = time.perf_counter()
        r = client.post(f"{self.url}/v1/completions", content=raw, headers={"Content-Type": media})
        self.record("bad", r.status_code, time.perf_counter() - start, expected=want)

    def sampled(self, client: httpx.Client, rng: random.Random) -> None:
        body = {"model": self.model, "prompt": f"A short story about {rng.choice(TOPICS)}:",
                "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": rng.randrange(1 << 30)}
        start = time.perf_counter()
        if rng.random() < 0.5:
            status, _ = self.streamed_text(client, "/v1/completions", body)
        else:
            status = self.post(client, "/v1/completions", body).status_code
        self.record("sampled", status, time.perf_counter() - start)

    # ------------------------------------------------------------------ loops
    def client_loop(self, index: int, seed: int) -> None:
        rng = random.Random(seed * 1000 + index)
        actions = ((self.probe, 3), (lambda c, r: self.chat(c, r, False), 2),
                   (lambda c, r: self.chat(c, r, True), 2), (self.bad, 1), (self.sampled, 2))
        weights = [w for _, w in actions]
        with httpx.Client(timeout=600) as client:
            for _ in range(self.max_requests):  # bounded, and by the deadline
                if time.monotonic() > self.deadline:
                    return
                action = rng.choices(actions, weights)[0][0]
                try:
                    action(client, rng)
                except httpx.HTTPError as exc:  # no status at all: a lost response
                    self.record("transport", None, 0.0, error=f"{type(exc).__name__}: {exc}")


def scrape(url: str) -> dict[str, float]:
    return metric_values(url, ("process_resident_memory_bytes", "nsd_prefix_cache_bytes_held",
                               "nsd_prefix_cache_budget_bytes", "nsd_prefix_cache_entries"))


def monitor(url: str, start: float, stop: threading.Event, every_s: float,
            samples: list[dict[str, float]]) -> None:
    while True:
        try:
            samples.append({"t_s": round(time.monotonic() - start, 1), **scrape(url)})
        except httpx.HTTPError:
            pass
        if stop.wait(every_s):
            return


def summarize(soak: Soak, samples: list[dict[str, float]], minutes: float) -> dict[str, Any]:
    kinds: dict[str, dict[str, Any]] = {}
    for rec in soak.records:
        k = kinds.setdefault(rec["kind"], {"count": 0, "statuses": {}, "seconds": []})
        k["count"] += 1
        k["statuses"][str(rec["status"])] = k["statuses"].get(str(rec["status"]), 0) + 1
        if rec["status"] == 200:
            k["seconds"].append(rec["seconds"])
    latency = [r["seconds"] for r in soak.records if r["status"] == 200]
    for k in kinds.values():
        secs = k.pop("seconds")
        k["p50_s"] = round(percentile(secs, 50), 3) if secs else None
        k["p95_s"] = round(percentile(secs, 95), 3) if secs else None
    server_errors = sum(1 for r in soak.records if r["status"] is not None and r["status"] >= 500)
    transport = [r["error"] for r in soak.records if r["status"] is None]
    wrong_4xx = sum(1 for r in soak.records if r["kind"] == "bad" and r["status"] != r["expected"])
    rss = [s["process_resident_memory_bytes"] for s in samples if "process_resident_memory_bytes" in s]
    warm = rss[len(rss) // 4:] if rss else []
    budget = samples[-1].get("nsd_prefix_cache_budget_bytes", 0.0) if samples else 0.0
    growth = (max(warm) - warm[0]) if warm else None
    reused = [c for c, _ in soak.follow_ups]
    checks = {"no_5xx": server_errors == 0, "no_lost_responses": not transport,
              "greedy_answers_match": not soak.mismatches, "bad_inputs_get_their_4xx": wrong_4xx == 0,
              "rss_growth_within_cache_limit": growth is not None and growth <= budget}
    return {
        "minutes": minutes, "requests": len(soak.records), "by_kind": kinds,
        "server_errors_5xx": server_errors, "transport_errors": transport[:20],
        "bad_inputs_wrong_status": wrong_4xx,
        "latency_p50_s": round(percentile(latency, 50), 3) if latency else None,
        "latency_p95_s": round(percentile(latency, 95), 3) if latency else None,
        "greedy_checked": kinds.get("greedy", {}).get("count", 0), "greedy_mismatches": soak.mismatches[:20],
        "follow_ups_after_drop": len(reused),
        "follow_ups_after_drop_reusing": sum(1 for c in reused if c > 0),
        "follow_up_cached_share": round(statistics.fmean(c / p for c, p in soak.follow_ups), 3)
        if soak.follow_ups else None,
        "rss_growth_after_warmup_mb": None if growth is None else round(growth / 2 ** 20, 1),
        "cache_budget_mb": round(budget / 2 ** 20, 1), "samples": samples,
        "checks": checks, "ok": all(checks.values()),
    }


def main() -> int:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server on the loopback (else one is started with the "
                                 "args after --)")
    p.add_argument("--model", help="model id on --url (default: the first of /v1/models)")
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-requests", type=int, default=100000, help="per client, a bound besides the deadline")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS/cache samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the result here (atomically)")
    args = p.parse_args(argv)
    if not args.url and not serve_args:
        p.error("give --url, or `-- --target MODEL ...` to start a server")
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        p.error(f"--url must be on the loopback ({', '.join(LOOPBACK)}): a soak is no load test of others' servers")
    if args.minutes <= 0 or args.clients < 1:
        p.error("--minutes must be > 0 and --clients >= 1")

    with (contextlib.nullcontext((args.url, args.model)) if args.url else started_server(serve_args)) as (url, model):
        model = model or httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        soak = Soak(url, model, 0.0, args.max_requests)
        with httpx.Client(timeout=600) as client:  # each probe's answer alone, on the idle server
            for i, body in enumerate(probe_bodies(model)):
                soak.reference[i] = client.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
        start = time.monotonic()
        soak.deadline = start + 60 * args.minutes
        samples: list[dict[str, float]] = []
        stop = threading.Event()
        watcher = threading.Thread(target=monitor, args=(url, start, stop, args.sample_s, samples))
        watcher.start()
        threads = [threading.Thread(target=soak.client_loop, args=(i, args.seed)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        watcher.join()
        samples.append({"t_s": round(time.monotonic() - start, 1), **scrape(url)})
        result = summarize(soak, samples, args.minutes)
        result["settings"] = vars(args) | {"serve_args": serve_args}
    shown = {k: v for k, v in result.items() if k not in ("samples", "settings")}
    print(json.dumps(shown, indent=1))
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.json)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
