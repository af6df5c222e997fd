"""vLLM plain vs vLLM speculative decoding vs vLLM + NSD, on real prompts (vLLM venv).

    .venv-vllm/bin/python benchmarks/vllm_bench.py --limit 2 --max-tokens 48

Three engines run one after another (plain; n-gram SD; draft-model SD), each in a
process of its own (vLLM 0.32's CPU build cannot build a second engine in one process:
re-registering its kernel overrides fails). The draft-model engine is built with NSD configured and runs in this process, so per prompt and
temperature its methods (stock SD, NSD θ, NSD with a budget) run back to back on the
same engine: those are interleaved. Acceptance length, per-position acceptance and D come
from the plugin's per-request report; tokens/s is generated tokens over wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from nsd.bench.datasets import DatasetConfig, load_prompts  # noqa: E402
from nsd.verify import RuleConfig  # noqa: E402

MODELS = Path(os.environ.get("NSD_CACHE", Path.home() / ".cache" / "nsd")) / "models"


def build(spec: dict | None, report: Path, args: argparse.Namespace):
    import vllm

    extra = {"nsd": {"rule": "exact", "report": str(report), "log_requests": False}} if spec else {}
    return vllm.LLM(model=str(MODELS / args.target / "hf"), dtype="bfloat16", max_model_len=2048,
                    seed=0, kv_cache_memory_bytes=1 << 30, compilation_config={"mode": 0},
                    speculative_config=spec, additional_config=extra)


def texts_for(llm, prompts) -> list[str]:
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": p.text}], tokenize=False,
                                    add_generation_prompt=True) if p.chat else p.text for p in prompts]


def report_line(report: Path, request_id: str) -> dict | None:
    """The plugin's line for a request (``RequestOutput.request_id``).

    With one worker, the plugin writes it when the scheduler finishes the request, before
    ``generate`` returns; lines are matched by id, not by their position in the file.
    """
    if not report.exists():
        return None
    with open(report, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    found = [r for r in rows if r.get("external_request_id") == request_id]
    return found[-1] if found else None


def run_one(llm, text: str, temperature: float, args, report: Path | None) -> dict:
    import vllm

    t0 = time.perf_counter()
    out = llm.generate([text], vllm.SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                                   seed=args.seed), use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    row = {"tokens": len(out.outputs[0].token_ids), "wall": wall}
    if report is not None:
        row["ledger"] = report_line(report, out.request_id)
        if row["ledger"] is None:
            raise SystemExit(f"no nsd report line for request {out.request_id} in {report}")
    return row


def summarise(rows: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    out = {"tok_s": tokens / sum(r["wall"] for r in rows), "tokens": tokens}
    ledgers = [r["ledger"] for r in rows if r.get("ledger")]
    if ledgers:
        steps = sum(x["steps"] for x in ledgers)
        out["tau"] = sum(x["tokens"] for x in ledgers) / steps if steps else float("nan")
        out["d_per_token"] = sum(x["deviation"] for x in ledgers) / tokens
        out["d_max"] = max(x["deviation"] for x in ledgers)
        k = max(len(x["position_reached"]) for x in ledgers)
        reached = [sum(x["position_reached"][i] for x in ledgers if i < len(x["position_reached"])) for i in range(k)]
        acc = [sum(x["position_accepted"][i] for x in ledgers if i < len(x["position_accepted"])) for i in range(k)]
        out["per_position"] = [round(a / r, 2) if r else None for a, r in zip(acc, reached)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--datasets", default="humaneval,spec-bench")
    ap.add_argument("--limit", type=int, default=2, help="prompts per dataset")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("-k", type=int, default=4, help="draft tokens per step")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--theta", type=float, default=0.9)
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the raw rows here")
    ap.add_argument("--engines", default="plain,ngram,draft")
    ap.add_argument("--rows-out", type=Path, help=argparse.SUPPRESS)  # one engine, in a child process
    args = ap.parse_args()
    names = args.engines.split(",")
    if args.rows_out is None:
        results: dict[tuple[str, float], list[dict]] = defaultdict(list)
        workdir = Path(tempfile.mkdtemp(prefix="nsd-vllm-bench-"))
        for name in names:
            rows_out = workdir / f"{name}.json"
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--engines", name,
                            "--rows-out", str(rows_out)], check=True)
            for label, temp, rows in json.loads(rows_out.read_text()):
                results[(label, temp)] += rows
        print_table(results, args)
        return
    prompts = load_prompts(DatasetConfig(names=tuple(args.datasets.split(",")), limit=args.limit))
    temps = [float(t) for t in args.temperatures.split(",")]
    results: dict[tuple[str, float], list[dict]] = defaultdict(list)
    workdir = Path(tempfile.mkdtemp(prefix="nsd-vllm-bench-"))

    from nsd.integrations.vllm.plugin import ACTIVE

    engines = {
        "plain": ("vLLM plain", None, [None]),
        "ngram": ("vLLM SD ngram", {"method": "ngram", "num_speculative_tokens": args.k,
                           "prompt_lookup_max": 4, "prompt_lookup_min": 2}, [("SD", RuleConfig("exact"))]),
        "draft": ("vLLM SD draft", {"method": "draft_model", "model": str(MODELS / args.draft / "hf"),
                           "num_speculative_tokens": args.k},
         [("SD", RuleConfig("exact")),
          (f"NSD θ{args.theta}", RuleConfig("nucleus", theta=args.theta)),
          (f"NSD θ{args.theta} B={args.budget}", RuleConfig("nucleus", theta=args.theta, budget=args.budget))]),
    }
    for name, spec, rules in (engines[n] for n in names):
        report = workdir / f"{len(results)}.jsonl"
        t0 = time.perf_counter()
        llm = build(spec, report, args)
        print(f"[bench] {name}: engine ready in {time.perf_counter() - t0:.0f} s", flush=True)
        texts = texts_for(llm, prompts)
        base = ACTIVE.config
        for text in texts:
            for temp in temps:
                for rule in rules:
                    label = name if rule is None else (name if rule[0] == "SD" else f"vLLM+{rule[0]}")
                    if rule is not None:
                        ACTIVE.config = dataclasses.replace(base, rule=rule[1])
                    results[(label, temp)].append(run_one(llm, text, temp, args, report if spec else None))
        del llm
    args.rows_out.write_text(json.dumps([[k[0], k[1], v] for k, v in results.items()]))


def print_table(results: dict, args: argparse.Namespace) -> None:
    n = len(load_prompts(DatasetConfig(names=tuple(args.datasets.split(",")), limit=args.limit)))
    print(f"\n{n} prompts ({args.datasets}, {args.limit} each), {args.max_tokens} new tokens, "
          f"k={args.k}\n")
    print("| method | temp | tok/s | acceptance length | accept by position | D/token | max D |")
    print("|---|---|---|---|---|---|---|")
    for (label, temp), rows in results.items():
        s = summarise(rows)
        print(f"| {label} | {temp:g} | {s['tok_s']:.2f} | {s.get('tau', 1.0):.2f} | "
              f"{s.get('per_position', '-')} | {s.get('d_per_token', 0):.3f} | {s.get('d_max', 0):.2f} |")
    if args.json:
        args.json.write_text(json.dumps({f"{k[0]}@{k[1]}": v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
