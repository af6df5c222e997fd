"""``nsd bench``: the argparse front of the benchmark (argparse lives only here).

Example::

    nsd bench --dataset humaneval --limit 20 --methods ar,sd,nsd --theta 0.9 \\
        --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --out results/humaneval
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from nsd import options as optspec
from nsd.cli_args import (add_decoding_args, add_model_args, backend_options, generation_config,
                          note_unread_by_proposers)
from nsd.errors import NSDError

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
BENCH_MAX_NEW_TOKENS = 256


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _csv_floats(text: str) -> list[float]:
    try:
        return [float(part) for part in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None


def _csv_ints(text: str) -> list[int]:
    try:
        return [int(part) for part in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of whole numbers: {text!r}") from None


def _int_k(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise NSDError(f"--ks takes whole numbers or auto, got {text!r}") from None


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    # "resolve": the shared model flags are reused, and --proposer, which takes a list
    # here, is redefined below. θ and B take lists too: one method per value.
    p = subparsers.add_parser(
        "bench", conflict_handler="resolve",
        help="benchmark AR, SD, NSD (and transformers' peers) on Spec-Bench, HumanEval, MT-Bench",
        description="Run every method on every prompt (interleaved), then write results.json, "
                    "report.md and plots to --out. Interrupted runs resume from the journal there.")
    add_model_args(p, need_target=False)
    p.add_argument("--target", default=None,
                   help=f"target model: registry name, .gguf file or HF folder (default: {DEFAULT_TARGET}, "
                        f"with draft {DEFAULT_DRAFT})")
    p.add_argument("--draft", default=None,
                   help="draft model sharing the target's tokenizer (default: none for a custom target)")
    add_decoding_args(p, with_method=False,
                      skip=("theta", "budget", "max_new_tokens", *optspec.LOSSY_SWEEP_KNOBS))
    _add_data_args(p)
    grid = p.add_argument_group("methods")
    grid.add_argument("--methods", type=_csv, default=["ar", "sd", "nsd"],
                      help="comma-separated from ar, sd, nsd, nsd-budget, typical, "
                           f"{', '.join(optspec.LOSSY_METHODS)}, hf-ar, hf-assisted, hf-pld, "
                           "llama-generate, llama-speculative (default: ar,sd,nsd)")
    grid.add_argument("--ks", type=_csv, default=[],
                      help="draft lengths to compare, e.g. auto,2,4: each speculative method runs "
                           "once per k, labelled /k=… (default: just --draft-length)")
    grid.add_argument("--draft-contexts", type=_csv_ints, default=[],
                      help="draft contexts to compare (see --draft-context), e.g. 0,64: each "
                           "speculative method runs once per value, labelled /ctx=… (0: ctx=all, "
                           "the whole prompt; default: just --draft-context)")
    grid.add_argument("--theta", type=_csv_floats, default=[optspec.default("theta")],
                      help=f"{optspec.ALL['theta'].help}; comma-separated, one nsd method each "
                           f"(default: {optspec.default('theta')})")
    grid.add_argument("--budget", type=_csv_floats, default=[],
                      help=f"{optspec.ALL['budget'].help}; comma-separated, one nsd-budget method "
                           "each")
    grid.add_argument("--budget-theta", type=float, default=None,
                      help="θ used by nsd-budget (default: the largest --theta)")
    for name in optspec.LOSSY_SWEEP_KNOBS:  # the engines' rules: a method per combination
        option = optspec.ALL[name]
        grid.add_argument(option.flag, dest=name, type=_csv_floats, default=[],
                          help=f"{option.help}; comma-separated, swept (default: {option.default})")
    grid.add_argument("--proposers", "--proposer", dest="proposers", type=_csv, default=None,
                      help="draft, ngram and/or hybrid (draft model and prompt lookup, the cheaper "
                           "per block), comma-separated (default: "
                           f"{optspec.DEFAULT_PROPOSER} with a draft model whose prompt-lookup "
                           "estimates are stored, as the built-in pair's; draft with another; "
                           f"{optspec.default_proposer(False)} without one)")
    grid.add_argument("--max-new-tokens", type=int, default=BENCH_MAX_NEW_TOKENS,
                      help=f"new tokens per generation (default {BENCH_MAX_NEW_TOKENS}, longer than "
                           "a plain generation's: HumanEval usually stops earlier at its stop "
                           "sequences)")
    _add_run_args(p)
    p.set_defaults(func=cmd_bench)
    return p


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """Which prompts: datasets, limits, categories, chat template."""
    data = p.add_argument_group("data")
    data.add_argument("--dataset", type=_csv, default=["humaneval"],
                      help="comma-separated: spec-bench, humaneval, mt-bench, or a .jsonl file "
                           "(default: humaneval)")
    data.add_argument("--prompt-field", default="prompt",
                      help="text field of a custom .jsonl dataset (a list of turns: the first)")
    data.add_argument("--limit", type=int, default=None,
                      help="prompts per dataset (per category with --per-category)")
    data.add_argument("--per-category", action="store_true", help="apply --limit to each category")
    data.add_argument("--categories", type=_csv, default=[], help="only these categories, comma-separated")
    data.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                      help="force the chat template on/off (default: on for instructions, off "
                           "for HumanEval's code completion)")


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """Where results go and how the run behaves: resume, log-likelihood, HumanEval execution,
    load flags, warm-up, plots, progress."""
    run = p.add_argument_group("run")
    run.add_argument("--out", type=Path, default=None, help="output folder (default: results/<dataset>)")
    run.add_argument("--overwrite", action="store_true",
                     help="discard an earlier run in --out instead of resuming it")
    run.add_argument("--no-loglik", dest="loglik", action="store_false",
                     help="skip the target log-likelihood of each output (one forward each)")
    run.add_argument("--no-exec", dest="execute", action="store_false",
                     help="do not run HumanEval tests (pass@1 is then not reported). The tests run "
                          "model-written code in a subprocess with time and memory limits; it is "
                          "not a sandbox")
    run.add_argument("--exec-timeout", type=float, default=10.0, help="seconds per HumanEval test run")
    run.add_argument("--no-dataset-stops", dest="dataset_stops", action="store_false",
                     help="let HumanEval generations run past its stop sequences (\\ndef, \\nclass, "
                          "...); completions are still cut there for pass@1")
    run.add_argument("--max-other-load", type=float, default=0.25,
                     help="flag calls during which other processes used more than this share of "
                          "all CPU cores (default 0.25)")
    run.add_argument("--rerun-loaded", action="store_true",
                     help="on resume, run again every prompt with a call that was flagged as "
                          "loaded (all its methods, so they stay interleaved)")
    run.add_argument("--no-warmup", dest="warmup", action="store_false",
                     help="skip the short untimed warm-up calls")
    run.add_argument("--no-plots", dest="plots", action="store_false", help="write no PNG plots")
    run.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


_SWEPT = ("method", "theta", "budget", *optspec.LOSSY_SWEEP_KNOBS)  # per method, not per run


def _added_settings(base) -> dict[str, object]:
    """Every decoding knob at its default, by its path in the settings: a run journaled
    before nsd had a knob (the engines' rules' scalars, ``draft_context``) behaved as its
    default does, so it resumes under a run that leaves the knob there."""
    return {f"generation.{f.name}": optspec.default(f.name) for f in dataclasses.fields(base)
            if f.name not in _SWEPT and f.name in optspec.ALL}


def _settings(args: argparse.Namespace, base) -> dict:
    """What must match for records to be comparable (see nsd.bench.store); the selection
    of datasets, prompts and methods may change between resumed runs."""
    generation = {k: v for k, v in dataclasses.asdict(base).items() if k not in _SWEPT}
    return {"target": args.target, "draft": args.draft,
            **dataclasses.asdict(backend_options(args)),
            "generation": generation, "budget_theta": args.budget_theta, "chat": args.chat,
            "prompt_field": args.prompt_field, "dataset_stops": args.dataset_stops,
            "loglik": args.loglik, "execute": args.execute, "exec_timeout_s": args.exec_timeout}


def cmd_bench(args: argparse.Namespace) -> int:
    from nsd.bench.datasets import DatasetConfig, load_prompts
    from nsd.bench.methods import expand_methods
    from nsd.bench.report import write_report
    from nsd.bench.runner import RunConfig, collect, pending
    from nsd.bench.store import Journal
    from nsd.draftlen.priors import lookup_measured

    if args.target is None:  # the default pair; a custom target brings its own draft
        args.target = DEFAULT_TARGET
        args.draft = args.draft or DEFAULT_DRAFT
    proposers = args.proposers if args.proposers is not None else \
        [optspec.default_proposer(bool(args.draft), lookup_measured(args.target, args.draft))]
    note_unread_by_proposers(args, proposers)
    if not 0.0 <= args.max_other_load <= 1.0:
        raise NSDError(f"--max-other-load must be in [0, 1], got {args.max_other_load}")
    ks = [k if k == "auto" else _int_k(k) for k in args.ks]
    specs = expand_methods(args.methods, args.theta, args.budget, proposers, args.budget_theta, ks,
                           {name: getattr(args, name) for name in optspec.LOSSY_SWEEP_KNOBS},
                           args.draft_contexts)
    if not args.draft and any(s.proposer in optspec.NEEDS_DRAFT or s.family == "hf-assisted" for s in specs):
        raise NSDError("the draft and hybrid proposers and hf-assisted need a draft model (--draft NAME)")
    # Validate every scalar knob through the shared path (θ/budget vary per method).
    base = generation_config(args, method="ar", theta=optspec.default("theta"),
                             budget=optspec.default("budget"),
                             **{n: optspec.default(n) for n in optspec.LOSSY_SWEEP_KNOBS})
    if base.temperature > 0 and any(s.is_hf for s in specs):
        raise NSDError("the hf-* peers are greedy only; use --temperature 0 or drop them from --methods")
    config = RunConfig(methods=specs, generation=base, loglik=args.loglik, execute=args.execute,
                       exec_timeout_s=args.exec_timeout, dataset_stops=args.dataset_stops,
                       warmup=args.warmup)
    prompts = load_prompts(DatasetConfig(names=tuple(args.dataset), limit=args.limit,
                                         per_category=args.per_category,
                                         categories=tuple(args.categories),
                                         prompt_field=args.prompt_field, chat=args.chat))
    out = args.out or Path("results") / "-".join(Path(d).stem for d in args.dataset)
    settings = _settings(args, base)
    # Nothing is written to --out until the first record is: a run that cannot start
    # (a model or peer program missing) leaves the folder, and any run in it, as it was.
    journal = Journal(out, settings, overwrite=args.overwrite, defer_writes=True, added=_added_settings(base))
    if args.rerun_loaded:
        dropped = journal.drop_loaded_prompts()
        print(f"nsd bench: {dropped} prompts had calls run under load; running them again",
              file=sys.stderr)
    todo = pending(journal, prompts, specs)
    print(f"nsd bench: {len(prompts)} prompts x {len(specs)} methods, {todo} calls to run, "
          f"{len(prompts) * len(specs) - todo} already in {journal.path}", file=sys.stderr)
    if todo:
        records = _runner(args, config, journal).run(prompts)
    else:  # all done: rewrite the report without loading any model
        records = collect(journal, prompts, specs)
    summary, text = write_report(out, records, specs, {**settings, "datasets": list(args.dataset)},
                                 args.max_other_load)
    if args.plots:
        from nsd.bench.plots import write_plots

        write_plots(summary, out)
    print(text)
    print(f"nsd bench: wrote {out / 'results.json'} and {out / 'report.md'}", file=sys.stderr)
    return 0


def _runner(args: argparse.Namespace, config, journal):
    from nsd.draftlen.cpu_load import LoadMonitor
    from nsd.bench.runner import BenchRunner

    methods = config.methods
    if any(m.family == "llama-speculative" for m in methods):
        from nsd.bench.llama_spec_peer import find_program

        find_program()  # a missing program fails now, not after the models load
    engine = _engine(args, draft=any(m.proposer in optspec.NEEDS_DRAFT or m.family == "llama-speculative"
                                     for m in methods))
    peers = None
    if any(m.is_hf for m in methods):
        from nsd.bench.hf_peers import HFPeers

        peers = HFPeers(args.target, args.draft, need_draft=any(m.family == "hf-assisted" for m in methods),
                        threads=args.threads)
    llama_peers = _llama_peers(args, engine, {m.family for m in methods if m.is_llama_peer})
    return BenchRunner(engine, config, journal, peers=peers, monitor=LoadMonitor(args.max_other_load),
                       progress=args.progress, llama_peers=llama_peers)


def _llama_peers(args: argparse.Namespace, engine, families: set[str]) -> dict:
    """llama.cpp's own programs on the very files the engine loaded."""
    if not families:
        return {}
    target = engine.target_model.file
    if target is None or not target.endswith(".gguf"):
        raise NSDError(f"{sorted(families)[0]} needs a GGUF target on the llama.cpp backend")
    peers = {}
    if "llama-generate" in families:
        from nsd.bench.llama_peer import LlamaGeneratePeer

        peers["llama-generate"] = LlamaGeneratePeer(target, engine.tokenizer, engine.eos_token_ids,
                                                    args.threads, args.n_ctx)
    if "llama-speculative" in families:
        from nsd.bench.llama_spec_peer import LlamaSpeculativePeer

        # The draft's full-vocabulary file: llama.cpp cannot run nsd's reduced head.
        dm = engine.draft_model
        draft = (dm.source_file or dm.file) if dm is not None else None
        if draft is None or not draft.endswith(".gguf"):
            raise NSDError("llama-speculative needs a GGUF --draft on the llama.cpp backend")
        peers["llama-speculative"] = LlamaSpeculativePeer(target, draft, engine.tokenizer, args.threads,
                                                          args.n_ctx)
    return peers


def _engine(args: argparse.Namespace, draft: bool):
    """Our engine. The draft model is loaded only when a method drafts with it; an Engine
    switches between it and n-gram lookup per call."""
    import dataclasses

    from nsd.api import load_engine

    # Without a draft loaded, --draft-vocab has nothing to act on; it stays in the run's
    # settings all the same, so a resumed run may add or drop drafting methods.
    options = backend_options(args)
    if not draft:
        options = dataclasses.replace(options, draft_vocab="auto")
    return load_engine(args.target, draft=args.draft if draft else None,
                       proposer=optspec.default_proposer(draft), options=options, k_max=args.k_max)
