"""Time to first token of ``nsd serve`` with and without prompt reuse, on a long chat.

One in-process server (the real app under uvicorn on a loopback port) over one engine.
A conversation of 800+ tokens (a source file to review plus questions) is served turn by
turn, each request streamed; TTFT is measured at the client, from sending the request to
the first text chunk. The rows, in order:

1. ``A turn 1 (cold)``: an empty cache, the whole prompt prefilled (target and draft);
2. ``A turn 2 (live cache)``: the next turn, which extends turn 1's prompt and answer;
3. ``A turn 2 (cold)``: the same prompt again after emptying both caches: today's cost
   without reuse, the baseline of the ratio;
4. ``B turn 1 (cold)``: another conversation, which pushes A out of the live cache (the
   prefix cache saves A first);
5. ``A turn 3 (restored)``: A's next turn, served from A's saved snapshot.

    python benchmarks/serve_prefix_cache.py --json benchmarks/results/serve_prefix_cache.json
    python benchmarks/serve_prefix_cache.py --max-chars 2600 \
        --json benchmarks/results/serve_prefix_cache_short.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parents[1]


def serve(engine, config):
    from nsd.serve import create_app
    from nsd.serve.server import bind_socket

    app = create_app(engine, config)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def turn(client: httpx.Client, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = None
    text, usage = [], None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                piece = choice["delta"].get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    text.append(piece)
    return {"ttft_s": ttft, "total_s": time.perf_counter() - start, "text": "".join(text),
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("-k", default="auto",
                        help="draft length (default auto, which on a 2-core CPU mostly picks 0: "
                             "no drafting, so the draft's cache is never filled)")
    parser.add_argument("--max-chars", type=int, default=None,
                        help="cut the reviewed source to this many characters (a shorter chat)")
    parser.add_argument("--proposer", default="draft", choices=("draft", "hybrid"),
                        help="what drafts (default draft: the draft model alone, as in the "
                             "recorded runs)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from nsd.api import BackendOptions, GenerationConfig, load_engine
    from nsd.bench.serve_report import reuse_speedup
    from nsd.bench.store import write_json_atomic
    from nsd.draftlen.machine import cpu_description
    from nsd.serve import ServerConfig

    options = BackendOptions(threads=args.threads) if args.threads else BackendOptions()
    t0 = time.perf_counter()
    engine = load_engine(args.target, draft=args.draft, proposer=args.proposer, options=options)
    print(f"loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    k = args.k if args.k == "auto" else int(args.k)
    config = ServerConfig(model_name="m", defaults=GenerationConfig(method="nsd", k=k))
    server, thread, url = serve(engine, config)

    source = (ROOT / "src" / "nsd" / "sampling.py").read_text()[:args.max_chars]
    other = (ROOT / "src" / "nsd" / "stops.py").read_text()
    conv_a = [{"role": "system", "content": "You are a careful Python reviewer."},
              {"role": "user", "content": f"Review this module:\n\n```python\n{source}\n```\n"
                                          "First: what does logits_to_probs do?"}]
    conv_b = [{"role": "user", "content": f"Review this module:\n\n```python\n{other}\n```\n"
                                          "What does it do?"}]
    rows = []

    def record(label: str, result: dict) -> dict:
        rows.append({"label": label, **{k: v for k, v in result.items() if k != "text"}})
        print(f"{label:24s} prompt {result['prompt_tokens']:5d}  cached {result['cached_tokens']:5d}"
              f"  TTFT {result['ttft_s']:.3f} s  whole turn {result['total_s']:.3f} s", file=sys.stderr)
        return result

    with httpx.Client(base_url=url, timeout=600) as client:
        a1 = record("A turn 1 (cold)", turn(client, "m", conv_a, args.max_tokens))
        conv_a += [{"role": "assistant", "content": a1["text"]},
                   {"role": "user", "content": "Second: why is top-p computed from candidates?"}]
        a2 = record("A turn 2 (live cache)", turn(client, "m", conv_a, args.max_tokens))
        engine.target.reset()
        engine.draft.reset()
        record("A turn 2 (cold)", turn(client, "m", conv_a, args.max_tokens))
        record("B turn 1 (cold)", turn(client, "m", conv_b, args.max_tokens))
        conv_a += [{"role": "assistant", "content": a2["text"]},
                   {"role": "user", "content": "Third: any bug?"}]
        record("A turn 3 (restored)", turn(client, "m", conv_a, args.max_tokens))
        metrics = [line for line in client.get("/metrics").text.splitlines()
                   if line.startswith("nsd_prefix_cache_")]
    server.should_exit = True
    thread.join(30)
    print(f"second turn: {reuse_speedup(rows):.1f}x lower TTFT than cold", file=sys.stderr)
    print("\n".join(metrics), file=sys.stderr)
    if args.json:
        write_json_atomic(args.json, {"target": args.target, "draft": args.draft, "k": args.k,
                                      "proposer": args.proposer, "max_tokens": args.max_tokens,
                                      "cpu": cpu_description(), "rows": rows, "metrics": metrics})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
